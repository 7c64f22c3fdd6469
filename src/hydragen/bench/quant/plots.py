"""The plots of ``hydragen bench quant`` (and ``--replot``): the kernels' rates by weight format, and the
decode rates of the engines side by side, on the embedded model and on real-size random models."""

from __future__ import annotations

from pathlib import Path

from hydragen.bench.core.plots import Panel, plot, plot_lines
from hydragen.bench.quant.decode import sampled_settings

KERNEL_PANELS = {
    "32-weight blocks": ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
    "256-weight K-quants": ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    "16-bit, and torch's candidates": (
        "F16",
        "BF16",
        "torch float32 (before)",
        "torch int4 op, bf16 activations",
        "torch bf16, bf16 activations",
    ),
    "15-bit (default) against int8 activations": tuple(
        f + w for f in ("Q4_1", "Q8_0", "Q4_K", "Q6_K") for w in ("", ", int8 activations")
    ),
}


def _kernel_label(row: dict) -> str:
    if row["kernel"].startswith("hydragen"):
        return row["format"] + row["kernel"].removeprefix("hydragen")
    return row["kernel"]


def plots(data: dict, out: Path) -> list[Path]:
    paths = []
    quick = data.get("quick", False)
    if data.get("kernels"):
        for key, name, ylabel, ref in (
            ("GB/s", "quant_kernels_bandwidth.png", "weight bytes read, GB/s", "measured read bandwidth"),
            ("GFLOP/s", "quant_kernels_gflops.png", "GFLOP/s", "float32 GEMM rate"),
        ):
            measured = data["runs"]["kernels"]["params"]
            level = measured["bandwidth GB/s"] if key == "GB/s" else measured["fp32 GEMM GFLOP/s"]
            panels = []
            for title, labels in KERNEL_PANELS.items():
                series: dict[str, tuple[list, list]] = {}
                for r in data["kernels"]:
                    if _kernel_label(r) in labels:
                        xs, ys = series.setdefault(_kernel_label(r), ([], []))
                        xs.append(r["M"])
                        ys.append(r[key])
                panels.append(Panel(series, title=title, hline=(level, ref)))
            paths.append(
                plot(
                    panels,
                    out / name,
                    "Quantized matmul by weight format (hydragen's kernels unless named)",
                    "activation rows M",
                    ylabel,
                    logx=True,
                    logy=True,
                    quick=quick,
                )
            )
    if data.get("decode"):
        series = {}
        for r in data["decode"]:
            if r.get("prompts", 1) > 1:  # distinct prompts: a point of their own, in the table only
                continue
            xs, ys = series.setdefault(r["engine"], ([], []))
            xs.append(r["n"])
            ys.append(r["decode tok/s"])
        title = f"Decode, same GGUF, side by side ({_plot_words(data['runs']['decode'])})"
        paths.append(
            plot_lines(series, out / "quant_decode.png", title, _points_label(data["decode"]),
                       "decode tokens/s", logx=True, logy=True, quick=quick)
        )  # fmt: skip
    models = list(dict.fromkeys(r.get("model") for r in data.get("real") or []))
    if len(models) > 1 and any(r["engine"] == "llama.cpp" for r in data["real"]):
        paths.append(_real_ratios(data, models, out / "quant_real.png", quick))
    elif data.get("real"):
        series = {}
        for r in data["real"]:
            name = f"{r.get('model', data['runs']['real']['params'].get('real_size'))}: {r['engine']}"
            xs, ys = series.setdefault(name, ([], []))
            xs.append(r["n"])
            ys.append(r["decode tok/s"])
        title = f"Real-size random models ({_plot_words(data['runs']['real'])})"
        paths.append(
            plot_lines(series, out / "quant_real.png", title, "completions n of one 256-token prompt",
                       "decode tokens/s", logx=True, logy=True, quick=quick)
        )  # fmt: skip
    return paths


def _real_ratios(data: dict, models: list, path: Path, quick: bool) -> Path:
    """Several real-size models: hydragen's decode rate over llama.cpp's (paired, within a round) per model,
    a bar per n, the level line at 1: which families and batch sizes it leads, at a glance."""
    from hydragen.bench.core.plots import pyplot

    plt = pyplot()
    ns = sorted({r["n"] for r in data["real"]})
    ours = {(r["model"], r["n"]): r for r in data["real"] if r["engine"].startswith("hydragen (")}
    fig, ax = plt.subplots(figsize=(1.6 * len(models) + 2, 4.2), dpi=120)
    width = 0.8 / len(ns)
    for j, n in enumerate(ns):
        xs = [i + (j - (len(ns) - 1) / 2) * width for i in range(len(models))]
        ys = [float(ours[m, n]["vs llama.cpp, paired"]) if (m, n) in ours else 0.0 for m in models]
        bars = ax.bar(xs, ys, width, label=f"n = {n}")
        ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=8, padding=2)
    ax.axhline(1.0, color="0.3", linestyle=":", linewidth=1.2, label="level with llama.cpp")
    ax.set_xticks(range(len(models)), [str(m).split(":")[0] for m in models], fontsize=9)
    ax.set_ylabel("hydragen / llama.cpp decode tok/s (paired)")
    title = f"Real-size random models, same GGUF Q4_K_M file ({_plot_words(data['runs']['real'])})"
    ax.set_title(("QUICK RUN: " if quick else "") + title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _points_label(rows: list[dict]) -> str:
    """The decode plot's x label from the points it shows, e.g. 'completions n of one prompt (n = 1, 8: 512
    tokens; 64: 2,048)'."""
    by_prompt: dict[int, list[int]] = {}
    for r in rows:
        if r.get("prompts", 1) == 1 and r["n"] not in by_prompt.setdefault(r["prompt"], []):
            by_prompt[r["prompt"]].append(r["n"])
    parts = [f"{', '.join(map(str, sorted(ns)))}: {p:,} tokens" for p, ns in sorted(by_prompt.items())]
    return f"completions n of one prompt (n = {'; '.join(parts)})"


def _plot_words(run: dict) -> str:
    """The sampling a part's plot shows, for its title (results from before the peer sampled: greedy)."""
    sampling = run.get("params", {}).get("sampling")
    if sampling is None:
        return "llama.cpp greedy"
    words = sampled_settings(sampling)
    return "both greedy" if words is None else f"both at {words}"
