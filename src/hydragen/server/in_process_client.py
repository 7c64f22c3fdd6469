"""``InProcessClient``: the ``EngineClient`` of an ``LLM`` in this process, stepped on a thread of its own.

Why the name: it is not an engine but the server's client of one (``engine_client``); the engine itself is
``EngineCore``, the loop that steps it ``StepLoop``. This is the event loop's side: it turns each call into
a command (``engine_commands``) for the ``EngineThread`` (``engine_thread``), the one thread that touches
the engine, and hands back a ``RequestStream`` that the thread fills with the request's reports (the
engine's DELTA outputs, passed on as they are: ``in_flight``). Health (``unavailable``) is the engine
thread's to say: failed, restarting its tensor-parallel group, stalled in a step, or draining.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.stats import EngineSnapshot
from hydragen.server.engine_client import ConstraintBuilder, RequestStream
from hydragen.server.engine_commands import Abort, Add, FailAll, set_exception
from hydragen.server.engine_thread import EngineThread
from hydragen.server.errors import APIError
from hydragen.server.metrics import LatencyMetrics, RequestTimes
from hydragen.server.step_watchdog import DEFAULT_STEP_TIMEOUT_S
from hydragen.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from hydragen.server.engine_restarts import GroupRestarts


class InProcessClient:
    """The ``EngineClient`` of ``llm``: its ``EngineThread`` steps it, the event loop talks to that thread
    through commands and ``RequestStream``s. ``llm`` is the thread's from now on: close it through
    ``close_llm``."""

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
        self.max_num_seqs = llm.engine.scheduler.max_num_seqs
        self.metrics = metrics or LatencyMetrics()
        self.restarts = restarts
        self.started = time.time()
        self._thread = EngineThread(llm, self.metrics, step_timeout, restarts)

    @property
    def llm(self):
        """The LLM being served (None while a restart rebuilds it)."""
        return self._thread.llm

    @property
    def engine(self):
        """The engine being served (None while a restart rebuilds it)."""
        return self._thread.engine

    @property
    def draining(self) -> bool:
        """Shutting down: in-flight requests finish, new ones are refused."""
        return self._thread.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._thread.draining = value

    @property
    def tokens_per_second(self) -> float:
        return self._thread.tokens_per_second

    @property
    def restart_count(self) -> int:
        return self.restarts.count if self.restarts is not None else 0

    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (the broken engine's last one while it is rebuilt)."""
        return self._thread.snapshot()

    def unavailable(self) -> APIError | None:
        """Why no request can be taken now (503), or None when the engine is ready."""
        return self._thread.unavailable()

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
        self._thread.put(Add(prompt_ids, params, prompt, loop, stream, accepted, times, label))
        if not self._thread.alive:  # nobody else will ever answer the command
            self._thread.reject_queued()
        elif self._thread.restarting is not None and (err := self.unavailable()) is not None:
            set_exception(accepted, err)  # a restart began meanwhile: the engine thread answers after it
        stream.request_id = await accepted
        return stream

    def abort(self, request_id: str) -> None:
        self._thread.put(Abort(request_id))

    def begin_drain(self) -> None:
        self.draining = True

    def fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error`` (used when the shutdown grace period runs out)."""
        self._thread.put(FailAll(error))

    def shutdown(self) -> None:
        self._thread.stop()

    def close_llm(self) -> None:
        """Close the LLM being served (the server owns it, as restarts replace it)."""
        self._thread.close_llm()
