"""A sliding layer's decode step attention against a full layer's, at 8K context: the cost follows the window.

The C++ step-attention op on one decode step packed as the engine packs it (``engine/packing.pack`` with the
layer's ``AttentionSpec``), shapes of the embedded model (Hq 9, Hkv 3, D 64, float32 KV, 16-token pages
handed out consecutively). Two steps:

  private  4 sequences, each decoding at the last position of its own context (no sharing)
  shared   4 sequences under one shared run (read by one unit) of all but their last 128 positions,
           each with a 128-token tail

At --contexts (default 8,192) each is timed full, and with windows of 1,024 and 256, at 1 and 2 threads.
The windows alternate within each round (--inner calls each), so background load hits them alike. Every
call is timed alone; the table gives the median and the minimum of the --repeats x --inner calls (on a
shared 2-core machine a call whose threads lose the CPU takes a scheduler's time slice: the minimum shows
the kernel, the median the machine).
Usage:
  PYTHONPATH=src python scripts/bench_window.py [--repeats 15] [--inner 20] [--threads 1 2] [--contexts 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hydragen.attention.layer_spec import AttentionSpec, LayerSpecs
from hydragen.attention.step_attention import step_attention
from hydragen.engine.packing import pack
from hydragen.engine.step_plan import SharedRun, StepPlan, Work

HQ, HKV, D, PAGE = 9, 3, 64, 16
SCALE = D**-0.5


def private_step(context: int) -> tuple[StepPlan, int]:
    pages = context // PAGE
    work = [Work(None, tuple(range(i * pages, (i + 1) * pages)), context - 1, (1,), 1) for i in range(4)]
    return StepPlan(tuple(work)), 4 * pages * PAGE


def shared_step(context: int) -> tuple[StepPlan, int]:
    shared, tail = (context - 128) // PAGE, 128 // PAGE
    work = []
    for i in range(4):
        own = range(shared + i * tail, shared + (i + 1) * tail)
        work.append(Work(None, (*range(shared), *own), context - 1, (1,), 1))
    plan = StepPlan(tuple(work), (), (SharedRun(0, shared, 0, 4),), (shared,) * 4)
    return plan, (shared + 4 * tail) * PAGE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    windows = [None, 1024, 256]
    print(f"C++ step attention, a decode step of 4 tokens at a context's end, Hq {HQ} Hkv {HKV} D {D}")
    heads = " ".join(f"{'W=' + str(w) if w else 'full':>13s}" for w in windows)
    print("ms a call, median/min")
    print(f"{'step':8s} {'context':>7s} {'threads':>7s} {heads}")
    for name, build, context in [
        (n, b, c) for c in args.contexts for n, b in (("private", private_step), ("shared", shared_step))
    ]:
        plan, slots = build(context)
        k = torch.randn(slots, HKV, D, generator=gen)
        v = torch.randn(slots, HKV, D, generator=gen)
        q = torch.randn(len(plan.work), HQ, D, generator=gen)
        for threads in args.threads:
            torch.set_num_threads(threads)
            metas = {}  # packed under this thread count: small steps cut key chunks per thread
            for w in windows:
                batch, _ = pack(plan, PAGE, "cpu", LayerSpecs.per_layer([AttentionSpec(SCALE, window=w)]))
                metas[w] = batch.meta
            times: dict = {w: [] for w in windows}
            for w in windows:
                step_attention(q, k, v, metas[w], SCALE, impl="cpp")  # warm
            for _ in range(args.repeats):
                for w in windows:
                    for _ in range(args.inner):
                        t0 = time.perf_counter()
                        step_attention(q, k, v, metas[w], SCALE, impl="cpp")
                        times[w].append(time.perf_counter() - t0)
            cells = " ".join(
                f"{statistics.median(times[w]) * 1e3:7.3f}/{min(times[w]) * 1e3:.3f}" for w in windows
            )
            print(f"{name:8s} {context:7d} {threads:7d} {cells}")


if __name__ == "__main__":
    main()
