"""The engine step watchdog: a step that runs past ``--step-timeout`` seconds is *stalled*.

A server whose engine thread is stuck inside a step (a deadlock, a kernel that never returns, a machine
swapping itself to a halt) still answers HTTP, so without this its ``/health`` says ok and a router keeps
sending it requests that wait for good. The engine thread marks each step's start and end (two clock
reads and a lock, nothing per token); ``stalled()`` says how long the current step has run once it is past
the bound, which ``/health`` turns into a 503 ``engine_stalled``. A thread of the watchdog's own logs, once
per stalled step, how long it has run and which requests it holds, and logs again if the step ends.

The bound is a statement about the machine and the model, so the user sets it; 0 turns the watchdog off.
The default (``DEFAULT_STEP_TIMEOUT_S``) is sized for the slowest step hydragen plans on a CPU: a full
prefill budget (2,048 prompt tokens) of an 8B model on one core; see docs/serving.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hydragen.server")

DEFAULT_STEP_TIMEOUT_S = 600.0
LONGEST_POLL_S = 5.0  # the log line comes at most this long (or a quarter of the bound) after the bound


class StepWatchdog:
    """Times the engine thread's steps. ``describe()`` (called on the watchdog's thread, only when a step
    stalls) names the step's requests for the log."""

    def __init__(
        self, timeout: float, describe: Callable[[], str], clock: Callable[[], float] = time.monotonic
    ):
        self.timeout = timeout
        self._describe = describe
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None  # when the running step began (None between steps)
        self._step = 0  # steps begun, so the watcher tells one step from the next
        self._reported = 0  # the last step the watcher logged as stalled
        self._closed = threading.Event()
        if timeout > 0:
            threading.Thread(target=self._watch, name="hydragen-step-watchdog", daemon=True).start()

    # ---- the engine thread -------------------------------------------------------------------------
    def begin(self) -> None:
        with self._lock:
            self._started = self._clock()
            self._step += 1

    def end(self) -> None:
        with self._lock:
            started, self._started = self._started, None
            reported = self._reported == self._step
        if reported and started is not None:
            log.warning(
                "the stalled engine step ended after %.1f s; the engine takes requests again",
                self._clock() - started,
            )

    # ---- anyone ------------------------------------------------------------------------------------------
    def stalled(self) -> float | None:
        """Seconds the running step has run, when that is past the bound; None otherwise."""
        started = self._started
        if self.timeout <= 0 or started is None:
            return None
        ran = self._clock() - started
        return ran if ran > self.timeout else None

    def close(self) -> None:
        self._closed.set()

    # ---- the watchdog's thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        poll = min(self.timeout / 4, LONGEST_POLL_S)
        while not self._closed.wait(poll):
            ran = self.stalled()
            with self._lock:
                step, fresh = self._step, self._reported != self._step
            if ran is None or not fresh:
                continue
            try:
                requests = self._describe()
            except Exception as e:  # noqa: BLE001 - naming the requests is best effort; the stall is not
                requests = f"(could not be listed: {type(e).__name__}: {e})"
            with self._lock:
                if self._step != step or self._started is None:
                    continue  # it ended meanwhile
                self._reported = step
            log.error(
                "engine step stalled: running for %.1f s, past --step-timeout %g s; its requests: %s. "
                "/health answers 503 engine_stalled until it ends",
                ran,
                self.timeout,
                requests,
            )
