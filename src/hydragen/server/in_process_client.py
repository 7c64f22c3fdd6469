"""``InProcessClient``: the ``EngineClient`` of an ``LLM`` in this process, stepped on a thread of its own.

Why the name: it is not an engine but the server's client of one (``engine_client``); the engine itself is
``EngineCore``, the loop that steps it ``StepLoop``. The engine is not thread-safe, so only this client's
thread touches it: the event loop submits requests and aborts through a queue of commands, and each
request's reports (the engine's DELTA outputs, passed on as they are) come back on its ``RequestStream``.
After every step the thread wakes each event loop once with all of that step's reports, not once per
request (``scripts/bench_client_reports.py`` counts the wakes).

Failures stay with their request: the engine ends a request whose own work failed (its output carries the
error, which its stream raises as a 500), and handling one request's report is guarded here the same way.
An exception the engine cannot attribute ends every request in flight with a 500, marks the engine failed
(``/health`` answers 503, new requests 503), and leaves the thread answering commands, so no client ever
waits on a dead engine.

When the engine's tensor-parallel group broke (a worker died or hung) and the server can rebuild it
(``engine_restarts``), the requests in flight end with that 500 as well, then the engine is rebuilt on this
thread while ``/health`` and new requests get a 503 ``engine_restarting``; it serves again once rebuilt, or
fails for good when it cannot be.

A step that runs past ``step_timeout`` seconds is stalled (``step_watchdog``): while it runs on, ``/health``
and new requests get a 503 ``engine_stalled`` (they would only queue behind it), and the log names the
step's requests. Its requests in flight keep waiting for it: a thread cannot be stopped from outside, and
the step may yet end; a data-parallel front restarts a replica that stays stuck (docs/data_parallel.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hydragen.engine.isolation import failure_message
from hydragen.engine.outputs import RequestOutput, RequestOutputKind
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.sequence import Request
from hydragen.engine.stats import EngineSnapshot
from hydragen.server.engine_client import ConstraintBuilder, RequestStream
from hydragen.server.errors import APIError
from hydragen.server.metrics import LatencyMetrics, RequestTimes
from hydragen.server.step_watchdog import DEFAULT_STEP_TIMEOUT_S, StepWatchdog
from hydragen.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from hydragen.server.engine_restarts import GroupRestarts

log = logging.getLogger("hydragen.server")


Delivery = tuple[RequestStream, RequestOutput | APIError]  # a report, or the error, for a request's stream


@dataclass
class _Tracked:
    request: Request
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    times: RequestTimes
    label: str  # what the server's log calls it (the HTTP request's id), for the stall log
    tokens_out: list[int] = field(default_factory=list)  # tokens reported, per sample


def request_failed(message: str) -> APIError:
    return APIError(500, f"request failed: {message}", code="request_failed")


class InProcessClient:
    """The ``EngineClient`` of ``llm``: one thread steps it, the event loop talks to it through commands
    and ``RequestStream``s. It also owns the step watchdog and, given ``restarts``, the rebuilding of a
    broken tensor-parallel group, so ``llm`` is its own: close it through ``close_llm``."""

    def __init__(
        self,
        llm,
        metrics: LatencyMetrics | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        restarts: GroupRestarts | None = None,
    ):
        """``step_timeout``: seconds after which a running step counts as stalled (0: never). ``restarts``:
        how to rebuild ``llm`` when its tensor-parallel group breaks (None: such a failure is final). The
        LLM can change then: read it through ``self.llm`` (None while it is rebuilt), never keep it."""
        self.llm = llm
        self.engine = llm.engine
        self.loop = llm.loop
        self.max_num_seqs = llm.engine.scheduler.max_num_seqs
        self._last_snapshot = llm.engine.snapshot
        self.restarts = restarts
        self.restarting: str | None = None  # why the engine is being rebuilt (its group broke)
        self._built_here = False  # the running LLM was rebuilt by the engine thread (its workers are its own)
        self._stopping = threading.Event()  # cuts a restart's backoff short on shutdown
        self.metrics = metrics or LatencyMetrics()
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: dict[
            asyncio.AbstractEventLoop, list[Delivery]
        ] = {}  # for each loop, since it last woke
        self._stop = False
        self._ids = 0
        self.failure: str | None = None  # set when the engine loop failed: it takes no more requests
        self.draining = False  # shutting down: in-flight requests finish, new ones are refused
        self.started = time.time()
        self.watchdog = StepWatchdog(step_timeout, self._stalled_requests)
        self._plan_before_step = None  # the engine's plan when the running step began
        self._thread = threading.Thread(target=self._run, name="hydragen-engine", daemon=True)
        self._thread.start()

    @property
    def tokens_per_second(self) -> float:
        loop = self.loop
        return 0.0 if self.failure is not None or loop is None or loop.idle else loop.tokens_per_second

    @property
    def restart_count(self) -> int:
        return self.restarts.count if self.restarts is not None else 0

    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (the broken engine's last one while it is rebuilt)."""
        engine = self.engine
        return engine.snapshot if engine is not None else self._last_snapshot

    async def compile(
        self, constraint: StructuredOutputsParams | ConstraintBuilder | None
    ) -> StructuredOutputsParams | None:
        """Build and compile on a worker thread, with the running engine's compiler (a 503 while the engine
        is rebuilt): the engine thread then finds it cached."""
        if constraint is None:
            return None
        engine = self.engine
        if engine is None:
            raise self.unavailable() or APIError(503, "the engine is being rebuilt", code="engine_restarting")
        structured = engine.structured

        def build() -> StructuredOutputsParams | None:
            built = constraint
            if not isinstance(constraint, StructuredOutputsParams):
                built = constraint(structured.compiler.ll_tokenizer, structured.literal_json_schema)
            if built is not None:
                structured.compile(built)
            return built

        return await asyncio.to_thread(build)

    # ---- called from the event loop ---------------------------------------------------------------
    def unavailable(self) -> APIError | None:
        """Why no request can be taken now (503), or None when the engine is ready."""
        if self.failure is not None or not self._thread.is_alive():
            reason = self.failure or "the engine thread stopped"
            return APIError(
                503, f"the engine failed and takes no more requests: {reason}", code="engine_failed"
            )
        if (broken := self.restarting or self._group_failure()) is not None:
            self._wake.set()  # a worker just died: the engine thread sees it now, not after its idle wait
            return APIError(
                503,
                f"the engine is restarting its tensor-parallel group, which broke: {broken}; "
                "it takes requests again once the group is rebuilt",
                code="engine_restarting",
            )
        if (ran := self.watchdog.stalled()) is not None:
            return APIError(
                503,
                f"the engine is stalled: its current step has run {ran:.1f} s, past the step timeout of "
                f"{self.watchdog.timeout:g} s; it takes no requests until that step ends",
                code="engine_stalled",
            )
        if self.draining:
            return APIError(
                503, "the server is shutting down and takes no more requests", code="shutting_down"
            )
        return None

    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, label: str = ""
    ) -> RequestStream:
        """Queue a request; its reports arrive on the returned stream. ``label``: the name the server's log
        knows it by (the HTTP request's id), used when a step holding it stalls.

        Raises ValueError/ParamError for a request the engine refuses, APIError 503 when unavailable.
        """
        if (err := self.unavailable()) is not None:
            raise err
        loop = asyncio.get_running_loop()
        stream = RequestStream()
        accepted: asyncio.Future = loop.create_future()
        times = RequestTimes(arrival=time.monotonic())
        self._commands.put(("add", (prompt_ids, params, prompt, loop, stream, accepted, times, label)))
        self._wake.set()
        if not self._thread.is_alive():  # nobody else will ever answer the command
            self._reject_queued()
        elif self.restarting is not None and (err := self.unavailable()) is not None:
            _set_exception(accepted, err)  # a restart began meanwhile: the engine thread answers after it
        stream.request_id = await accepted
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def begin_drain(self) -> None:
        self.draining = True

    def fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error`` (used when the shutdown grace period runs out)."""
        self._commands.put(("fail_all", error))
        self._wake.set()

    def shutdown(self) -> None:
        self.watchdog.close()
        self._stop = True
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def close_llm(self) -> None:
        """Close the LLM being served (the server owns it, as restarts replace it)."""
        llm = self.llm
        if llm is not None:
            llm.close()

    # ---- worker thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: fail everyone, never hang them
            traceback.print_exc()
            self._die(f"engine loop stopped: {type(e).__name__}: {e}")
        finally:
            self._wake_event_loops()
            self._reject_queued()
            if self._built_here:  # its workers die with this thread: stop them in order first
                self.close_llm()

    def _loop(self) -> None:
        while not self._stop:
            broken = self._group_failure()
            if broken is not None:
                self._restart(broken)
                continue
            self._drain_commands()
            self._wake_event_loops()
            if self.failure is not None or self.loop.idle:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._plan_before_step = self.engine.last_plan
            self.watchdog.begin()
            broken = None
            try:
                self.loop.step()  # every tracked request's report goes to _updated
            except Exception as e:  # not attributable to a request: the engine's state is suspect
                traceback.print_exc()
                if self.restarts is not None and self.restarts.broke_group(e):
                    broken = failure_message("engine step", e)
                else:
                    self._die(failure_message("engine step", e))
            finally:
                self.watchdog.end()
                self._wake_event_loops()
            if broken is not None:  # out of the handler: its traceback holds the old engine
                self._restart(broken)

    def _group_failure(self) -> str | None:
        """Why the tensor-parallel group is down, when it can be rebuilt (its workers' processes checked):
        asked between steps, and by ``/health`` and each new request, so that a worker that died between
        requests is seen then, not by a request that would fail on it."""
        if self.failure is not None or self.restarts is None:
            return None
        return self.restarts.group_failure(self.llm)

    def _stalled_requests(self) -> str:
        """The stalled step's requests, for the log (on the watchdog's thread, while this thread is stuck in
        the step, so nothing here changes under it): those of its plan, or every request in flight when it
        is stuck before it had a plan."""
        plan = self.engine.last_plan
        ids = [w.seq.request.request_id for w in plan.work] + [f.seq.request.request_id for f in plan.forks]
        if plan is self._plan_before_step or not ids:
            ids = list(self._tracked)
        names = []
        for rid in dict.fromkeys(ids):
            tr = self._tracked.get(rid)
            names.append(f"{tr.label} ({rid})" if tr is not None and tr.label else rid)
        return ", ".join(names) or "none"

    def _die(self, message: str) -> None:
        log.error("engine failed, ending %d request(s) in flight: %s", len(self._tracked), message)
        self.failure = message
        self._end_in_flight(APIError(500, f"engine failed: {message}", code="engine_failed"))

    def _restart(self, cause: str) -> None:
        """The tensor-parallel group broke: end the requests in flight, rebuild the engine, serve again; or
        fail for good when it cannot be rebuilt (``engine_restarts``)."""
        assert self.restarts is not None
        log.error("engine failed, ending %d request(s) in flight: %s", len(self._tracked), cause)
        self.restarting = cause
        error = APIError(500, f"engine failed: {cause}; the server restarts the group", code="engine_failed")
        self._end_in_flight(error)
        self._drain_commands()  # requests queued meanwhile get the 503 engine_restarting
        llm, why = self.restarts.restart(self._detach_llm, cause, self._stopping)
        if llm is None:
            self.failure = why
        else:
            self.llm, self.engine, self.loop, self._built_here = llm, llm.engine, llm.loop, True
        self.restarting = None

    def _detach_llm(self):
        """Hand over the LLM, keeping no reference to it or its engine (so a restart can free them)."""
        llm, self._last_snapshot = self.llm, self.engine.snapshot
        self.llm = self.engine = self.loop = self._plan_before_step = None
        return llm

    def _end_in_flight(self, error: APIError) -> None:
        for rid, tr in list(self._tracked.items()):
            tr.times.finished = time.monotonic()
            self._send(tr, error)
            with contextlib.suppress(Exception):  # best effort: the engine is already failed
                self.loop.abort(rid)
        self._tracked.clear()
        self._wake_event_loops()  # now: a restart's rebuild takes seconds

    def _queued_commands(self) -> Iterator[tuple[str, Any]]:
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for kind, payload in self._queued_commands():
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                self._tracked.pop(payload, None)
                self._abort_in_engine(payload)
            elif kind == "fail_all":
                for rid, tr in list(self._tracked.items()):
                    self._send(tr, payload)
                    del self._tracked[rid]
                    self._abort_in_engine(rid)

    def _abort_in_engine(self, request_id: str) -> None:
        """Abort in the engine unless it has already failed; a failing abort fails the engine."""
        if self.failure is None and self.restarting is None:
            try:
                self.loop.abort(request_id)
            except Exception as e:
                traceback.print_exc()
                self._die(failure_message("abort", e))

    def _add(self, prompt_ids, params, prompt, loop, stream, accepted, times, label) -> None:
        if accepted.done():  # answered already (a restart began after it was queued)
            return
        if (err := self.unavailable()) is not None:
            loop.call_soon_threadsafe(_set_exception, accepted, err)
            return
        self._ids += 1
        rid = f"req-{self._ids}"
        try:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)  # only what is new
            req = self.loop.add(prompt_ids, params, prompt=prompt, request_id=rid, on_report=self._updated)
        except (ValueError, TypeError) as e:
            loop.call_soon_threadsafe(_set_exception, accepted, e)
            return
        except Exception as e:  # a bug in admission: this request fails, the engine goes on
            traceback.print_exc()
            loop.call_soon_threadsafe(
                _set_exception, accepted, request_failed(failure_message("admission", e))
            )
            return
        n = len(req.seqs)
        self._tracked[rid] = _Tracked(req, loop, stream, times, label, [0] * n)
        loop.call_soon_threadsafe(_set_result, accepted, rid)

    def _reject_queued(self) -> None:
        """Answer every queued command once no engine loop will (it failed or stopped)."""
        error = self.unavailable() or APIError(503, "the engine stopped", code="engine_failed")
        for kind, payload in self._queued_commands():
            if kind == "add":
                loop, accepted = payload[3], payload[5]
                with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                    loop.call_soon_threadsafe(_set_exception, accepted, error)

    def _updated(self, report: RequestOutput) -> None:
        """The step loop's callback with each report of a request (DELTA: what is new): it goes on as it
        is, once this thread has noted the request's times; a failed request's error goes instead."""
        rid = report.request_id
        tr = self._tracked.get(rid)
        if tr is None:
            return
        now = time.monotonic()
        item: RequestOutput | APIError = report
        try:
            self._note_times(tr, report, now)
            if report.error is not None:
                item = request_failed(report.error)
        except Exception as e:  # handling this request's report failed: it alone ends
            traceback.print_exc()
            item = request_failed(failure_message("output building", e))
            tr.times.finished = now
            self._abort_in_engine(rid)
        self._send(tr, item)
        if isinstance(item, APIError) or report.finished:
            self._tracked.pop(rid, None)
            self.loop.forget(rid)
            if isinstance(item, APIError):
                self.metrics.failed += 1
            self.metrics.observe(tr.times)

    @staticmethod
    def _note_times(tr: _Tracked, report: RequestOutput, now: float) -> None:
        times = tr.times
        if times.scheduled is None:
            times.scheduled = report.first_scheduled_time
        if report.error is not None:
            times.finished = now
            return
        new_tokens = False
        for c in report.outputs:
            if c.token_ids:
                tr.tokens_out[c.index] += len(c.token_ids)
                new_tokens = True
        if times.first_token is None and new_tokens:
            times.first_token = now
        if report.finished:
            times.finished = now
            times.max_tokens_out = max(tr.tokens_out)

    def _send(self, tr: _Tracked, item: RequestOutput | APIError) -> None:
        """Queue ``item`` for the request's stream; ``_wake_event_loops`` hands it over."""
        self._outbox.setdefault(tr.loop, []).append((tr.stream, item))

    def _wake_event_loops(self) -> None:
        """Hand every queued report to its event loop: one wake-up per loop for all of them."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[Delivery]) -> None:
    for stream, item in items:
        stream.put(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
