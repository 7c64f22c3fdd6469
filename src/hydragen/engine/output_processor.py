"""The output processor: appends tokens, detokenizes incrementally, checks stops, ends sequences, builds
outputs. It alone writes a sequence's ``out`` state (tokens, text, logprobs, finish reason).

Each sequence carries an incremental detokenizer and, with stop strings, a stop checker: a token costs
O(1) amortized work, never a decode of the whole generation. ``text`` only ever holds text that is final:
no later token can change it and it cannot turn out to start a stop string, so streaming can send it as it
grows. Tokens chosen without sampling (forced text) are checked token by token too, so a stop inside them
ends the sequence at the token that completes it: tokens, text, usage and finish reason agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydragen.engine.detokenizer import Detokenizer, new_detokenizer
from hydragen.engine.isolation import failure_message
from hydragen.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from hydragen.engine.sequence import Request, SequenceState
from hydragen.engine.step_plan import StepResult
from hydragen.engine.stop_strings import StopChecker
from hydragen.structured.matcher import GrammarViolation


class StageError(RuntimeError):
    """A per-request failure tagged with the stage it happened in (for the request's error message)."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(str(cause))
        self.stage, self.cause = stage, cause


@dataclass
class _TextState:
    detok: Detokenizer
    stops: StopChecker | None


@dataclass
class Appended:
    """What appending a step's tokens did: the requests it changed, the sequences it ended (their text
    flushed), the requests that fail (a stage raised for them, named), and the tokens it added."""

    changed: dict[str, Request] = field(default_factory=dict)
    ended: list[SequenceState] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    sampled: int = 0
    forced: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_context: int):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context

    def append_step(self, result: StepResult, structured) -> Appended:
        """Append each sampler's tokens (one, or its verified drafts and the draw after them), and what its
        grammar forces after them (jump-forward), checking stops token by token; a sequence that ends has its
        held-back text flushed. A failure of one request's stage (stop check,
        detokenization, structured outputs) fails that request alone."""
        out = Appended()
        failing: set[str] = set()
        for s, run, logprobs in zip(result.samplers, result.tokens, result.logprobs, strict=True):
            req = s.request
            if req.request_id in failing or req.error is not None:
                continue  # failed in this step already (its fork could not copy, a sibling's stage raised)
            try:
                if s.grammar is not None:
                    out.sampled += 1
                    out.forced += self._append_structured(s, run[0], logprobs and logprobs[0], structured)
                else:  # one token, or verified drafts and the draw after them, each checked for a stop
                    for j, token in enumerate(run):
                        out.sampled += 1
                        if self.append(s, token, logprobs[j] if logprobs is not None else None):
                            break
                if s.finished:
                    self.finish(s)
                    out.ended.append(s)
                out.changed[req.request_id] = req
            except StageError as e:
                failing.add(req.request_id)
                out.failed.append((req, failure_message(e.stage, e.cause)))
            except Exception as e:
                failing.add(req.request_id)
                out.failed.append((req, failure_message("stop check", e)))
        out.ended = [s for s in out.ended if s.request.request_id not in failing]
        return out

    def _append_structured(self, s: SequenceState, token: int, logprobs: dict | None, structured) -> int:
        """Append a constrained sequence's sampled token and what jump-forward adds after it; returns how
        many forced tokens it kept. A token that is not the one sampled (a boundary re-split, forced text)
        gets the logprobs entry ``{token: None}``: no distribution was sampled for it."""
        try:
            tokens = structured.after_sample(s, token)
        except GrammarViolation as e:
            raise StageError("structured outputs", e) from e
        first, forced = tokens[0], tokens[1:]
        if logprobs is not None:  # alternatives the constraint excluded have probability 0: not listed
            logprobs = {t: lp for t, lp in logprobs.items() if lp != float("-inf")}
        kept = 0
        if first != token:
            kept += self.append_forced(s, [first])
        else:
            self.append(s, first, logprobs)
        if s.finished:
            return kept
        room = s.params.max_tokens - len(s.generated)
        forced = forced[: max(0, min(room, self.max_context - s.context_len))]
        if forced:
            kept += self.append_forced(s, forced)
        if not s.finished and s.grammar.done:  # the output is complete: end here instead of sampling EOS
            self.end(s, "stop")
        return kept

    def fail(self, r: Request, message: str) -> bool:
        """End a request with an error (its unfinished samples with "error"); False if it had failed
        already (the first error stands)."""
        if r.error is not None:
            return False
        r.error = message
        for s in r.seqs:
            self.end(s, "error")
        return True

    def append(self, s: SequenceState, token: int, logprobs: dict[int, float] | None = None) -> bool:
        """Add one sampled token; returns True when the sequence is finished."""
        out = s.out
        out.generated.append(token)
        if logprobs is not None:
            out.logprobs = out.logprobs or []
            out.logprobs.append(logprobs)
        self._check(s, token)
        return s.finished

    def append_forced(self, s: SequenceState, tokens: list[int]) -> int:
        """Add tokens chosen without sampling (jump-forward, ``EngineCore.append_forced``); their logprobs
        entries are ``{token: None}``: no distribution was sampled for them. They are checked one by one like
        sampled ones: a stop token, EOS or stop string among them ends the sequence there and the rest is
        dropped.
        Returns how many were kept."""
        out = s.out
        kept = 0
        for t in tokens:
            if s.finished:
                break
            out.generated.append(t)
            out.forced += 1
            kept += 1
            if s.params.logprobs is not None:
                out.logprobs = out.logprobs if out.logprobs is not None else []
                out.logprobs.append({t: None})
            self._check(s, t)
        return kept

    def end(self, s: SequenceState, reason: str) -> None:
        """End an unfinished sequence for a reason of the engine's ("abort", "error", "stop" when a grammar
        is complete)."""
        if s.out.finish_reason is None:
            s.out.finish_reason, s.out.stop_reason = reason, None

    def _check(self, s: SequenceState, token: int) -> None:
        out, p = s.out, s.params
        if not p.ignore_eos and token in self.eos_ids:
            out.finish_reason, out.stop_reason = "stop", None
        elif p.stop_token_ids and token in p.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
        else:
            self._add_text(s, [token])
        if out.finish_reason is None and (
            len(out.generated) >= p.max_tokens or s.context_len >= self.max_context
        ):
            out.finish_reason = "length"

    def _state(self, s: SequenceState) -> _TextState | None:
        if self.tokenizer is None:
            return None
        if s.out.detok is None:
            stops = s.params.stop
            detok = new_detokenizer(self.tokenizer, s.params.skip_special_tokens)
            s.out.detok = _TextState(detok, StopChecker(stops) if stops else None)
        return s.out.detok

    def _add_text(self, s: SequenceState, tokens: list[int]) -> None:
        state = self._state(s)
        if state is not None and s.out.finish_reason is None:
            try:
                piece = state.detok.add(tokens)
            except Exception as e:
                raise StageError("detokenization", e) from e
            self._feed(s, state, piece)

    @staticmethod
    def _feed(s: SequenceState, state: _TextState, piece: str) -> None:
        if state.stops is None:
            s.out.text += piece
            return
        try:
            safe, hit = state.stops.feed(piece)
        except Exception as e:
            raise StageError("stop check", e) from e
        s.out.text += safe
        if hit is not None:
            s.out.finish_reason, s.out.stop_reason = "stop", hit

    def finish(self, s: SequenceState) -> None:
        """Flush the held-back text of a finished sequence (a stop string found there still ends it)."""
        state = self._state(s)
        out = s.out
        if state is None or (out.finish_reason == "stop" and isinstance(out.stop_reason, str)):
            return
        reason = out.finish_reason
        out.finish_reason = None
        try:
            piece = state.detok.flush()
        except Exception as e:
            out.finish_reason = reason
            raise StageError("detokenization", e) from e
        self._feed(s, state, piece)
        if out.finish_reason is None:
            out.finish_reason = reason
            if state.stops is not None:
                out.text += state.stops.flush()

    @staticmethod
    def failed_output(r: Request) -> RequestOutput:
        """The report of a request whose own report could not be built: its error, no completions."""
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, [], True, r.cached_tokens, r.error)

    @staticmethod
    def output(r: Request) -> RequestOutput:
        """The request's report, as its ``output_kind`` asks: everything so far, or (DELTA) what is new
        since the last report, for the samples that changed. Marks what it reports as reported."""
        delta = r.params.output_kind is RequestOutputKind.DELTA
        outs = []
        for s in r.seqs:
            o = s.out
            tokens, text, lps = o.generated, o.text, o.logprobs
            if delta:
                new = len(tokens) > o.reported_tokens or len(text) > o.reported_text
                if not new and o.reported_finish == s.finished:
                    continue
                tokens, text = tokens[o.reported_tokens :], text[o.reported_text :]
                lps = lps[o.reported_tokens :] if lps is not None else None
            o.reported_tokens, o.reported_text, o.reported_finish = len(o.generated), len(o.text), s.finished
            outs.append(CompletionOutput(s.index, text, list(tokens), s.finish_reason, lps, s.stop_reason))
        return RequestOutput(
            r.request_id, r.prompt, r.prompt_ids, outs, r.finished, r.cached_tokens, r.error,
            r.first_scheduled,
        )  # fmt: skip
