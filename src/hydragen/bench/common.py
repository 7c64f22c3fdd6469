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


def plot_lines(
    series: dict[str, tuple[list[float], list[float]]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    hline: tuple[float, str] | None = None,
) -> Path:
    """One PNG line plot, a line per series label; used by every benchmark so the plots look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline[0], color="gray", linestyle="--", linewidth=1, label=hline[1])
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def touch_kv_pool(llm) -> None:
    """Fault in every KV page before timing: the pool is reserved lazily (torch.empty), and first-touch
    page faults inside a timed run would charge whichever mode happens to run first."""
    llm.engine.pool.k.zero_()
    llm.engine.pool.v.zero_()
