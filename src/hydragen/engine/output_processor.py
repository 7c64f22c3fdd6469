"""The output processor: appends sampled tokens, detokenizes incrementally, checks stops, builds outputs.

Each sequence carries an incremental detokenizer and, with stop strings, a stop checker: a token costs
O(1) amortized work, never a decode of the whole generation. ``Sequence.text`` only ever holds text that
is final: no later token can change it and it cannot turn out to start a stop string, so streaming can
send it as it grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydragen.engine.detokenizer import IncrementalDetokenizer
from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sequence import Request, Sequence
from hydragen.engine.stop_strings import StopChecker


class StageError(RuntimeError):
    """A per-request failure tagged with the stage it happened in (for the request's error message)."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(str(cause))
        self.stage, self.cause = stage, cause


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    stops: StopChecker | None


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_context: int):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context

    def append(self, s: Sequence, token: int, logprobs: dict[int, float] | None = None) -> bool:
        """Add one sampled token; returns True when the sequence is finished."""
        s.generated.append(token)
        if logprobs is not None:
            s.logprobs = s.logprobs or []
            s.logprobs.append(logprobs)
        p = s.request.params
        if not p.ignore_eos and token in self.eos_ids:
            s.finish_reason, s.stop_reason = "stop", None
        elif p.stop_token_ids and token in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        else:
            self._add_text(s, [token])
        if s.finish_reason is None and (
            len(s.generated) >= p.max_tokens or s.context_len >= self.max_context
        ):
            s.finish_reason = "length"
        return s.finished

    def append_forced(self, s: Sequence, tokens: list[int]) -> None:
        """Add tokens chosen without sampling (jump-forward, ``Engine.extend``): no distribution was sampled
        for them, so their logprobs entries are ``{token: None}``. Stops are not checked on them."""
        s.generated.extend(tokens)
        s.forced += len(tokens)
        if s.request.params.logprobs is not None:
            s.logprobs = s.logprobs if s.logprobs is not None else []
            s.logprobs.extend({t: None} for t in tokens)
        self._add_text(s, tokens)

    def _state(self, s: Sequence) -> _TextState | None:
        if self.tokenizer is None:
            return None
        if s.detok is None:
            stops = s.request.params.stop
            s.detok = _TextState(
                IncrementalDetokenizer(self.tokenizer), StopChecker(stops) if stops else None
            )
        return s.detok

    def _add_text(self, s: Sequence, tokens: list[int]) -> None:
        state = self._state(s)
        if state is not None and s.finish_reason is None:
            try:
                piece = state.detok.add(tokens)
            except Exception as e:
                raise StageError("detokenization", e) from e
            self._feed(s, state, piece)

    @staticmethod
    def _feed(s: Sequence, state: _TextState, piece: str) -> None:
        if state.stops is None:
            s.text += piece
            return
        try:
            safe, hit = state.stops.feed(piece)
        except Exception as e:
            raise StageError("stop check", e) from e
        s.text += safe
        if hit is not None:
            s.finish_reason, s.stop_reason = "stop", hit

    def finish(self, s: Sequence) -> None:
        """Flush the held-back text of a finished sequence (a stop string found there still ends it)."""
        state = self._state(s)
        if state is None or (s.finish_reason == "stop" and isinstance(s.stop_reason, str)):
            return
        reason = s.finish_reason
        s.finish_reason = None
        try:
            piece = state.detok.flush()
        except Exception as e:
            s.finish_reason = reason
            raise StageError("detokenization", e) from e
        self._feed(s, state, piece)
        if s.finish_reason is None:
            s.finish_reason = reason
            if state.stops is not None:
                s.text += state.stops.flush()

    def text_of(self, s: Sequence) -> str:
        """The completion text so far: final text only (stop strings cut, a final EOS/stop token left out)."""
        return s.text

    @staticmethod
    def output(r: Request) -> RequestOutput:
        outs = [
            CompletionOutput(s.index, s.text, list(s.generated), s.finish_reason, s.logprobs, s.stop_reason)
            for s in r.seqs
        ]
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, outs, True, r.cached_tokens, r.error)
