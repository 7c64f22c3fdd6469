"""Shared benchmark plumbing: machine description, measured matmul rate, result tables."""

from __future__ import annotations

import json
import os
import platform
import time
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


def write_table(
    rows: list[dict], columns: list[str], out: Path, name: str, title: str, notes: str = ""
) -> str:
    """Write rows as JSON and a Markdown table; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": machine_description(), "rows": rows}, indent=2))
    lines = [f"## {title}", "", f"Machine: {machine_description()}", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    md = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(md)
    return md


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)
