"""Shared benchmark plumbing: machine description, measured rates, result tables (and publishing them with
their plots), quick-run warnings."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


@functools.cache
def code_commit() -> str:
    """The git commit of the hydragen code that runs (with "+changes" when its tree has local edits), or
    its version when it is not a git checkout."""
    import subprocess

    import hydragen

    root = Path(hydragen.__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            raise OSError(head.stderr)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return f"hydragen {hydragen.__version__}"


def matmul_rate(n: int = 2048, dtype=torch.float32, device="cpu", repeats: int = 5) -> float:
    """Measured dense matmul rate in FLOP/s: the compute ceiling for arithmetic floors."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


QUICK_BANNER = (
    "QUICK RUN: a smoke test at toy sizes that checks every part runs. Its numbers are timing noise, "
    "not results; run without --quick to measure."
)
NOT_MEASURABLE = "n/a"


def write_table(
    rows: list[dict],
    columns: list[str],
    out: Path,
    name: str,
    title: str,
    notes: str = "",
    *,
    quick: bool = False,
    quick_note: str = "",
    params: dict | None = None,
) -> str:
    """Write rows as JSON and a Markdown table; returns the Markdown.

    The JSON keeps the run's parameters (so ``--replot`` can redraw the plots from it alone), the machine,
    the code's git commit and whether it was a quick run. A quick run's table opens and closes with a
    warning that its numbers are noise, and ``quick_note`` says which numbers look wrong at its toy sizes
    and why; a value that could not be measured (NaN) shows as "n/a", explained under the table.
    """
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": machine_description(),
        "commit": code_commit(),
        "quick": quick,
        "params": params or {},
        "rows": rows,
    }
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    lines = [f"## {title}", ""]
    if quick:
        lines += [f"**{QUICK_BANNER}**", ""]
        if quick_note:
            lines += [f"**Why some numbers look wrong at this size:** {quick_note}", ""]
    lines += [f"Machine: {machine_description()}; code: {code_commit()}", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    if any(_is_nan(r.get(c)) for r in rows for c in columns):
        lines += ["", f"{NOT_MEASURABLE}: not measurable in this run (a difference within timing noise)"]
    if quick:
        lines += ["", f"**{QUICK_BANNER}**"]
    md = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(md)
    return md


def _is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _fmt(x) -> str:
    if _is_nan(x):
        return NOT_MEASURABLE
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def say_quick(tag: str) -> None:
    """Tell the person watching, before a quick run starts, what its numbers will not be."""
    print(f"[{tag}] {QUICK_BANNER}", file=sys.stderr)


def read_results(folder: Path, name: str) -> dict:
    """A benchmark's saved JSON (for ``--replot``), with a clear error when it is not there."""
    path = Path(folder) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --replot needs the folder a run wrote its {name}.json to")
    data = json.loads(path.read_text())
    data.setdefault("params", {})
    data.setdefault("quick", False)
    return data


def publish(
    rows: list[dict],
    columns: list[str],
    out: Path,
    name: str,
    title: str,
    notes: str = "",
    *,
    plots: Callable[[dict, Path], list[Path]],
    quick: bool = False,
    quick_note: str = "",
    params: dict | None = None,
) -> list[Path]:
    """How a benchmark ends: its table written (``write_table``), its plots drawn, the Markdown printed.
    Returns the plots' paths.

    The plots are drawn from the JSON just written, read back as ``--replot`` reads it, so a replot of the
    folder draws what the run drew: whatever a plot shows has to be in the JSON."""
    md = write_table(
        rows, columns, out, name, title, notes, quick=quick, quick_note=quick_note, params=params
    )
    paths = plots(read_results(out, name), out)
    print(md)
    return paths


def memory_bandwidth(mib: int = 512, device="cpu", repeats: int = 5) -> float:
    """Measured copy bandwidth in bytes/s (read + write counted): the ceiling for byte floors."""
    n = mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def touch_kv_pool(llm) -> None:
    """Fault in every KV page before timing: the pool is reserved lazily (torch.empty), and first-touch
    page faults inside a timed run would charge whichever mode happens to run first."""
    llm.engine.pool.k.zero_()
    llm.engine.pool.v.zero_()
