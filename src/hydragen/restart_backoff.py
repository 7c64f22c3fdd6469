"""When to start again something that keeps failing: a data-parallel replica's process (``dp.replicas``),
a server's tensor-parallel group (``server.engine_restarts``).

The wait before a restart doubles from ``BACKOFF_S`` up to ``BACKOFF_MAX_S`` while runs keep ending within
``STABLE_S`` of their start (a run that lasted that long starts it afresh), and at most ``max_per_minute``
restarts fall in any minute. What to do at that cap is the caller's: the data-parallel front waits for the
minute to pass (nothing else would start its replica again); a server gives up and reports its engine
failed, so that whatever supervises the process restarts it.
"""

from __future__ import annotations

import math
import time
from collections import deque

BACKOFF_S = 0.5  # first wait before a restart
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a run that lasted this long starts the backoff afresh when it ends
WINDOW_S = 60.0  # the cap counts the restarts of the last minute
DEFAULT_MAX_PER_MINUTE = 6


class RestartBackoff:
    """One restartable thing's history: its failures in a row and its restarts in the last minute."""

    def __init__(self, max_per_minute: int = DEFAULT_MAX_PER_MINUTE, first_delay: float = BACKOFF_S):
        self.max_per_minute = max_per_minute
        self.first_delay = first_delay
        self.failures = 0  # runs (or starts) in a row that failed without a stable run between
        self.recent: deque[float] = deque()  # monotonic times of the restarts in the last minute
        self.restarts = 0  # restarts begun, in all

    def ended(self, ran: float) -> None:
        """A run ended after ``ran`` seconds."""
        self.failures = 0 if ran >= STABLE_S else self.failures + 1

    def start_failed(self) -> None:
        """A restart did not get as far as running."""
        self.failures += 1

    def delay(self) -> float:
        """The backoff before the next restart, from the failures in a row."""
        return min(BACKOFF_MAX_S, self.first_delay * 2 ** max(0, self.failures - 1))

    def cap_wait(self) -> float:
        """Seconds until one more restart fits ``max_per_minute`` (0: now; infinite when it is 0)."""
        now, recent = time.monotonic(), self.recent
        while recent and now - recent[0] >= WINDOW_S:
            recent.popleft()
        if len(recent) < self.max_per_minute:
            return 0.0
        return recent[0] + WINDOW_S - now if recent else math.inf

    def restarting(self) -> None:
        """A restart begins now."""
        self.recent.append(time.monotonic())
        self.restarts += 1
