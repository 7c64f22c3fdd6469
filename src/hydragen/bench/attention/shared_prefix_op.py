"""Attention microbenchmark: shared-prefix (Hydragen) attention vs. per-sequence attention over the same KV.

The decode step of the Hydragen paper: B sequences share one prefix of P tokens, each has its own suffix of
S tokens, and each asks one query (Nq = 1).

* hydragen: ``shared_prefix_attention`` with the prefix stored once ([1, P, Hkv, D]). The queries of all B
  sequences are folded into the rows of one matrix, so the prefix is read once by a matrix-matrix
  product; the suffix is attended per sequence and the two partials are merged through their LSE.
* baseline: the paper's "FlashAttention" baseline, one batched fused SDPA call over [B, Hq, 1, D] queries
  and [B, Hkv, P + S, D] keys, where every sequence holds its own materialised copy of the prefix (what an
  engine without prefix sharing keeps in memory). The copy is built once, outside the timed region.

The baseline's work is B matrix-vector products, so it must read B * (P + S) KV tokens; hydragen reads
P + B * S. Both do the same 4 * B * Hq * (P + S) * D FLOPs, and both compute exact attention, so their
outputs are compared at every point. Reported per point: both times (median of trials), speedup, the bytes
that must move and the FLOPs, achieved GB/s and GFLOP/s, and those as fractions of this machine's
measured copy bandwidth and matmul rate (the roofline ceilings).

Shapes: "paper" (Hq=8, Hkv=1, D=128, as the paper) and "gqa" (SmolLM2-135M's Hq=9, Hkv=3, D=64).
CPU: warm-up, then the median of trials timed with perf_counter, the two sides interleaved so background
load hits both alike. CUDA: each side captured in a CUDA graph (eager if capture fails, recorded), L2
flushed before every trial, CUDA-event timing, median of many trials. Points whose baseline KV copy would
exceed a memory budget are skipped and reported as such. --full runs the paper's sweep (batch 1..1024,
prefix 1K..16K, suffix 32..512).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hydragen.attention import shared_prefix_attention
from hydragen.bench.attention.shared_prefix_op_plots import plots
from hydragen.bench.attention.sweeps import SHAPES, SWEEPS, sweep_points
from hydragen.bench.attention.timers import time_cpu, time_cuda
from hydragen.bench.core.common import (
    machine_description,
    matmul_rate,
    memory_bandwidth,
    publish,
    say_quick,
)

RESULT_NAME = "attention"  # attention.json, attention.md
COLUMNS = [
    "shape",
    "batch",
    "prefix",
    "suffix",
    "hydragen_ms",
    "baseline_ms",
    "speedup",
    "hydragen_gbps",
    "baseline_gbps",
    "hydragen_gflops",
    "baseline_gflops",
    "hydragen_bw_frac",
    "baseline_bw_frac",
    "hydragen_mm_frac",
    "baseline_mm_frac",
    "max_abs_diff",
    "status",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _log(msg: str) -> None:
    print(f"[attention] {msg}", file=sys.stderr, flush=True)


def moved_bytes(batch: int, prefix: int, suffix: int, hq: int, hkv: int, d: int, elem: int) -> dict[str, int]:
    """Bytes each side must move at least: every KV byte it reads once, plus q in and out.

    hydragen reads the prefix once and each suffix once; the baseline reads every sequence's whole copy.
    Intermediates (partials, LSEs, the merge) are not counted: they are the implementation's overhead.
    """
    kv_token = 2 * hkv * d * elem  # K and V of one token
    q_io = 2 * batch * hq * d * elem
    return {
        "hydragen": prefix * kv_token + batch * suffix * kv_token + q_io,
        "baseline": batch * (prefix + suffix) * kv_token + q_io,
    }


def attention_flops(batch: int, prefix: int, suffix: int, hq: int, d: int) -> int:
    """QK^T and PV: 2 FLOPs per multiply-add, two matmuls, over every (query head, key) pair."""
    return 4 * batch * hq * (prefix + suffix) * d


def baseline_kv_bytes(batch: int, prefix: int, suffix: int, hkv: int, d: int, elem: int, expand: int) -> int:
    """Memory the baseline's materialised per-sequence K and V take (``expand`` > 1 without native GQA)."""
    return 2 * batch * (prefix + suffix) * hkv * expand * d * elem


