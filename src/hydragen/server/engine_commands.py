"""The commands the event loop sends the engine thread: the one way anything reaches the engine.

The engine is not thread-safe, so ``InProcessClient`` (on the event loop) never calls it: it queues these,
and the ``EngineThread`` carries them out between steps. An ``Add`` carries the future the thread answers
with the request's id, or with the error that refused it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hydragen.engine.sampling_params import SamplingParams
from hydragen.server.engine_client import RequestStream
from hydragen.server.errors import APIError
from hydragen.server.metrics import RequestTimes


@dataclass
class Add:
    """A request for the engine to take; ``accepted`` gets its id, or the error that refused it."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    loop: asyncio.AbstractEventLoop  # the event loop that reads ``stream``
    stream: RequestStream
    accepted: asyncio.Future
    times: RequestTimes
    label: str

    def refuse(self, error: BaseException) -> None:
        """Answer ``accepted`` with ``error``, from any thread (nothing when it is answered already)."""
        self.loop.call_soon_threadsafe(set_exception, self.accepted, error)


@dataclass
class Abort:
    """Stop a request; nothing more is reported for it."""

    request_id: str


@dataclass
class FailAll:
    """End every request in flight with ``error`` (the shutdown grace period ran out)."""

    error: APIError


Command = Add | Abort | FailAll


def set_result(fut: asyncio.Future, value) -> None:
    """Answer ``fut`` on its event loop unless it is answered already (the thread and a restart race)."""
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail ``fut`` on its event loop unless it is answered already."""
    if not fut.done():
        fut.set_exception(exc)
