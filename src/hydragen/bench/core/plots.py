"""The benchmarks' pictures: one look for every plot, made to be read without the code.

Axis numbers are plain (1, 4, 16, not 2^0 or 2x10^1); legends and titles are in words ("sharing off",
"llama.cpp", not internal mode names); titles wrap instead of running off the edge; points that could not
be measured are drawn as a cross on the axis and explained under the plot; a quick run says, across the
picture, that it is a smoke test.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Internal mode names -> what a reader sees.
LABELS = {
    "hydragen": "hydragen (sharing on)",
    "nosharing": "sharing off",
    "noattn": "attention skipped (ceiling)",
    "hf": "transformers",
    "llamacpp": "llama.cpp",
    "tree": "tree sharing",
    "onelevel": "one-level sharing (few-shot block only)",
    "on": "sharing on",
    "off": "sharing off",
    "cache on": "prefix cache on",
    "cache off": "prefix cache off",
}
# One colour per meaning in every picture (hydragen blue, sharing off orange, peers green and red); the
# ceiling is drawn as a reference, not a contender.
STYLES = {
    "hydragen (sharing on)": dict(color="C0"),
    "tree sharing": dict(color="C0"),
    "sharing on": dict(color="C0"),
    "prefix cache on": dict(color="C0"),
    "sharing off": dict(color="C1"),
    "prefix cache off": dict(color="C1"),
    "one-level sharing (few-shot block only)": dict(color="C4"),
    "transformers": dict(color="C2"),
    "llama.cpp": dict(color="C3"),
    "hydragen, dequantized to float32 (before)": dict(color="C7"),  # not the default cycle's red: llama.cpp's
    "hydragen, float32 KV cache (--kv-cache-dtype float32)": dict(color="C1"),
    "hydragen, per-op layers (HYDRAGEN_FUSED_LAYERS=0)": dict(color="C2"),
    "hydragen, packed weights on 4 KiB pages (HYDRAGEN_HUGE_PAGES=0)": dict(color="C8"),
    "hydragen, int8 activations, llama.cpp's numerics (HYDRAGEN_QUANT_ACT_BITS=8)": dict(color="C4"),
    # the engines of runs before float16 became a quantized model's default cache (docs/results/quant)
    "hydragen, float16 KV cache (--kv-cache-dtype float16)": dict(color="C1", linestyle=":"),
    "hydragen, int8 activations (HYDRAGEN_QUANT_ACT_BITS=8)": dict(color="C4", linestyle=":"),
    "hydragen, llama.cpp's numerics (int8 activations, float16 KV cache)": dict(color="C5", linestyle="--"),
    "attention skipped (ceiling)": dict(linestyle="--", color="0.45", marker="s"),
}
QUICK_TITLE = "QUICK RUN (smoke test, not a measurement)"
FIGSIZE = (8.4, 4.6)
LEGEND_WRAP = 40  # characters per line of a legend label beside a single panel


def label(name: str) -> str:
    return LABELS.get(name, name)


def plain(value: float) -> str:
    """A tick label as a person writes it: 16, 2,048, 0.25."""
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.3g}"


@dataclass
class Missing:
    """A point of a series that has no value, drawn as a cross on the x axis and explained below."""

    series: str
    x: float
    reason: str


@dataclass
class Panel:
    """One set of axes: lines by label, missing points, a reference line and text notes."""

    series: dict[str, tuple[Sequence[float], Sequence[float]]]
    title: str = ""
    missing: list[Missing] = field(default_factory=list)
    hline: tuple[float, str] | None = None
    notes: list[tuple[float, float, str]] = field(default_factory=list)  # (x, y, text) next to a point
    brackets: list[tuple[float, float, float, str]] = field(default_factory=list)  # x, y from, y to, text
    rings: list[tuple[float, float]] = field(default_factory=list)  # points to circle (see ring_label)
    ring_label: str = ""


def _missing_from_nan(panel: Panel, reason: str) -> list[Missing]:
    """A NaN value is a point that was run but could not be measured: it is marked, never dropped."""
    found = list(panel.missing)
    for name, (xs, ys) in panel.series.items():
        for x, y in zip(xs, ys, strict=True):
            if y is None or (isinstance(y, float) and math.isnan(y)):
                found.append(Missing(name, x, reason))
    return found


def _footnote(missing: list[Missing]) -> str:
    """'Not measured: llama.cpp at n = 16, 64 (peers run up to n = 4)' lines, one per reason."""
    by_reason: dict[str, dict[str, list[float]]] = {}
    for m in missing:
        by_reason.setdefault(m.reason, {}).setdefault(m.series, []).append(m.x)
    lines = []
    for reason, where in by_reason.items():
        parts = [f"{name} at {', '.join(plain(x) for x in sorted(set(xs)))}" for name, xs in where.items()]
        lines.append(f"\u00d7 not measured: {'; '.join(parts)} ({reason})")
    return "\n".join(lines)


def _plain_axis(ax, axis: str, log: bool, values: list[float]) -> None:
    """Plain tick labels; on x, ticks where the data are (when there are few); on a log y axis, enough
    labelled ticks to read a value even when the data span less than a decade."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))
    finite = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if axis == "x" and finite and len(set(finite)) <= 12:
        target.set_major_locator(FixedLocator(sorted(set(finite))))
        target.set_minor_locator(NullLocator())
    elif log:
        narrow = bool(finite) and max(finite) / min(finite) < 10
        subs = tuple(float(k) for k in range(1, 10)) if narrow else (1.0, 2.0, 3.0, 5.0)
        target.set_major_locator(LogLocator(base=10, subs=subs))
        target.set_minor_formatter(NullFormatter())


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend, no window); a MissingBenchDependency naming
    the bench extra when matplotlib is not installed."""
    from hydragen.bench import import_optional

    import_optional("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(panels: list[Panel], path: Path, title: str, xlabel: str, ylabel: str, **kwargs) -> Path:
    """Panels side by side sharing the y axis, saved as one PNG (``kwargs``: see ``draw``)."""
    plt = pyplot()

    fig = draw(panels, title, xlabel, ylabel, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def draw(
    panels: list[Panel],
    title: str,
    xlabel: str,
    ylabel: str,
    *,
    logx: bool = False,
    logy: bool = False,
    quick: bool = False,
    nan_reason: str = "within timing noise",
    footnote: str = "",
    ylim_zero: bool = False,
):
    """The matplotlib Figure of ``plot`` (NaN values become "not measured" points with ``nan_reason``)."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    width = FIGSIZE[0] if len(panels) == 1 else 5.2 * len(panels)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(width, FIGSIZE[1]), dpi=120, squeeze=False, sharey=True
    )  # one y scale: panels are compared with each other
    missing_all: list[Missing] = []
    for ax, panel in zip(axes[0], panels, strict=True):
        xs_all, ys_all, colors = [], [], {}
        for name, (xs, ys) in panel.series.items():
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and not math.isnan(y)]
            style = dict(marker="o") | STYLES.get(name, {})
            (line,) = ax.plot([x for x, _ in pts], [y for _, y in pts], label=name, **style)
            colors[name] = line.get_color()
            xs_all += list(xs)
            ys_all += [y for _, y in pts]
        missing = _missing_from_nan(panel, nan_reason)
        missing_all += missing
        stacked: dict[float, int] = {}
        for m in missing:  # a cross just above the x axis in the series' colour, stacked where several
            k = stacked[m.x] = stacked.get(m.x, -1) + 1
            ax.plot(
                [m.x], [0.03 + 0.06 * k], marker="x", markersize=9, mew=2, color=colors.get(m.series, "0.3"),
                transform=ax.get_xaxis_transform(), clip_on=False, linestyle="none",
            )  # fmt: skip
            xs_all.append(m.x)
        if panel.hline is not None:
            ax.axhline(panel.hline[0], color="0.5", linestyle=":", linewidth=1.2, label=panel.hline[1])
        if panel.rings:
            ax.plot(
                [x for x, _ in panel.rings], [y for _, y in panel.rings], linestyle="none", marker="o",
                markersize=13, markerfacecolor="none", markeredgecolor="red", mew=1.5, label=panel.ring_label,
            )  # fmt: skip
        for x, y, text in panel.notes:
            ax.annotate(
                text, (x, y), xytext=(-10, -10), textcoords="offset points", ha="right", va="top",
                fontsize=8.5, bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="0.8", alpha=0.9),
            )  # fmt: skip
        for x, y0, y1, text in panel.brackets:  # a ratio between two points at one x, drawn as an arrow
            ax.annotate("", (x, y1), xytext=(x, y0), arrowprops=dict(arrowstyle="<->", color="0.2", lw=1.2))
            mid = (y0 * y1) ** 0.5 if logy else (y0 + y1) / 2
            ax.annotate(
                text, (x, mid), xytext=(-6, 0), textcoords="offset points", ha="right", va="center",
                fontsize=9.5, fontweight="bold",
            )  # fmt: skip
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        _plain_axis(ax, "x", logx, xs_all)
        _plain_axis(ax, "y", logy, ys_all)
        if ylim_zero and not logy:
            ax.set_ylim(bottom=0)
        if panel.title:
            ax.set_title("\n".join(textwrap.wrap(panel.title, 64)), fontsize=9.5)
        ax.set_xlabel("\n".join(textwrap.wrap(xlabel, 56)))  # a long label stays within a narrow panel
        ax.grid(True, alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if missing:
            cross = Line2D([], [], marker="x", mew=2, color="0.3", linestyle="none", label="not measured")
            handles.append(cross)
        # Beside the axes, never over a line: a single panel gets the room on its right, with long labels
        # wrapped so the legend does not squeeze the axes.
        outside = len(panels) == 1
        labels = [h.get_label() for h in handles]
        if outside:
            labels = [textwrap.fill(t, LEGEND_WRAP, break_on_hyphens=False) for t in labels]
        ax.legend(
            handles=handles, labels=labels, fontsize=8, framealpha=0.9,
            **(dict(loc="upper left", bbox_to_anchor=(1.01, 1.0)) if outside else {}),
        )  # fmt: skip
    axes[0][0].set_ylabel(ylabel)
    head = f"{QUICK_TITLE}: {title}" if quick else title
    fig.suptitle("\n".join(textwrap.wrap(head, 70 if len(panels) == 1 else 110)), fontsize=11)
    text = "\n".join(t for t in (_footnote(missing_all), footnote) if t)
    wrapped = "\n".join(textwrap.fill(line, 120, break_on_hyphens=False) for line in text.splitlines())
    bottom = 0.0
    if wrapped:
        lines = wrapped.count("\n") + 1
        bottom = (lines * 8 * 1.4 / 72 + 0.1) / FIGSIZE[1]
        fig.text(0.01, 0.01, wrapped, fontsize=8, va="bottom", ha="left", color="0.25")
    if quick:
        fig.text(0.5, 0.5, "QUICK RUN\nsmoke test, not a result", fontsize=30, color="red", alpha=0.18,
                 ha="center", va="center", rotation=18)  # fmt: skip
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def plot_lines(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    hline: tuple[float, str] | None = None,
    missing: Sequence[Missing] = (),
    notes: Sequence[tuple[float, float, str]] = (),
    brackets: Sequence[tuple[float, float, float, str]] = (),
    **kwargs,
) -> Path:
    """One panel of lines (the common case); ``kwargs`` go to ``plot``."""
    panel = Panel(series, hline=hline, missing=list(missing), notes=list(notes), brackets=list(brackets))
    return plot([panel], path, title, xlabel, ylabel, logx=logx, logy=logy, **kwargs)
