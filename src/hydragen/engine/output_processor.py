"""The output processor: appends sampled tokens, checks stops and lengths, builds request outputs."""

from __future__ import annotations

from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_context: int):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context

    def append(self, s: Sequence, token: int, logprobs: dict[int, float] | None = None) -> bool:
        """Add one sampled token; returns True when the sequence is finished."""
        s.generated.append(token)
        if logprobs is not None:
            s.logprobs = s.logprobs or []
            s.logprobs.append(logprobs)
        return self._check_finish(s, token)

    def _check_finish(self, s: Sequence, token: int) -> bool:
        p = s.request.params
        if not p.ignore_eos and token in self.eos_ids:
            s.finish_reason, s.stop_reason = "stop", None
        elif p.stop_token_ids and token in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        elif p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(s.generated)
            window = len(s.text) - max(len(x) for x in p.stop)
            hits = [(i, x) for x in p.stop if (i := text.find(x, max(0, window))) >= 0]
            s.text = text
            if hits:
                i, x = min(hits)
                s.text = text[:i]
                s.finish_reason, s.stop_reason = "stop", x
        too_long = s.context_len >= self.max_context
        if s.finish_reason is None and (len(s.generated) >= p.max_tokens or too_long):
            s.finish_reason = "length"
        return s.finished

    def finish(self, s: Sequence) -> None:
        s.text = self.text_of(s)

    def text_of(self, s: Sequence) -> str:
        """The completion text so far: stop strings cut, a final EOS/stop token left out."""
        if self.tokenizer is None:
            return ""
        if s.finish_reason == "stop" and isinstance(s.stop_reason, str):
            return s.text
        ids = s.generated[:-1] if s.finish_reason == "stop" else s.generated
        return self.tokenizer.decode(ids)

    @staticmethod
    def output(r: Request) -> RequestOutput:
        outs = [
            CompletionOutput(s.index, s.text, list(s.generated), s.finish_reason, s.logprobs, s.stop_reason)
            for s in r.seqs
        ]
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, outs, True, r.cached_tokens, r.error)
