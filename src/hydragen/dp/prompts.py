"""The front's view of a request: the exact prompt token ids its replica will see, to route on.

The front parses the body and renders the prompt with the server's own code (``server.body``,
``PromptEncoder.request_prompts``: chat template, tool definitions and earlier calls) over the same
tokenizer files and tool-call format the replicas load, so the ids it routes on are the ids the replica
computes. A body that this refuses is not answered here: the front sends it to a replica anyway, whose
answer (its exact 4xx) goes back to the client.
"""

from __future__ import annotations

from hydragen.dp.router import RouteRequest
from hydragen.server.body import parse_body
from hydragen.server.prompts import PromptEncoder
from hydragen.server.protocol import ChatCompletionRequest, CompletionRequest, refuse_unsupported


class RequestPrompts:
    def __init__(self, tokenizer, tool_format, context: int, vocab_size: int, want_text: bool = False):
        self.tok, self.tool_format = tokenizer, tool_format
        self.encoder = PromptEncoder(tokenizer, context, vocab_size)
        self.want_text = want_text  # the approximate policy routes on text

    @classmethod
    def from_files(cls, config, path, tool_format: str | None, want_text: bool = False) -> RequestPrompts:
        """From the model's config (``read_config``) and tokenizer files (no weights), resolved as a
        replica resolves them."""
        from hydragen.model.tokenizer import has_tokenizer_files, load_tokenizer
        from hydragen.tools.formats import resolve_format

        tok, fmt = None, tool_format
        if has_tokenizer_files(path):
            tok = load_tokenizer(path)
            fmt = resolve_format(tok, tool_format)
        return cls(tok, fmt, config.max_position_embeddings, config.vocab_size, want_text)

    async def route_request(self, raw: bytes, chat: bool) -> RouteRequest:
        """The request's first prompt as the replica will tokenize it; APIError when the body is refused.
        (A completion with several prompts goes to one replica: it is routed on the first.)"""
        body = await parse_body(raw, ChatCompletionRequest if chat else CompletionRequest, refuse_unsupported)
        prompts, _ = await self.encoder.request_prompts(body, chat, self.tool_format)
        ids, text = prompts[0]
        if self.want_text and text is None:
            text = self.tok.decode(ids, skip_special_tokens=False) if self.tok is not None else ""
        return RouteRequest(token_ids=list(ids), text=text or "")
