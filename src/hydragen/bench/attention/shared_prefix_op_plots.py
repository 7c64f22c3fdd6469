"""The plots of ``hydragen bench attention`` (and ``--replot``): speedup against batch size, a panel per
shape and a line per prefix length, and speedup as the private suffix grows."""

from __future__ import annotations

from pathlib import Path

from hydragen.bench.attention.sweeps import SHAPE_WORDS, shape_words
from hydragen.bench.core.plots import Missing, Panel, plot, plot_lines


def plots(data: dict, out: Path) -> list[Path]:
    """Speedup vs batch (a panel per shape, a line per prefix length, at one suffix) and speedup vs suffix
    length, from a run's saved rows."""
    rows, quick = data["rows"], data.get("quick", False)
    ok = [r for r in rows if r.get("status") == "ok"]
    suffixes = [r["suffix"] for r in rows]
    plot_suffix = data.get("params", {}).get("plot_suffix") or max(
        set(suffixes), key=suffixes.count, default=0
    )
    dtype = next((r["dtype"] for r in rows), "")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))  # as swept
    panels = []
    for shape in shapes:
        series: dict[str, tuple[list[float], list[float]]] = {}
        missing = []
        for r in sorted((r for r in rows if r["shape"] == shape), key=lambda r: (r["prefix"], r["batch"])):
            if r["suffix"] != plot_suffix:
                continue
            name = f"prefix {r['prefix']:,} tokens"
            xs, ys = series.setdefault(name, ([], []))
            if r.get("status") == "ok":
                xs.append(r["batch"])
                ys.append(r["speedup"])
            else:
                missing.append(Missing(name, r["batch"], str(r.get("status", "not run"))))
        panels.append(Panel(series, shape_words(shape), missing, hline=(1.0, "same speed")))
    machine = data.get("params", {}).get("measured_on") or data.get("machine", "")  # on CUDA: the GPU
    paths = [
        plot(
            panels,
            out / "attention_speedup_vs_batch.png",
            f"Shared-prefix attention vs per-sequence SDPA over each sequence's own copy: one decode step, "
            f"private suffix of {plot_suffix} tokens ({dtype}; above 1: hydragen is faster)",
            "batch size (sequences sharing the prefix)",
            "speedup (SDPA time / hydragen time)",
            logx=True,
            quick=quick,
            footnote=f"Machine: {machine}",
        )
    ]
    # Speedup vs suffix: the (B, P) groups with >= 2 suffix values, at their most common batch (ties:
    # the largest), so the full grid gives one line per prefix at the largest batch.
    by_suffix: dict[str, tuple[list[float], list[float]]] = {}
    for shape in shapes:
        groups: dict[tuple[int, int], list[dict]] = {}
        for r in ok:
            if r["shape"] == shape:
                groups.setdefault((r["batch"], r["prefix"]), []).append(r)
        multi = {k: v for k, v in groups.items() if len({r["suffix"] for r in v}) >= 2}
        if not multi:
            continue
        counts: dict[int, int] = {}
        for b, _ in multi:
            counts[b] = counts.get(b, 0) + 1
        best = max(counts, key=lambda b: (counts[b], b))
        for (b, pre), grp in sorted(multi.items()):
            if b == best:
                grp = sorted(grp, key=lambda r: r["suffix"])
                name = f"{SHAPE_WORDS.get(shape, shape)}, batch {b}, prefix {pre:,}"
                by_suffix[name] = ([r["suffix"] for r in grp], [r["speedup"] for r in grp])
    if by_suffix:
        paths.append(
            plot_lines(
                by_suffix,
                out / "attention_speedup_vs_suffix.png",
                f"Shared-prefix attention vs per-sequence SDPA as the private suffix grows ({dtype}; "
                "above 1: hydragen is faster)",
                "private suffix length (tokens per sequence)",
                "speedup (SDPA time / hydragen time)",
                logx=True,
                hline=(1.0, "same speed"),
                quick=quick,
                footnote=f"Machine: {machine}",
                ylim_zero=True,
            )
        )
    return paths
