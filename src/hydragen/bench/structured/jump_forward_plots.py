"""The plots of ``hydragen bench structured`` (and ``--replot``): output speed and latency per mode at each
batch size, and the cost of masks alone."""

from __future__ import annotations

from pathlib import Path

from hydragen.bench.structured.modes import FREE_MODES, MODE_LABELS, MODES


def plots(data: dict, out: Path) -> list[Path]:
    """Tokens/s and latency per mode at each batch size; mask time per token."""
    from hydragen.bench.core.plots import QUICK_TITLE, pyplot

    plt = pyplot()
    rows = data["rows"]
    batches = sorted({r["batch"] for r in rows})
    workload = "Tool calls" if data.get("params", {}).get("workload") == "tools" else "JSON extraction"
    paths = []
    for metric, ylabel, name, modes in (
        ("tokens_per_s", "output tokens per second", "structured_tokens_per_s.png", MODES),
        ("tokens_per_cpu_s", "output tokens per CPU second", "structured_tokens_per_cpu_s.png", MODES),
        ("latency_mean_s", "mean request latency (s)", "structured_latency.png", MODES),
        ("tokens_per_cpu_s", "output tokens per CPU second", "structured_mask_overhead.png", FREE_MODES),
    ):
        modes = [m for m in modes if any(r["mode"] == m for r in rows)]
        if not modes:  # the tools workload has no free-text runs
            continue
        fig, ax = plt.subplots(figsize=(8.4, 4.6), layout="constrained")
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            values = [
                next((r[metric] for r in rows if r["batch"] == b and r["mode"] == mode), 0.0) for b in batches
            ]
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(batches))]
            bars = ax.bar(xs, values, width, label=MODE_LABELS[mode], color=f"C{j}")
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel(ylabel)
        title = {
            "structured_tokens_per_s.png": f"{workload}: output speed with and without jump-forward",
            "structured_tokens_per_cpu_s.png": f"{workload}: output per CPU second",
            "structured_latency.png": f"{workload}: time per request",
            "structured_mask_overhead.png": "Cost of grammar masks alone (fixed-length free text)",
        }[name]
        ax.set_title(QUICK_TITLE + "\n" + title if data.get("quick") else title)
        ax.legend(loc="upper left", fontsize=8)
        ax.margins(y=0.15)
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
