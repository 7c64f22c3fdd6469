"""The plots of ``hydragen bench dp`` (and ``--replot``): the measured policies side by side, and the
simulation's hit rate, load balance and tail latency against the number of replicas."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from hydragen.bench.core.plots import FIGSIZE, QUICK_TITLE, plain, pyplot

COLORS = {"cache": "C0", "round-robin": "C1", "least-loaded": "C2", "approx": "C4"}
NAMES = {
    "cache": "cache (routing on\nthe real cache)",
    "approx": "approx (text tree,\nSGLang's policy)",
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
}


def _figure(title: str, quick: bool):
    fig, ax = pyplot().subplots(figsize=FIGSIZE, dpi=120, layout="constrained")
    head = f"{QUICK_TITLE}: {title}" if quick else title
    fig.suptitle("\n".join(textwrap.wrap(head, 80)), fontsize=10.5)
    if quick:
        fig.text(0.5, 0.5, "QUICK RUN\nsmoke test, not a result", fontsize=30, color="red", alpha=0.18,
                 ha="center", va="center", rotation=18)  # fmt: skip
    return fig, ax


def _save(fig, path: Path) -> Path:
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def measured_plots(data: dict, out: Path) -> list[Path]:
    """One bar per policy: hit rate, output tokens/s, TTFT p50 and p99; targets drawn against round-robin."""
    rows, quick = data["rows"], data.get("quick", False)
    prm = data.get("params", {})
    w = prm.get("workload", {})
    ratio = w.get("system_tokens_total", 0) / max(prm.get("kv_cache_tokens", 1), 1)
    setting = (
        f"{prm.get('replicas', 2)} replicas of 1 core, {w.get('tenants', '?')} tenants (system prompts "
        f"{ratio:.1f}x one replica's cache), {w.get('requests', '?')} chat requests"
    )
    names = [r["policy"] for r in rows]
    base = next((r for r in rows if r["policy"] == "round-robin"), None)
    paths = []
    for key, ylabel, target, fname in (
        ("hit_rate", "prefix-cache hit rate (cached / prompt tokens)", 3.0, "dp_hit_rate.png"),
        ("output_tok_s", "output tokens per second", 1.5, "dp_throughput.png"),
    ):
        fig, ax = _figure(f"{ylabel.split(' (')[0].capitalize()} by routing policy: {setting}", quick)
        values = [r[key] for r in rows]
        bars = ax.bar(range(len(rows)), values, color=[COLORS.get(n, "0.5") for n in names])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=9)
        if base is not None and base[key] > 0:
            goal = target * base[key]
            ax.axhline(goal, color="0.35", linestyle=":", linewidth=1.2)
            ax.annotate(
                f"target: {target:g}x round-robin",
                (-0.45, goal),
                ha="left",
                va="bottom",
                fontsize=8.5,
                color="0.3",
            )  # fmt: skip (over round-robin's bar, which is below any target)
            if key == "hit_rate":
                ax.set_ylim(0, max(1.0, goal * 1.08))
        ax.set_xticks(range(len(rows)), [NAMES.get(n, n) for n in names], fontsize=8.5)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.12)
        paths.append(_save(fig, out / fname))
    fig, ax = _figure(f"Time to first token by routing policy: {setting}", quick)
    width = 0.38
    for j, (q, shade) in enumerate((("ttft_p50", 0.55), ("ttft_p99", 1.0))):
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        values = [r[q] for r in rows]
        bars = ax.bar(xs, values, width, color=[COLORS.get(n, "0.5") for n in names], alpha=shade,
                      label="median" if j == 0 else "99th percentile")  # fmt: skip
        ax.bar_label(bars, labels=[f"{v:.2g}" for v in values], fontsize=8)
    ax.set_xticks(range(len(rows)), [NAMES.get(n, n) for n in names], fontsize=8.5)
    ax.set_ylabel("time to first token (s), client side")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="0.75", label="median"), Patch(color="0.35", label="99th percentile")],
              fontsize=8, title="each policy's colour:", title_fontsize=8)  # fmt: skip
    ax.grid(True, axis="y", alpha=0.3)
    paths.append(_save(fig, out / "dp_ttft.png"))
    return paths


def _replica_axis(ax, reps: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(reps))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))
    ax.grid(True, alpha=0.3)


def _policy_lines(ax, rows: list[dict], key: str, per_replica: bool = False) -> None:
    for policy in COLORS:
        pts = sorted((r["replicas"], r[key]) for r in rows if r["policy"] == policy)
        if pts:
            ys = [y / n if per_replica else y for n, y in pts]
            label = NAMES[policy].replace("\n", " ")
            ax.plot([n for n, _ in pts], ys, marker="o", color=COLORS[policy], label=label)


def sim_plots(sim: dict, measured: list[dict], out: Path) -> list[Path]:
    """Lines per policy against replicas (the measured 2-replica figures as hollow squares), load balance,
    and the cache policy's balance bound."""
    quick = sim.get("quick", False)
    prm = sim.get("params", {})
    rows = [r for r in sim["rows"] if r.get("part", "replicas") == "replicas"]
    reps = sorted({r["replicas"] for r in rows})
    grows = (
        f"tenants, chats and arrivals grow with the replicas; {prm.get('kv_cache_tokens', '?')} KV tokens "
        f"and measured service times per replica; balance bound {prm.get('balance_bound', 4)}"
    )
    n_measured = prm.get("measured_replicas", 2)
    paths = []
    for key, ylabel, title, fname in (
        ("hit_rate", "prefix-cache hit rate", "hit rate as replicas grow", "dp_sim_hit_rate.png"),
        ("ttft_p99", "time to first token, 99th percentile (s)", "tail latency as replicas grow",
         "dp_sim_ttft_p99.png"),
        ("output_tok_s", "output tokens per second per replica", "throughput per replica as replicas grow",
         "dp_sim_throughput.png"),
    ):  # fmt: skip
        fig, ax = _figure(f"Simulated: {title} ({grows})", quick)
        per_replica = key == "output_tok_s"
        _policy_lines(ax, rows, key, per_replica)
        for i, r in enumerate(measured):
            y = r[key] / n_measured if per_replica else r[key]
            ax.plot([n_measured], [y], marker="s", markersize=10, markerfacecolor="none", linestyle="none",
                    markeredgecolor=COLORS.get(r["policy"], "0.3"), mew=1.6,
                    label=None if i else "measured (hollow square, the policy's colour)")  # fmt: skip
        _replica_axis(ax, reps)
        ax.set_xlabel("replicas")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1 if key == "hit_rate" else None)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths.append(_save(fig, out / fname))
    # Load balance: requests routed and time computed, busiest replica over the mean.
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.6), dpi=120, layout="constrained", sharey=True)
    head = f"Simulated: load balance as replicas grow ({grows})"
    fig.suptitle("\n".join(textwrap.wrap(f"{QUICK_TITLE}: {head}" if quick else head, 110)), fontsize=10.5)
    for ax, key, what in (
        (axes[0], "requests_max_over_mean", "requests routed: busiest replica / mean"),
        (axes[1], "busy_max_over_mean", "time computing: busiest replica / mean"),
    ):
        _policy_lines(ax, rows, key)
        _replica_axis(ax, reps)
        ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1)
        ax.set_title(what, fontsize=9.5)
        ax.set_xlabel("replicas")
    axes[0].set_ylabel("busiest / mean (1 = perfectly even)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(fig, out / "dp_sim_balance.png"))
    bound_rows = sorted((r for r in sim["rows"] if r.get("part") == "balance bound"),
                        key=lambda r: r["balance_bound"])  # fmt: skip
    if bound_rows:
        n = bound_rows[0]["replicas"]
        fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.6), dpi=120, layout="constrained")
        head = (
            f"Simulated: the cache policy's balance bound at {n} replicas (a request leaves its best match "
            "when that replica has more than this many requests in flight beyond the least-loaded one)"
        )
        fig.suptitle(
            "\n".join(textwrap.wrap(f"{QUICK_TITLE}: {head}" if quick else head, 110)), fontsize=10.5
        )
        bounds = [r["balance_bound"] for r in bound_rows]
        for ax, key, what in ((axes[0], "hit_rate", "prefix-cache hit rate"),
                              (axes[1], "ttft_p99", "time to first token, 99th percentile (s)")):  # fmt: skip
            ax.plot(bounds, [r[key] for r in bound_rows], marker="o", color=COLORS["cache"])
            _replica_axis(ax, bounds)
            ax.set_xlabel("balance bound (requests in flight)")
            ax.set_ylabel(what)
            ax.set_ylim(0, 1 if key == "hit_rate" else None)
        paths.append(_save(fig, out / "dp_sim_bound.png"))
    return paths


def plots(data: dict, out: Path) -> list[Path]:
    """Every plot of a run folder: the measured policies (if measured) and the simulation (if simulated)."""
    paths = measured_plots(data, out) if data.get("rows") else []
    sim_path = Path(out) / "dp_sim.json"
    if sim_path.is_file():
        paths += sim_plots(json.loads(sim_path.read_text()), data.get("rows", []), Path(out))
    return paths
