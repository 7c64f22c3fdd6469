"""The cost rule: which drafts a step verifies, from the step's measured cost and each sequence's acceptance.

Verifying k drafts turns a sequence's one row into k + 1; on a CPU a step of R rows costs t(R), nearly
flat while the weights' stream dominates (small R) and growing with R after. ``StepCost`` is t(R), measured
at start-up on a grid of row counts (``ModelRunner.time_rows``) and interpolated. Draft j of a sequence
whose drafts are accepted with probability a each is worth a^j tokens (it counts only if all before it are
accepted). ``choose`` takes draft positions by worth, highest first, and keeps the count that maximises
(rows of the step + expected accepted tokens) / t(rows + drafts): the step's useful work per second. So a
large batch, whose extra rows cost their full share, speculates only on drafts that are nearly sure, and
the rule never plans a step it expects to be slower per token than not speculating.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128, 256)  # past it, the last slope
SMALL = 16  # steps up to this many rows are timed best of three (they are cheap and noisiest), others once


class StepCost:
    """t(R): seconds of a step of R rows, linear between measured points and past the last one (by the last
    two points' slope)."""

    def __init__(self, rows: list[int], seconds: list[float]):
        """Measured ``seconds`` at ``rows`` (ascending); a step never costs less than a smaller one, so a
        timing below an earlier one (noise) is raised to it."""
        if len(rows) < 2 or sorted(rows) != list(rows):
            raise ValueError("a step cost needs at least two row counts, ascending")
        self.rows = list(rows)
        self.seconds = list(itertools.accumulate(seconds, max))

    @classmethod
    def measure(cls, time_rows: Callable[[int, int], float], most_rows: int) -> StepCost:
        """Time a step at each grid point up to ``most_rows`` (at least two points): ``time_rows(rows,
        repeats)``. About a second on the embedded model, once per engine."""
        grid = [r for r in GRID if r <= max(most_rows, 2)]
        return cls(grid, [time_rows(r, 3 if r <= SMALL else 1) for r in grid])

    def at(self, rows: int) -> float:
        i = min(max(bisect.bisect_left(self.rows, rows), 1), len(self.rows) - 1)
        x0, x1, y0, y1 = self.rows[i - 1], self.rows[i], self.seconds[i - 1], self.seconds[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


def choose(counts: list[int], accept: list[float], base_rows: int, cost: StepCost) -> list[int]:
    """How many of its drafts each sequence verifies: ``counts[i]`` drafts found, each accepted with
    probability ``accept[i]`` (below 1), in a step whose other work is ``base_rows`` rows. Plain Python: a
    step has at most a few hundred drafts, and a dozen tensor ops would cost more than the ranking."""
    ranked = sorted(
        ((a**j, i) for i, (n, a) in enumerate(zip(counts, accept, strict=True)) for j in range(1, n + 1)),
        key=lambda x: -x[0],
    )  # stable: a sequence's drafts stay in order (their worth falls with depth)
    best, best_rate, gained = 0, base_rows / cost.at(base_rows), 0.0
    for m, (worth, _) in enumerate(ranked, 1):
        gained += worth
        rate = (base_rows + gained) / cost.at(base_rows + m)
        if rate > best_rate:  # strictly: no drafts unless they gain
            best, best_rate = m, rate
    taken = [0] * len(counts)
    for _, i in ranked[:best]:
        taken[i] += 1
    return taken
