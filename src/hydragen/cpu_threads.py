"""How many CPU threads torch uses: by default as many as the cores other programs leave free, re-checked
every few seconds while the engine works.

torch splits each operation over its threads and waits for all of them at the end. When other programs
keep the cores busy, the thread that lost its core holds up every operation: on a 2-core machine beside
three busy processes, 2 threads decoded 3-5x slower than 1 thread, while on a quiet machine 2 threads
prefilled 1.7x faster (``docs/results/threads``). So the default follows the machine: it counts, from
``/proc/stat``, how much of the cores this process may run on was busy with *other* work (this process's
own CPU time taken out), and uses the rest. ``--threads N`` (``LLM(threads=N)``) fixes the count instead;
then a busy machine is only reported (``hint``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

CHECK_EVERY_S = 2.0  # how often the engine re-measures the other load while it works


@dataclass(frozen=True)
class _Sample:
    busy_s: float  # busy CPU seconds on our cores (everyone's)
    own_s: float  # this process's CPU seconds
    wall: float


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _sample(cores: list[int]) -> _Sample | None:
    """Busy time of ``cores`` from /proc/stat (user, system, irq, softirq, steal), or None. Time of niced
    programs is left out (they yield the core to us), unless this process is niced too."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    count_nice = os.nice(0) > 0
    ticks = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
            ticks += user + system + irq + softirq + steal + (nice if count_nice else 0)
    return _Sample(ticks / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic())


def other_load(before: _Sample | None, after: _Sample | None) -> float | None:
    """Cores kept busy by other programs between two samples (None when it cannot be measured)."""
    if before is None or after is None or after.wall - before.wall < 0.05:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / (after.wall - before.wall))


class ThreadGovernor:
    """Sets torch's thread count: ``fixed`` threads, or (None) the cores other programs leave free."""

    def __init__(self, fixed: int | None = None):
        if fixed is not None and (not isinstance(fixed, int) or fixed < 1):
            raise ValueError(f"threads must be a positive integer or None (automatic), got {fixed!r}")
        self.fixed = fixed
        self.cores = usable_cores()
        self.busiest = 0.0  # most cores seen busy with other work at a check
        self.on_busy = None  # called once with ``hint()`` when a fixed count meets a busy machine (server)
        self._last = _sample(self.cores)
        if fixed is not None:
            torch.set_num_threads(fixed)

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def check(self, force: bool = False) -> None:
        """Re-measure the other load (every CHECK_EVERY_S at most, unless ``force``) and, when automatic,
        use the cores it leaves free."""
        now = time.monotonic()
        if self._last is not None and not force and now - self._last.wall < CHECK_EVERY_S:
            return
        current = _sample(self.cores)
        others = other_load(self._last, current)
        self._last = current
        if others is None:
            return
        self.busiest = max(self.busiest, others)
        if self.on_busy is not None and (hint := self.hint()) is not None:
            self.on_busy(hint)
            self.on_busy = None
        if self.fixed is None:
            want = max(1, min(len(self.cores), len(self.cores) - round(others)))
            if want != torch.get_num_threads():
                torch.set_num_threads(want)

    def describe(self) -> str:
        n, cores = self.threads, len(self.cores)
        what = f"{n} CPU thread{'s' * (n != 1)} of {cores} core{'s' * (cores != 1)}"
        if self.fixed is not None:
            return what + " (--threads)"
        if n < cores:
            return what + f" (other programs keep about {self.busiest:.1f} busy; --threads sets it)"
        return what + " (--threads sets it)"

    def hint(self) -> str | None:
        """A line for the user when a fixed thread count met a machine busy with other work."""
        free = len(self.cores) - round(self.busiest)
        if self.fixed is None or self.fixed <= max(1, free):
            return None
        return (
            f"the machine is busy: other programs kept about {self.busiest:.1f} of {len(self.cores)} cores "
            f"busy, so {self.fixed} threads wait for each other; --threads {max(1, free)} (or leaving it "
            "out: automatic) may be much faster"
        )
