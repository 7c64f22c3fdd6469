"""The engine thread: the one thread that touches the server's ``LLM``, stepping it between commands.

The engine is not thread-safe, so the event loop never calls it: it queues commands (``engine_commands``),
which this thread carries out between steps, and reads each request's reports from its stream, which this
thread fills once per step (``in_flight``).

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

import contextlib
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hydragen.engine.isolation import failure_message
from hydragen.engine.outputs import RequestOutput, RequestOutputKind
from hydragen.engine.stats import EngineSnapshot
from hydragen.server.engine_commands import Abort, Add, Command, FailAll, set_result
from hydragen.server.errors import APIError
from hydragen.server.in_flight import InFlight, TrackedRequest, request_failed
from hydragen.server.metrics import LatencyMetrics
from hydragen.server.step_watchdog import StepWatchdog

if TYPE_CHECKING:
    from hydragen.server.engine_restarts import GroupRestarts

log = logging.getLogger("hydragen.server")


class EngineThread:
    """Steps ``llm`` on a thread of its own, carrying out the commands ``put`` queues between steps. It also
    owns the step watchdog and, given ``restarts``, the rebuilding of a broken tensor-parallel group, so
    ``llm`` is its own: close it through ``close_llm``. The LLM can change then: read it through ``self.llm``
    (None while it is rebuilt), never keep it."""

    def __init__(
        self, llm, metrics: LatencyMetrics, step_timeout: float, restarts: GroupRestarts | None = None
    ):
        self.llm = llm
        self.engine = llm.engine
        self.loop = llm.loop
        self._last_snapshot = llm.engine.snapshot
        self.restarts = restarts
        self.restarting: str | None = None  # why the engine is being rebuilt (its group broke)
        self._built_here = False  # the running LLM was rebuilt by this thread (its workers are its own)
        self._stopping = threading.Event()  # cuts a restart's backoff short on shutdown
        self.metrics = metrics
        self._commands: queue.Queue[Command] = queue.Queue()
        self._wake = threading.Event()
        self.in_flight = InFlight()
        self._stop = False
        self._ids = 0
        self.failure: str | None = None  # set when the engine loop failed: it takes no more requests
        self.draining = False  # shutting down: in-flight requests finish, new ones are refused
        self.watchdog = StepWatchdog(step_timeout, self._stalled_requests)
        self._plan_before_step = None  # the engine's plan when the running step began
        self._thread = threading.Thread(target=self._run, name="hydragen-engine", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def tokens_per_second(self) -> float:
        loop = self.loop
        return 0.0 if self.failure is not None or loop is None or loop.idle else loop.tokens_per_second

    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (the broken engine's last one while it is rebuilt)."""
        engine = self.engine
        return engine.snapshot if engine is not None else self._last_snapshot

    def put(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def unavailable(self) -> APIError | None:
        """Why no request can be taken now (503), or None when the engine is ready."""
        if self.failure is not None or not self.alive:
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

    def reject_queued(self) -> None:
        """Answer every queued command once no engine loop will (it failed or stopped)."""
        error = self.unavailable() or APIError(503, "the engine stopped", code="engine_failed")
        for command in self._queued_commands():
            if isinstance(command, Add):
                with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                    command.refuse(error)

    def stop(self) -> None:
        self.watchdog.close()
        self._stop = True
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def close_llm(self) -> None:
        """Close the LLM being served."""
        llm = self.llm
        if llm is not None:
            llm.close()

    # ---- this thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: fail everyone, never hang them
            traceback.print_exc()
            self._die(f"engine loop stopped: {type(e).__name__}: {e}")
        finally:
            self.in_flight.wake_event_loops()
            self.reject_queued()
            if self._built_here:  # its workers die with this thread: stop them in order first
                self.close_llm()

    def _loop(self) -> None:
        while not self._stop:
            broken = self._group_failure()
            if broken is not None:
                self._restart(broken)
                continue
            self._drain_commands()
            self.in_flight.wake_event_loops()
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
                self.in_flight.wake_event_loops()
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
            ids = self.in_flight.ids()
        return self.in_flight.names(ids)

    def _die(self, message: str) -> None:
        log.error("engine failed, ending %d request(s) in flight: %s", len(self.in_flight), message)
        self.failure = message
        self._end_in_flight(APIError(500, f"engine failed: {message}", code="engine_failed"))

    def _restart(self, cause: str) -> None:
        """The tensor-parallel group broke: end the requests in flight, rebuild the engine, serve again; or
        fail for good when it cannot be rebuilt (``engine_restarts``)."""
        assert self.restarts is not None
        log.error("engine failed, ending %d request(s) in flight: %s", len(self.in_flight), cause)
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
        for rid in self.in_flight.end_all(error):
            with contextlib.suppress(Exception):  # best effort: the engine is already failed
                self.loop.abort(rid)
        self.in_flight.wake_event_loops()  # now: a restart's rebuild takes seconds

    def _queued_commands(self) -> Iterator[Command]:
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._queued_commands():
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Abort):
                self.in_flight.pop(command.request_id)
                self._abort_in_engine(command.request_id)
            elif isinstance(command, FailAll):
                for rid, _ in self.in_flight.items():
                    tracked = self.in_flight.pop(rid)
                    if tracked is None:  # ended meanwhile: an abort that failed failed the engine, and it
                        continue  # ended every request in flight with that failure
                    self.in_flight.send(tracked, command.error)
                    self._abort_in_engine(rid)

    def _abort_in_engine(self, request_id: str) -> None:
        """Abort in the engine unless it has already failed; a failing abort fails the engine."""
        if self.failure is None and self.restarting is None:
            try:
                self.loop.abort(request_id)
            except Exception as e:
                traceback.print_exc()
                self._die(failure_message("abort", e))

    def _add(self, add: Add) -> None:
        if add.accepted.done():  # answered already (a restart began after it was queued)
            return
        if (err := self.unavailable()) is not None:
            add.refuse(err)
            return
        self._ids += 1
        rid = f"req-{self._ids}"
        try:
            params = dataclasses.replace(add.params, output_kind=RequestOutputKind.DELTA)  # only what is new
            req = self.loop.add(
                add.prompt_ids, params, prompt=add.prompt, request_id=rid, on_report=self._updated
            )
        except (ValueError, TypeError) as e:
            add.refuse(e)
            return
        except Exception as e:  # a bug in admission: this request fails, the engine goes on
            traceback.print_exc()
            add.refuse(request_failed(failure_message("admission", e)))
            return
        tracked = TrackedRequest(req, add.loop, add.stream, add.times, add.label, [0] * len(req.seqs))
        self.in_flight.track(rid, tracked)
        add.loop.call_soon_threadsafe(set_result, add.accepted, rid)

    def _updated(self, report: RequestOutput) -> None:
        """The step loop's callback with each report of a request (DELTA: what is new): it goes on as it
        is, once this thread has noted the request's times; a failed request's error goes instead."""
        rid = report.request_id
        tracked = self.in_flight.get(rid)
        if tracked is None:
            return
        now = time.monotonic()
        item: RequestOutput | APIError = report
        try:
            tracked.note(report, now)
            if report.error is not None:
                item = request_failed(report.error)
        except Exception as e:  # handling this request's report failed: it alone ends
            traceback.print_exc()
            item = request_failed(failure_message("output building", e))
            tracked.times.finished = now
            self._abort_in_engine(rid)
        self.in_flight.send(tracked, item)
        if isinstance(item, APIError) or report.finished:
            self.in_flight.pop(rid)
            self.loop.forget(rid)
            if isinstance(item, APIError):
                self.metrics.failed += 1
            self.metrics.observe(tracked.times)
