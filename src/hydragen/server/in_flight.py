"""The requests in flight on the engine thread, and their reports on the way to the event loops.

Each request the engine thread takes is tracked with the stream its reports go to, the event loop that
reads that stream, and its latency marks. A report (or the error that ends a request) is not handed over
at once: it waits in an outbox until ``wake_event_loops``, which the engine thread calls after each step,
so every event loop wakes once per step with all of that step's reports, not once per request
(``scripts/bench_client_reports.py`` counts the wakes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sequence import Request
from hydragen.server.engine_client import RequestStream
from hydragen.server.errors import APIError
from hydragen.server.metrics import RequestTimes

Delivery = tuple[RequestStream, RequestOutput | APIError]  # a report, or the error, for a request's stream


def request_failed(message: str) -> APIError:
    """The 500 a request gets when its own work failed (the engine goes on)."""
    return APIError(500, f"request failed: {message}", code="request_failed")


@dataclass
class TrackedRequest:
    request: Request
    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    times: RequestTimes
    label: str  # what the server's log calls it (the HTTP request's id), for the stall log
    tokens_out: list[int] = field(default_factory=list)  # tokens reported, per sample

    def note(self, report: RequestOutput, now: float) -> None:
        """Mark the request's latencies from one of its reports (DELTA: what is new)."""
        times = self.times
        if times.scheduled is None:
            times.scheduled = report.first_scheduled_time
        if report.error is not None:
            times.finished = now
            return
        new_tokens = False
        for c in report.outputs:
            if c.token_ids:
                self.tokens_out[c.index] += len(c.token_ids)
                new_tokens = True
        if times.first_token is None and new_tokens:
            times.first_token = now
        if report.finished:
            times.finished = now
            times.max_tokens_out = max(self.tokens_out)


class InFlight:
    """The engine thread's requests by id, and the outbox of what they are sent. Only that thread changes
    them; the step watchdog reads the requests while that thread is stuck in a step."""

    def __init__(self) -> None:
        self._tracked: dict[str, TrackedRequest] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}  # per loop, since it last woke

    def __len__(self) -> int:
        return len(self._tracked)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self._tracked.get(request_id)

    def ids(self) -> list[str]:
        return list(self._tracked)

    def items(self) -> list[tuple[str, TrackedRequest]]:
        """A copy: the caller may take requests out while it goes through them."""
        return list(self._tracked.items())

    def track(self, request_id: str, tracked: TrackedRequest) -> None:
        self._tracked[request_id] = tracked

    def pop(self, request_id: str) -> TrackedRequest | None:
        return self._tracked.pop(request_id, None)

    def send(self, tracked: TrackedRequest, item: RequestOutput | APIError) -> None:
        """Queue ``item`` for the request's stream; ``wake_event_loops`` hands it over."""
        self._outbox.setdefault(tracked.loop, []).append((tracked.stream, item))

    def end_all(self, error: APIError) -> list[str]:
        """End every request with ``error`` (queued, not yet handed over) and stop tracking them; returns
        their ids, for the engine to abort."""
        ids = list(self._tracked)
        for tracked in self._tracked.values():
            tracked.times.finished = time.monotonic()
            self.send(tracked, error)
        self._tracked.clear()
        return ids

    def names(self, request_ids: list[str]) -> str:
        """The requests as the server's log knows them (label and id), for a stalled step's log line."""
        names = []
        for rid in dict.fromkeys(request_ids):
            tracked = self._tracked.get(rid)
            names.append(f"{tracked.label} ({rid})" if tracked is not None and tracked.label else rid)
        return ", ".join(names) or "none"

    def wake_event_loops(self) -> None:
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
