"""``StepLoop``: the one loop that steps an ``EngineCore``, for every caller: ``LLM.generate``, streaming
(``generate`` with n = 1, ``chat``), the server's engine thread and the benchmarks. It is not a thread: it
runs on whichever thread calls it (the server's is ``InProcessClient``'s ``EngineThread``).

Requests are added through it with an optional ``on_report(output)`` callback, called with each report the
engine gives for the request (which ones: its ``SamplingParams.output_kind``; the last one has
``finished`` set); it keeps the recent decode rate. ``run`` steps until given requests finish; the server
calls ``step`` from its own thread, between the commands it receives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.sequence import Request

OnReport = Callable[[RequestOutput], None]
RATE_WINDOW_S = 5.0


@dataclass
class _Tracked:
    request: Request
    on_report: OnReport | None
    output: RequestOutput | None = None  # the final report, once finished


class StepLoop:
    """Steps ``engine`` (an ``EngineCore``) and routes its reports to the requests added through it."""

    def __init__(self, engine):
        self.engine = engine
        self._tracked: dict[str, _Tracked] = {}
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens) of the steps in the rate window
        self._window_tokens = 0
        self.tokens_per_second = 0.0

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        on_report: OnReport | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request (``EngineCore.add_request``'s errors propagate)."""
        req = self.engine.add_request(
            prompt_ids, params, prompt=prompt, request_id=request_id, cache_salt=cache_salt
        )
        self._tracked[req.request_id] = _Tracked(req, on_report)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request (its KV stays in the prefix cache); nothing more is reported for it."""
        self._tracked.pop(request_id, None)
        self.engine.abort(request_id)

    def output(self, request_id: str) -> RequestOutput | None:
        tr = self._tracked.get(request_id)
        return tr.output if tr is not None else None

    def forget(self, request_id: str) -> RequestOutput | None:
        """Stop tracking a finished request; returns its output."""
        tr = self._tracked.pop(request_id, None)
        return tr.output if tr is not None else None

    @property
    def idle(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; hands each tracked request's reports to its callback."""
        before = self.engine.stats.generated_tokens
        outs = self.engine.step()
        for out in outs:
            tr = self._tracked.get(out.request_id)
            if tr is None:
                continue
            if out.finished:
                tr.output = out
            if tr.on_report is not None:
                tr.on_report(out)
        now = time.monotonic()
        made = self.engine.stats.generated_tokens - before
        self._window.append((now, made))
        self._window_tokens += made
        while now - self._window[0][0] >= RATE_WINDOW_S:  # O(1) a step: a sum over the window was ~400 steps
            self._window_tokens -= self._window.popleft()[1]
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        self.tokens_per_second = self._window_tokens / span if span > 0 else 0.0
        return outs

    def run(
        self,
        requests: list[Request],
        should_stop: Callable[[], bool] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> list[RequestOutput | None]:
        """Step until every one of ``requests`` has finished, or ``should_stop()`` turns true between steps;
        returns their final reports in order (None for one that did not finish; the whole output unless the
        request asked for DELTA reports) and stops tracking them. If the loop ends early by an exception
        (Ctrl-C, an engine failure), the unfinished ones are aborted."""
        ids = [r.request_id for r in requests]
        try:
            while any(self.output(i) is None for i in ids):
                if should_stop is not None and should_stop():
                    break
                if self.idle:
                    raise RuntimeError("the engine went idle with requests unfinished")
                self.step()
                if on_step is not None:
                    on_step()
        finally:
            for i in ids:
                if self.output(i) is None:
                    self.abort(i)
        return [self.forget(i) for i in ids]
