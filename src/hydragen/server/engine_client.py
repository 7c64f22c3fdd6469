"""What the HTTP layer needs of an engine, and nothing more: the ``EngineClient`` interface.

The routes (``serving_chat``, ``serving_completion``, and the other APIs beside them) see an engine only
through these calls, whose inputs and outputs are data: token ids and ``SamplingParams`` in, a
``RequestStream`` of ``RequestOutput`` deltas out (the engine's own per-step reports,
``RequestOutputKind.DELTA``), an ``APIError`` when it cannot take work. So they never learn where the
engine runs: ``InProcessClient`` steps an ``LLM`` on a thread of this process (vLLM's ``AsyncLLM`` plays
that part for its ``EngineClient``); a client of an engine in another process would implement the same calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.stats import EngineSnapshot
from hydragen.server.errors import APIError
from hydragen.structured.params import StructuredOutputsParams

# Builds a request's output constraint for the grammar engine: (its view of the tokenizer, the server's
# literal_json_schema default) -> the constraint, or None (``ToolSession.constraint`` is one).
ConstraintBuilder = Callable[[Any, bool], StructuredOutputsParams | None]


class RequestStream:
    """One request's reports in order, as an async iterator of ``RequestOutput`` deltas: each holds, per
    sample that changed, the text, token ids and logprobs one engine step added, and the last one has
    ``finished`` set. A request that fails raises its ``APIError`` from the iterator instead (as vLLM's
    ``generate()`` raises). ``request_id`` is what ``EngineClient.abort`` takes."""

    def __init__(self) -> None:
        self.request_id = ""  # set once the engine has taken the request
        self._items: asyncio.Queue[RequestOutput | APIError] = asyncio.Queue()
        self._ended = False

    def put(self, item: RequestOutput | APIError) -> None:
        """Hand the consumer a report, or the error that ends the request (on the consumer's event loop)."""
        self._items.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, APIError):
            self._ended = True
            raise item
        self._ended = item.finished
        return item


class EngineClient(Protocol):
    """The engine as the server sees it (vLLM's ``EngineClient``, reduced to what hydragen serves).

    ``submit``, ``abort`` and ``compile`` are called on the event loop; none of them blocks it."""

    started: float  # when it began serving (time.time()), which /v1/models reports as "created"
    max_num_seqs: int  # sequences the engine runs at once

    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, label: str = ""
    ) -> RequestStream:
        """Queue a request; its reports arrive on the returned stream. ``label``: the name the server's log
        knows it by. Raises ValueError/ParamError for a request the engine refuses, APIError when the
        engine takes no requests (``unavailable``)."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away, or its HTTP request failed); nothing more is reported."""
        ...

    def unavailable(self) -> APIError | None:
        """Health: why no request can be taken now (a 503 naming the cause), or None when ready."""
        ...

    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (never the live state): /metrics and /v1/loads."""
        ...

    @property
    def tokens_per_second(self) -> float:
        """The recent decode rate (0 while idle)."""
        ...

    @property
    def restart_count(self) -> int:
        """Tries to rebuild a broken engine so far (failed ones included)."""
        ...

    async def compile(
        self, constraint: StructuredOutputsParams | ConstraintBuilder | None
    ) -> StructuredOutputsParams | None:
        """Build (a builder such as a tool-call grammar) and compile a request's output constraint off the
        event loop and off the engine thread, which then finds it compiled, so a slow compile holds up no
        other request. Returns the constraint; ParamError when it does not compile."""
        ...

    def begin_drain(self) -> None:
        """Shutting down: requests in flight finish, new ones get a 503."""
        ...

    def fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error`` (the shutdown grace period ran out)."""
        ...

    def shutdown(self) -> None:
        """Stop serving; returns once the engine's work has ended."""
        ...
