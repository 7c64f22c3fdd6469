"""Benchmarks that reproduce the papers' measurements on whatever machine runs them.

One sub-package per family (``hydragen bench NAME`` runs one module's ``main``): ``core`` (tables, machine,
plots, percentiles), ``peers`` (llama.cpp in its own process), ``attention``, ``e2e``, ``longdoc``,
``serving``, ``dp`` (its simulation in ``dp.sim``), ``quant``, ``structured``, ``tp``; docs/benchmarks.md
gives a line to each.
"""
