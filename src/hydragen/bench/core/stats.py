"""Percentiles: one definition for every benchmark, so a p99 in one report compares with a p99 in another.

The definition is ``numpy.percentile``'s default (linear interpolation between the two closest ranks,
Hyndman and Fan's type 7, the same as ``statistics.quantiles(..., method="inclusive")``): the p-th
percentile of n sorted values x[0..n-1] is x[i] + f (x[i + 1] - x[i]) where p / 100 (n - 1) = i + f.
numpy rather than ``statistics``: it takes any p directly (a p99 is one call, not the 99th of 100 cut
points), a single value too (``statistics.quantiles`` needs two before Python 3.13), and it is what vLLM's
serving benchmark reports, so hydragen's TTFT percentiles read the same way as vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0 to 100) of ``values``, in any order; NaN when there are none."""
    data = np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return float("nan")
    return float(np.percentile(data, p))
