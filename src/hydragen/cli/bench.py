"""``hydragen bench``: one benchmark, the suite, or a run's plots redrawn from its JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydragen.cli.common import UsageError

BENCHMARKS = {
    "attention": "hydragen.bench.attention.shared_prefix_op",
    "e2e": "hydragen.bench.e2e.decode_throughput",
    "longdoc": "hydragen.bench.longdoc.many_questions",
    "tree": "hydragen.bench.e2e.tree_sharing",
    "serve": "hydragen.bench.serving.shared_prefix_load",
    "structured": "hydragen.bench.structured.jump_forward",
}
# Calibrations, run on their own (not part of `bench all`).
EXTRA_BENCHMARKS = {
    "cost-rule": "hydragen.bench.attention.cost_rule",
    "exactness": "hydragen.bench.e2e.sharing_exactness",
    "versus": "hydragen.bench.e2e.versus",
    "tp": "hydragen.bench.tp.step_cost",
    "tools": "hydragen.bench.structured.tool_calling",
    "schema-defaults": "hydragen.bench.structured.schema_defaults",
    "quant": "hydragen.bench.quant.suite",
    "dp": "hydragen.bench.dp.routing",
    "spec": "hydragen.bench.spec.workloads",
    "spec-rows": "hydragen.bench.spec.verify_rows",
}
ALL_BENCHMARKS = {**BENCHMARKS, **EXTRA_BENCHMARKS}


def _replot(module_name: str, folder: str) -> None:
    """Redraw a benchmark's plots from the JSON a run saved in ``folder`` (no measuring)."""
    import importlib

    from hydragen.bench.core.common import read_results

    module = importlib.import_module(module_name)
    for path in module.plots(read_results(Path(folder), module.RESULT_NAME), Path(folder)):
        print(path)


def run_bench(args: argparse.Namespace) -> int:
    import importlib

    from hydragen.bench import missing_dependencies, missing_message

    if missing := missing_dependencies():  # before anything is measured, not when the plots are drawn
        raise UsageError(missing_message(missing))
    rest = list(args.rest)
    if "--replot" in rest:  # `hydragen bench NAME --replot DIR`: the plots again, from DIR/NAME.json
        at = rest.index("--replot")
        if at + 1 >= len(rest) or args.which == "all":
            raise UsageError(
                "--replot takes one results folder, after a benchmark's name: bench e2e --replot DIR"
            )
        _replot(ALL_BENCHMARKS[args.which], rest[at + 1])
        return 0
    if args.which != "all":
        importlib.import_module(ALL_BENCHMARKS[args.which]).main(rest)
        return 0
    # The whole suite at its defaults (or --quick), each benchmark into its own folder under --out.
    extra = argparse.ArgumentParser(prog="hydragen bench all")
    extra.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
    extra.add_argument("--out", default="bench-out")
    opts = extra.parse_args(rest)
    for name, module in BENCHMARKS.items():
        print(f"=== hydragen bench {name} ===", file=sys.stderr)
        argv = ["--out", f"{opts.out}/{name}"] + (["--quick"] if opts.quick else [])
        importlib.import_module(module).main(argv)
    return 0
