"""Prompts to token ids, off the event loop, with the context checks that give a 400 before any work.

Tokenizing and chat templating run on a worker thread. A prompt whose character count alone proves it
cannot fit the context (every token decodes to at most ``max_token_chars`` characters) is refused before
it is tokenized at all, so a many-megabyte prompt costs no tokenizer time.
"""

from __future__ import annotations

import asyncio
import json
import threading

from hydragen.engine.sampling_params import ParamError
from hydragen.server.errors import APIError

# Normalizers can fold several characters into one (NFC composition, dropped control characters):
# allow for that before calling a prompt too long from its characters alone.
NORMALIZATION_SLACK = 4


class PromptEncoder:
    def __init__(self, tokenizer, context: int, vocab_size: int):
        self.tok, self.context, self.vocab_size = tokenizer, context, vocab_size
        self._max_chars: int | None = None
        self._lock = threading.Lock()

    # ---- character bound ---------------------------------------------------------------------
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit in the context as tokens (computed once, on a thread)."""
        with self._lock:
            if self._max_chars is None:
                per_token = max(
                    (
                        len(self.tok.decode([i], skip_special_tokens=False))
                        for i in range(self.tok.vocab_size)
                    ),
                    default=1,
                )
                self._max_chars = self.context * max(per_token, 1) * NORMALIZATION_SLACK
            return self._max_chars

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars():
            raise APIError(
                400,
                f"{param} is too long: {chars} characters cannot fit the model's context "
                f"of {self.context} tokens",
                param,
                code="context_length_exceeded",
            )

    # ---- a request's prompts -----------------------------------------------------------------------
    async def request_prompts(self, body, chat: bool, tool_format):
        """(prompts, tools) of a parsed request: [(token ids, text or None)] and its ToolSession (chat with
        tools, else None). The one place a request becomes token ids: the server and the data-parallel
        front (which routes on them) both call it, so they always agree."""
        if not chat:
            return await self.completion(body), None
        tools = body.tool_session(tool_format)
        ids = await self.chat(body.conversation(), tools, body.chat_template_kwargs)
        return [(ids, None)], tools

    # ---- completions ---------------------------------------------------------------------------
    async def completion(self, body) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) per prompt of a CompletionRequest; 400 for an empty, out-of-vocabulary
        or too long prompt. All of it on a worker thread: a prompt may be a million token ids."""
        return await asyncio.to_thread(self._completion, body)

    def _completion(self, body) -> list[tuple[list[int], str | None]]:
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise APIError(400, f"{param} must not be empty", param, code="invalid_value")
            if isinstance(p, str):
                if self.tok is None:
                    raise APIError(400, "this model has no tokenizer: send prompts as token ids", param)
                self._check_chars(len(p), param)
            else:
                self.check_length(len(p), param)
                low, high = min(p), max(p)
                if low < 0 or high >= self.vocab_size:
                    bad = low if low < 0 else high
                    raise APIError(
                        400,
                        f"{param}: token id {bad} is out of range [0, {self.vocab_size})",
                        param,
                        code="invalid_value",
                    )
        out = []
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                ids = self.tok.encode(p)
                if not ids:
                    raise APIError(400, f"{param} encodes to no tokens", param, code="invalid_value")
                self.check_length(len(ids), param)
                out.append((ids, p))
            else:
                out.append((list(p), None))
        return out

    # ---- chat --------------------------------------------------------------------------------------
    async def chat(
        self, conversation: list[dict], tools=None, template_kwargs: dict | None = None
    ) -> list[int]:
        """Token ids of the conversation through the chat template; ``tools``: the request's ToolSession
        (hydragen.tools), which renders its functions, earlier calls and results; ``template_kwargs``: the
        request's ``chat_template_kwargs``."""
        if self.tok is None or not self.tok.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        return await asyncio.to_thread(self._template, conversation, tools, template_kwargs)

    def _template(self, conversation: list[dict], tools, template_kwargs: dict | None = None) -> list[int]:
        chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in conversation)
        if tools is not None:  # the functions' definitions are rendered into the prompt too
            chars += sum(len(json.dumps(t.to_openai())) for t in tools.tools)
        self._check_chars(chars, "messages")
        try:
            if tools is None:
                ids = self.tok.apply_chat_template(
                    conversation, add_generation_prompt=True, chat_template_kwargs=template_kwargs
                )
            else:
                ids = tools.prompt_ids(self.tok, conversation, template_kwargs)
        except ParamError as e:
            raise APIError(400, str(e), e.param, code="invalid_value") from None
        except ValueError as e:
            raise APIError(400, str(e), "messages", code="invalid_value") from None
        self.check_length(len(ids), "messages")
        return ids

    # ---- the context budget --------------------------------------------------------------------
    def check_length(self, tokens: int, param: str) -> None:
        if tokens >= self.context:
            raise APIError(
                400,
                f"{param} has {tokens} tokens; the model's context is {self.context} tokens "
                "(at least one must be left to generate)",
                param,
                code="context_length_exceeded",
            )

    def max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None, param: str) -> int:
        """Tokens to generate: the request's value, refused when prompt + it exceeds the context (as vLLM
        does), or without one the default capped to the room left (the whole room when default is None)."""
        room = self.context - prompt_tokens
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"this model's context is {self.context} tokens, but {prompt_tokens} prompt tokens + "
                f"{param}={requested} would need {prompt_tokens + requested}; "
                f"lower {param} or shorten the prompt",
                param,
                code="context_length_exceeded",
            )
        return requested
