"""A server's engine rebuilt when its tensor-parallel group broke.

A worker rank that dies (on a CPU, running out of memory is a SIGKILL from the kernel) or hangs past the
collective timeout ends the group for good: its gloo connections cannot be mended. The rest of the server
is sound, so it builds the engine again with the options it was started with: new worker processes, the
model loaded again, an empty prefix cache. The engine thread (``EngineThread``) ends its requests in flight
with an error first, and answers 503 ``engine_restarting`` while this runs.

Order matters for memory: the broken LLM is closed (its workers stopped, or killed if they hang, and
reaped) and every reference to it dropped and collected before the new one loads, so the machine never
holds two copies of the model; the log says so if something still holds the old model. The wait before
each try follows ``restart_backoff`` (doubling from 0.5 s while groups keep dying within a minute of their
start). A build that fails (the model no longer loads, a worker dies while starting) is tried again the same
way. Past ``max_per_minute`` restarts in a minute the server gives up, and its engine counts as failed
(503 ``engine_failed`` naming why), so that whatever supervises the process restarts it.

Only a broken group is restarted. Any other engine failure happens in this process (rank 0's own engine),
where state such as a CUDA context error is sticky and an in-process rebuild cannot be trusted to clear
it: there the engine fails for good and the process is restarted from outside (docs/serving.md).

Workers spawned while rebuilding are children of the engine thread; they are set to die with the thread
that started them (Linux's parent-death signal), which is why the rebuild runs on that long-lived thread
and why it closes what it built before it ends.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from hydragen.engine.isolation import failure_message
from hydragen.restart_backoff import RestartBackoff

log = logging.getLogger("hydragen.server")


class GroupRestarts:
    """Rebuilds the server's LLM after its tensor-parallel group broke. ``build()`` makes a new LLM with the
    server's options; ``max_per_minute`` restarts at most in any minute (0: never restart)."""

    def __init__(self, build: Callable[[], Any], max_per_minute: int):
        self.build = build
        self.backoff = RestartBackoff(max_per_minute)
        self.since = time.monotonic()  # when the running LLM was built

    @property
    def count(self) -> int:
        """Restarts begun (failed builds included)."""
        return self.backoff.restarts

    @staticmethod
    def broke_group(exc: BaseException) -> bool:
        """Whether ``exc``, or an exception it came from, says the tensor-parallel group is down."""
        from hydragen.tp.coordinator import TPGroupBroken

        seen: set[int] = set()
        cur: BaseException | None = exc
        while cur is not None and id(cur) not in seen:
            if isinstance(cur, TPGroupBroken):
                return True
            seen.add(id(cur))
            cur = cur.__cause__ or cur.__context__
        return False

    @staticmethod
    def group_failure(llm) -> str | None:
        """Why ``llm``'s group cannot run a step (its workers' processes checked: a ``waitpid`` each), or
        None; cheap enough for ``/health`` and every request to ask, and the engine thread between steps."""
        parallel = getattr(llm, "parallel", None)
        return None if parallel is None else parallel.failure()

    def restart(self, detach: Callable[[], Any], cause: str, stopping: threading.Event) -> tuple[Any, str]:
        """Close and free the broken LLM (``detach()`` hands it over, the caller keeping no reference), then
        build a new one, trying again per the backoff. Returns (the new LLM, "") or (None, why not: the
        cap, or ``stopping`` set)."""
        t0 = time.monotonic()
        self.backoff.ended(t0 - self.since)
        self._release(detach)
        last_error = ""
        while True:
            if self.backoff.cap_wait() > 0:
                limit, recent = self.backoff.max_per_minute, len(self.backoff.recent)
                why = (
                    f"{cause}; not restarted: restarts are off (--max-restarts-per-minute 0)"
                    if limit == 0
                    else f"{cause}; not restarted again after {recent} restart{'s' * (recent != 1)} in the "
                    f"last minute (--max-restarts-per-minute {limit})"
                    + (f"; the last one failed: {last_error}" if last_error else "")
                )
                log.error("the tensor-parallel group stays down: %s", why)
                return None, why
            delay = self.backoff.delay()
            log.warning("restarting the tensor-parallel group in %.1f s (restart %d)", delay, self.count + 1)
            if stopping.wait(delay):
                return None, "the server is shutting down"
            self.backoff.restarting()
            try:
                llm = self.build()
            except Exception as e:  # noqa: BLE001 - tried again per the backoff; the cap ends the tries
                last_error = failure_message("rebuilding the engine", e)
                log.error("restart %d of the tensor-parallel group failed: %s", self.count, last_error)
                self.backoff.start_failed()
                continue
            self.since = time.monotonic()
            log.warning(
                "the tensor-parallel group was restarted (restart %d): serving again %.1f s after it broke",
                self.count,
                self.since - t0,
            )
            return llm, ""

    @staticmethod
    def _release(detach: Callable[[], Any]) -> None:
        """Close the broken LLM (its workers stopped or killed, and reaped) and free it before another
        loads; say so if something still holds its model (the new one would then load beside it)."""
        llm = detach()
        model = weakref.ref(llm.model)
        llm.close()
        del llm
        gc.collect()
        if model() is not None:
            log.error("the broken engine's model is still referenced: the new one loads beside it")
