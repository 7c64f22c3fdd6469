"""Timing of ``bench attention``'s two sides at one point, interleaved so background load hits both alike:
perf_counter on CPU; on CUDA each side in a CUDA graph (eager if capture fails), L2 flushed before every
trial, CUDA events."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch


def time_cpu(
    fns: list[Callable[[], torch.Tensor]], min_trials: int, target_s: float, max_trials: int = 50
) -> tuple[list[list[float]], list[torch.Tensor]]:
    """Seconds of every trial per fn; trials interleaved across fns so background load hits every side alike.

    Two untimed calls warm up (the second sizes the trial count: enough for ``target_s`` of the slowest
    side, at least ``min_trials``). Returns (per-fn trial times, each fn's last output).
    """
    outs = [fn() for fn in fns]
    probe = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        probe.append(time.perf_counter() - t0)
    trials = max(min_trials, min(max_trials, int(target_s / max(max(probe), 1e-6))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(trials):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return times, outs


def _cuda_graph(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], str]:
    """Capture fn in a CUDA graph (so launch overhead is not timed); fall back to eager if capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # any capture failure means "time it eagerly"
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return fn, f"eager (graph capture failed: {type(e).__name__}: {str(e)[:80]})"

    def replay() -> torch.Tensor:
        graph.replay()
        return static_out

    return replay, "cuda graph"


def time_cuda(
    fns: list[Callable[[], torch.Tensor]], trials: int, flush: torch.Tensor
) -> tuple[list[list[float]], list[torch.Tensor], list[str]]:
    """Seconds of every trial per fn: CUDA graphs, L2 flushed before every trial, CUDA events, interleaved.

    Returns (per-fn trial times, each side's output from its timed runner, each side's timing mode).
    """
    runners, modes = zip(*(_cuda_graph(fn) for fn in fns), strict=True)
    for r in runners:
        r()
    starts = [[torch.cuda.Event(enable_timing=True) for _ in range(trials)] for _ in fns]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(trials)] for _ in fns]
    outs = [None] * len(fns)
    torch.cuda.synchronize()
    for t in range(trials):
        for i, r in enumerate(runners):
            flush.zero_()  # evict the previous trial's KV from L2: every trial reads from HBM
            starts[i][t].record()
            outs[i] = r()
            ends[i][t].record()
    torch.cuda.synchronize()
    times = [
        [s.elapsed_time(e) / 1e3 for s, e in zip(ss, es, strict=True)]
        for ss, es in zip(starts, ends, strict=True)
    ]
    return times, outs, list(modes)
