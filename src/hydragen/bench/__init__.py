"""Benchmarks that reproduce the papers' measurements on whatever machine runs them.

One sub-package per family (``hydragen bench NAME`` runs one module's ``main``): ``core`` (tables, machine,
plots, percentiles), ``peers`` (llama.cpp in its own process), ``attention``, ``e2e``, ``longdoc``,
``serving``, ``dp`` (its simulation in ``dp.sim``), ``quant``, ``structured``, ``tp``; docs/benchmarks.md
gives a line to each.

Their own dependencies are optional, the ``bench`` extra (``pip install 'hydragen[bench]'``): matplotlib
draws the plots, jsonschema checks the validity of structured outputs and tool calls. ``hydragen bench``
checks for them before it measures anything; ``import_optional`` names the extra when a benchmark's code is
called without them.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

BENCH_EXTRA = ("matplotlib", "jsonschema")  # pyproject.toml's bench extra, by import name


class MissingBenchDependency(ImportError):
    """A module of the bench extra is not installed."""


def missing_message(names: list[str]) -> str:
    return f"hydragen bench needs {' and '.join(names)}, not installed: pip install 'hydragen[bench]'"


def missing_dependencies() -> list[str]:
    """The modules of the bench extra that are not installed (none are imported)."""
    return [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]


def import_optional(name: str) -> ModuleType:
    """Module ``name`` of the bench extra; MissingBenchDependency, naming the extra, when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingBenchDependency(missing_message([name])) from e