def default_budget(device: str, fraction: float = 0.4) -> int:
    """Bytes the baseline KV may take: a fraction of available RAM (CPU) or free GPU memory (CUDA)."""
    if device.startswith("cuda"):
        return int(fraction * torch.cuda.mem_get_info()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(fraction * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5); otherwise KV heads are expanded."""
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# One point
# --------------------------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def bench_point(
    shape: str,
    batch: int,
    prefix: int,
    suffix: int,
    *,
    dtype: torch.dtype,
    device: str,
    budget: int,
    bandwidth: float,
    rate: float,
    gqa_native: bool,
    trials: int,
    target_s: float,
    impl: str,
    flush: torch.Tensor | None,
    seed: int = 0,
) -> dict:
    """Time both sides at one (shape, B, P, S) and derive the roofline metrics; a skip is a row too."""
    hq, hkv, d = SHAPES[shape]
    elem = torch.empty((), dtype=dtype).element_size()
    expand = 1 if gqa_native else hq // hkv
    row: dict = dict(
        shape=shape, hq=hq, hkv=hkv, d=d, batch=batch, prefix=prefix, suffix=suffix,
        dtype=str(dtype).removeprefix("torch."), device=device,
    )  # fmt: skip
    kv_need = baseline_kv_bytes(batch, prefix, suffix, hkv, d, elem, expand)
    row["baseline_kv_bytes"] = kv_need
    if kv_need > budget:
        row["status"] = (
            f"skipped (OOM guard: baseline KV {kv_need / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB)"
        )
        return row

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape_: int) -> torch.Tensor:
        return torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32).to(dtype)

    try:
        q = randn(batch, 1, hq, d)
        prefix_k, prefix_v = randn(1, prefix, hkv, d), randn(1, prefix, hkv, d)
        suffix_k, suffix_v = randn(batch, suffix, hkv, d), randn(batch, suffix, hkv, d)
        # The baseline's own copy: every sequence's full KV, contiguous in SDPA's [B, H, L, D] layout.
        heads = hkv * expand
        k_full = torch.empty(batch, heads, prefix + suffix, d, device=device, dtype=dtype)
        v_full = torch.empty_like(k_full)
        for full, pre, suf in ((k_full, prefix_k, suffix_k), (v_full, prefix_v, suffix_v)):
            pre_t, suf_t = pre.transpose(1, 2), suf.transpose(1, 2)
            if expand > 1:
                pre_t, suf_t = pre_t.repeat_interleave(expand, 1), suf_t.repeat_interleave(expand, 1)
            full[:, :, :prefix] = pre_t
            full[:, :, prefix:] = suf_t
        q_t = q.transpose(1, 2)  # [B, Hq, 1, D]
        sdpa_kw = {"enable_gqa": True} if gqa_native and hkv != hq else {}

        def hydragen() -> torch.Tensor:
            return shared_prefix_attention(q, [prefix_k], [prefix_v], suffix_k, suffix_v, impl=impl)

        def baseline() -> torch.Tensor:
            return F.scaled_dot_product_attention(q_t, k_full, v_full, **sdpa_kw)

        if device.startswith("cuda"):
            times, (o_h, o_b), modes = time_cuda([hydragen, baseline], trials, flush)
            row["timing"] = modes[0] if modes[0] == modes[1] else f"hydragen {modes[0]}; baseline {modes[1]}"
        else:
            times, (o_h, o_b) = time_cpu([hydragen, baseline], trials, target_s)
            row["timing"] = "cpu perf_counter"
    except Exception as e:
        if not _is_oom(e):
            raise
        row["status"] = f"skipped (out of memory: {type(e).__name__})"
        return row

    diff = (o_h.float() - o_b.transpose(1, 2).float()).abs().max().item()
    if not diff <= _tolerance(dtype):  # also catches NaN
        raise RuntimeError(
            f"hydragen and baseline disagree at {shape} B={batch} P={prefix} S={suffix}: "
            f"max |diff| = {diff:.3g} > {_tolerance(dtype):.1g} ({row['dtype']})"
        )
    t_h, t_b = (statistics.median(t) for t in times)
    moved = moved_bytes(batch, prefix, suffix, hq, hkv, d, elem)
    flops = attention_flops(batch, prefix, suffix, hq, d)
    row.update(
        hydragen_ms=1e3 * t_h,
        baseline_ms=1e3 * t_b,
        speedup=t_b / t_h,
        hydragen_bytes=moved["hydragen"],
        baseline_bytes=moved["baseline"],
        flops=flops,
        hydragen_gbps=moved["hydragen"] / t_h / 1e9,
        baseline_gbps=moved["baseline"] / t_b / 1e9,
        hydragen_gflops=flops / t_h / 1e9,
        baseline_gflops=flops / t_b / 1e9,
        hydragen_bw_frac=moved["hydragen"] / t_h / bandwidth,
        baseline_bw_frac=moved["baseline"] / t_b / bandwidth,
        hydragen_mm_frac=flops / t_h / rate,
        baseline_mm_frac=flops / t_b / rate,
        max_abs_diff=diff,
        hydragen_min_ms=1e3 * min(times[0]),
        baseline_min_ms=1e3 * min(times[1]),
        trials=len(times[0]),
        status="ok",
    )
    return row


# --------------------------------------------------------------------------------------------------
# The sweep, its table and plots
# --------------------------------------------------------------------------------------------------


def run(
    *,
    shapes: list[str] = ("paper", "gqa"),
    batch: list[int] = SWEEPS["cpu"]["batch"],
    prefix: list[int] = SWEEPS["cpu"]["prefix"],
    suffix: list[int] = SWEEPS["cpu"]["suffix"],
    suffix_sweep: list[int] = SWEEPS["cpu"]["suffix_sweep"],
    suffix_at: tuple[int, int] | None = SWEEPS["cpu"]["suffix_at"],
    device: str = "cpu",
    dtype: str | None = None,
    trials: int | None = None,
    target_s: float = 0.5,
    mem_budget: int | None = None,
    mem_fraction: float = 0.4,
    impl: str = "auto",
    bw_mib: int | None = None,
    mm_n: int | None = None,
    threads: int | None = None,
    out: Path = Path("bench-out"),
    quick: bool = False,
) -> list[dict]:
    """Run the sweep; write attention.{json,md} and the two speedup plots under ``out``; return the rows.

    ``trials``: the minimum on CPU (more for fast points, up to ``target_s``), the count on CUDA.
    ``mem_budget``: bytes the baseline's KV copy may take (default ``mem_fraction`` of free memory).
    ``bw_mib`` / ``mm_n``: sizes of the bandwidth and matmul calibrations (smaller = faster, rougher).
    ``threads``: torch intra-op threads for the run (restored after); default: leave torch's setting.
    """
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(
            shapes=shapes, batch=batch, prefix=prefix, suffix=suffix, suffix_sweep=suffix_sweep,
            suffix_at=suffix_at, device=device, dtype=dtype, trials=trials, target_s=target_s,
            mem_budget=mem_budget, mem_fraction=mem_fraction, impl=impl, bw_mib=bw_mib, mm_n=mm_n, out=out,
            quick=quick,
        )  # fmt: skip
    finally:
        torch.set_num_threads(saved_threads)


def _run(
    *,
    shapes: list[str],
    batch: list[int],
    prefix: list[int],
    suffix: list[int],
    suffix_sweep: list[int],
    suffix_at: tuple[int, int] | None,
    device: str,
    dtype: str | None,
    trials: int | None,
    target_s: float,
    mem_budget: int | None,
    mem_fraction: float,
    impl: str,
    bw_mib: int | None,
    mm_n: int | None,
    out: Path,
    quick: bool,
) -> list[dict]:
    cuda = device.startswith("cuda")
    if quick:
        say_quick("attention")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    tdtype = _DTYPES[dtype or ("bfloat16" if cuda else "float32")]
    trials = trials or (50 if cuda else 5)
    bw_mib = bw_mib or (1024 if cuda else 256)
    mm_n = mm_n or (8192 if cuda else 1024)
    out = Path(out)

    bandwidth = memory_bandwidth(bw_mib, device=device)
    rate = matmul_rate(mm_n, dtype=tdtype, device=device)
    budget = mem_budget if mem_budget is not None else default_budget(device, mem_fraction)
    gqa_native = _sdpa_has_gqa()
    where = torch.cuda.get_device_name(device) if cuda else machine_description()
    _log(
        f"{where}; {str(tdtype).removeprefix('torch.')}; copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"matmul {rate / 1e9:.1f} GFLOP/s; baseline KV budget {budget / 2**30:.2f} GiB"
    )
    flush = None
    if cuda:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
        flush = torch.empty(max(256 * 2**20, 4 * l2) // 4, dtype=torch.float32, device=device)

    points = sweep_points(batch, prefix, suffix, suffix_sweep, suffix_at)
    rows: list[dict] = []
    total = len(points) * len(shapes)
    t_start = time.perf_counter()
    for shape in shapes:
        for b, p, s in points:
            row = bench_point(
                shape, b, p, s, dtype=tdtype, device=device, budget=budget, bandwidth=bandwidth, rate=rate,
                gqa_native=gqa_native, trials=trials, target_s=target_s, impl=impl, flush=flush,
            )  # fmt: skip
            rows.append(row)
            head = f"[{len(rows)}/{total}] {shape:5s} B={b:<5d} P={p:<6d} S={s:<4d}"
            if row["status"] == "ok":
                _log(
                    f"{head} hydragen {row['hydragen_ms']:9.3f} ms  baseline {row['baseline_ms']:9.3f} ms  "
                    f"speedup {row['speedup']:6.2f}x  ({row['trials']} trials)"
                )
            else:
                _log(f"{head} {row['status']}")
            if cuda:
                torch.cuda.empty_cache()
    _log(f"done in {time.perf_counter() - t_start:.1f} s")

    skipped = [r for r in rows if r["status"] != "ok"]
    timing = sorted({r["timing"] for r in rows if "timing" in r})
    notes = [
        f"Device: {where}; dtype {str(tdtype).removeprefix('torch.')}; hydragen impl {impl!r}; "
        f"baseline: one batched SDPA over each sequence's own KV copy "
        f"({'enable_gqa' if gqa_native else 'KV heads expanded'}).",
        f"Measured copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write, {bw_mib} MiB); "
        f"matmul rate {rate / 1e9:.1f} GFLOP/s ({mm_n}^3, {str(tdtype).removeprefix('torch.')}). "
        "*_bw_frac and *_mm_frac are achieved bytes/s and FLOP/s over these.",
        "Bytes that must move: hydragen = prefix KV once + every suffix KV + q/out; baseline = every "
        "sequence's full KV + q/out. FLOPs = 4 * B * Hq * (P + S) * D for both.",
        f"Timing: {', '.join(timing) or 'n/a'}; "
        + (
            f"median of {trials} trials, L2 flushed ({flush.numel() * 4 // 2**20} MiB write) before each."
            if cuda
            else f"median of >= {trials} interleaved trials (up to ~{target_s} s per side per point); "
            "on a loaded CPU, multi-kernel hydragen suffers more from thread stalls than the one-call "
            "baseline (attention.json also keeps each side's fastest trial)."
        ),
        "Shapes: " + "; ".join(f"{s} Hq={SHAPES[s][0]} Hkv={SHAPES[s][1]} D={SHAPES[s][2]}" for s in shapes),
    ]
    if skipped:
        notes.append(
            f"{len(skipped)} point(s) skipped; OOM guard budget {budget / 2**30:.2f} GiB of baseline KV."
        )
    params = dict(
        plot_suffix=suffix[len(suffix) // 2] if suffix else 0,
        shapes=list(shapes),
        impl=impl,
        measured_on=where,
    )
    publish(
        rows,
        COLUMNS,
        out,
        RESULT_NAME,
        "Attention microbenchmark: shared-prefix (hydragen) vs per-sequence SDPA, decode (Nq = 1)",
        "\n\n".join(notes),
        quick=quick,
        quick_note=(
            "at these toy shapes (prefixes of 16-64 tokens, batches of 1-4) every call costs more in fixed "
            "overhead than in reading KV, so hydragen's speedups below 1 say nothing about real shapes: the "
            "shared read pays for long prefixes and large batches (the full run goes to 16K and 256)."
        ),
        plots=plots,
        params=params,
    )
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default float32 on CPU, bf16 on CUDA"
    )
    p.add_argument("--shapes", default="paper,gqa", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the test suite runs this)")
    p.add_argument(
        "--full",
        action="store_true",
        help="the paper's sweep: batch 1..1024, prefix 1K..16K, suffix 32..512 (hours on CPU)",
    )
    p.add_argument("--batch", type=_ints, default=None, help="batch sizes, e.g. 1,8,32")
    p.add_argument("--prefix", type=_ints, default=None, help="prefix lengths")
    p.add_argument("--suffix", type=_ints, default=None, help="suffix lengths of the batch x prefix grid")
    p.add_argument("--suffix-sweep", type=_ints, default=None, help="extra suffix lengths at --suffix-at")
    p.add_argument(
        "--suffix-at", type=_ints, default=None, metavar="B,P", help="(batch, prefix) of the sweep"
    )
    p.add_argument("--trials", type=int, default=None, help="min trials on CPU (5), trials on CUDA (50)")
    p.add_argument("--target-s", type=float, default=0.5, help="CPU: time per side per point to aim for")
    p.add_argument("--mem-budget-gb", type=float, default=None, help="max GiB of baseline KV per point")
    p.add_argument("--mem-fraction", type=float, default=0.4, help="default budget: this much of free memory")
    p.add_argument(
        "--impl", choices=("auto", "fused", "torch"), default="auto", help="hydragen partial kernel"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    if a.quick and a.full:
        p.error("--quick and --full are exclusive")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sweep = dict(
        SWEEPS["quick" if a.quick else "full" if a.full else "cuda" if device.startswith("cuda") else "cpu"]
    )
    for key in ("batch", "prefix", "suffix", "suffix_sweep"):
        if getattr(a, key) is not None:
            sweep[key] = getattr(a, key)
    if a.suffix_at is not None:
        if len(a.suffix_at) != 2:
            p.error("--suffix-at takes two numbers: B,P")
        sweep["suffix_at"] = tuple(a.suffix_at)
    quick = dict(bw_mib=16, mm_n=256, trials=a.trials or 2, target_s=0.02) if a.quick else {}
    run(
        shapes=[s for s in a.shapes.split(",") if s],
        device=device,
        dtype=a.dtype,
        trials=quick.pop("trials", a.trials),
        target_s=quick.pop("target_s", a.target_s),
        mem_budget=None if a.mem_budget_gb is None else int(a.mem_budget_gb * 2**30),
        mem_fraction=a.mem_fraction,
        impl=a.impl,
        threads=a.threads,
        out=a.out,
        quick=a.quick,
        **sweep,
        **quick,
    )


if __name__ == "__main__":
    main()
