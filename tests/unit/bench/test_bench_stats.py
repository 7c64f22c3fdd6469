"""Every benchmark's percentiles have one definition (bench/core/stats.py, numpy's linear interpolation),
so a p99 in one report compares with a p99 in another."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import hydragen.bench
from hydragen.bench.core.stats import percentile

PERCENTILE_WORDS = ("percentile", "quantile", "pct")  # in the name of a helper that computes one


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        # sorted: 1, 3, 7, 15, 100; rank p / 100 * 4, interpolated between its neighbours
        (0, 1.0),
        (50, 7.0),
        (90, 66.0),  # rank 3.6: 15 + 0.6 * (100 - 15); nearest-rank definitions said 100
        (99, 96.6),  # rank 3.96: 15 + 0.96 * 85
        (100, 100.0),
    ],
)
def test_percentile_interpolates_between_the_closest_ranks(p, expected):
    assert percentile([15, 1, 3, 7, 100], p) == pytest.approx(expected)


def test_percentile_of_an_even_sample_and_of_one_value():
    assert percentile(range(1, 11), 50) == pytest.approx(5.5)  # the median: the middle two's mean
    assert percentile(range(1, 11), 90) == pytest.approx(9.1)
    assert percentile(range(1, 11), 99) == pytest.approx(9.91)
    assert percentile([0.25], 99) == 0.25
    assert math.isnan(percentile([], 50))


def test_no_benchmark_keeps_a_percentile_of_its_own():
    """Only core/stats.py computes percentiles or quantiles: a private helper would bring a second
    definition back."""
    root = Path(hydragen.bench.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "core" / "stats.py":
            continue
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(w in node.name for w in PERCENTILE_WORDS):
                found.append(f"{where}:{node.lineno} defines {node.name}")
            if isinstance(node, ast.Attribute) and node.attr in ("percentile", "quantile", "quantiles"):
                found.append(f"{where}:{node.lineno} calls {node.attr}")
    assert not found, "\n".join(found)
