"""``POST /v1/completions``: one or more prompts (text or token ids) continued, with OpenAI's text-completion
choices and log-probabilities."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from hydragen.engine.outputs import CompletionOutput
from hydragen.server.protocol import CompletionRequest
from hydragen.server.responses import token_text
from hydragen.server.serving import ParamNames
from hydragen.server.serving_openai import OpenAIServing

DEFAULT_MAX_TOKENS = 16  # a completion without max_tokens (OpenAI's default), capped to the context left


class CompletionChoices:
    """Text-completion choices; log-probabilities as OpenAI's legacy shape (tokens, their logprobs, the top
    alternatives and where each token starts in the text)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, want_logprobs: bool):
        self.tok, self.want_lp = tokenizer, want_logprobs
        self._text_offset: dict[int, int] = {}  # per choice: characters of its tokens' strings sent so far

    def opening(self, count: int) -> list[dict]:
        return []

    def delta(self, index: int, piece: CompletionOutput) -> list[dict]:
        lp = self.logprobs(piece.logprobs, piece.token_ids, index) if piece.logprobs else None
        return [{"index": index, "text": piece.text, "logprobs": lp, "finish_reason": piece.finish_reason}]

    def final(self, index: int, text: str, ids: list[int], logprobs: list, reason: str | None) -> dict:
        return {
            "index": index,
            "finish_reason": reason,
            "text": text,
            "logprobs": self.logprobs(logprobs, ids, index),
        }

    def logprobs(self, lps: list[dict[int, float]], ids: list[int], index: int) -> dict | None:
        if not self.want_lp:
            return None
        tokens = [token_text(self.tok, t) for t in ids]
        return {
            "tokens": tokens,
            "token_logprobs": [lp[t] for lp, t in zip(lps, ids, strict=False)],
            "top_logprobs": [{token_text(self.tok, k): v for k, v in lp.items()} for lp in lps],
            "text_offset": self._offsets(index, tokens),
        }

    def _offsets(self, index: int, tokens: list[str]) -> list[int]:
        """Where each token starts in the choice's text, counted over the tokens' own strings and carried
        across stream chunks (as vLLM counts them; a character split over tokens shows in each as U+FFFD)."""
        at = self._text_offset.get(index, 0)
        out = []
        for t in tokens:
            out.append(at)
            at += len(t)
        self._text_offset[index] = at
        return out


class CompletionServing(OpenAIServing):
    async def create(self, http: Request) -> Response:
        body, log = await self.read(http, CompletionRequest, "cmpl-")
        logprobs = self.sampling(body)
        prompts = await self.encoder.completion(body)
        params = self.params(
            body,
            prompts,
            logprobs,
            lambda i: "prompt" if len(prompts) == 1 else f"prompt[{i}]",
            DEFAULT_MAX_TOKENS,
        )
        log.record["prompt_tokens"] = sum(len(ids) for ids, _ in prompts)
        field = body.structured_field()
        await self.precompile(params[0].structured_outputs, field)
        names = ParamNames("prompt", body.max_tokens_param, field)
        streams = await self.submit(prompts, params, log.id, names)
        choices = CompletionChoices(self.model.tokenizer, logprobs is not None)
        return await self.answer(http, body, streams, choices, log)
