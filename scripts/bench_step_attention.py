"""Per-layer time of step attention (one call for the whole step) vs the per-item paths it replaces.

Shapes of the embedded model (Hq 9, Hkv 3, D 64, fp32), 16-token pages handed out consecutively or shuffled.
Cases (see the kernel brief of issue 11):
  a  sharing off: 64 sequences, each a private 2,080-token KV   vs suffix_attention over a [64, 2080] block
  b  64 sequences share one 2,048-token node + 64-token tails   vs suffix + level attention + merge
  c  a wide tree: one 1,024-token node over all 64 rows, 36 nodes of 100-300 tokens over 1-4 rows, tails
                                                                 vs the per-item loop (DecodeBatch.attention)
  d  prefill: 64 chunks of 16 tokens under one cached 1,024-token ancestor
                                                                 vs 64 shared_prefix_attention calls
Old and new calls alternate, so background load hits both alike; medians of --repeats. Usage:
  PYTHONPATH=src python scripts/bench_step_attention.py [--repeats 15] [--cases abcd] [--threads 2] [--cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hydragen.attention.merge import merge_into
from hydragen.attention.shared_prefix import level_attention, shared_prefix_attention, suffix_attention
from hydragen.attention.step_attention import StepAttentionMeta, step_attention

HQ, HKV, D, PAGE = 9, 3, 64, 16
SCALE = D**-0.5


class Pool:
    """A KV pool layer [pages * PAGE, Hkv, D] and a page allocator (consecutive or shuffled order)."""

    def __init__(self, tokens: int, shuffled: bool, gen: torch.Generator):
        pages = -(-tokens // PAGE) + 64  # every allocation starts on a fresh page
        self.k = torch.randn(pages * PAGE, HKV, D, generator=gen)
        self.v = torch.randn(pages * PAGE, HKV, D, generator=gen)
        order = torch.randperm(pages, generator=gen) if shuffled else torch.arange(pages)
        self.free = order.tolist()[::-1]

    def runs(self, n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while n > 0:
            lo = self.free.pop() * PAGE
            take = min(n, PAGE)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], lo + take)
            else:
                out.append((lo, lo + take))
            n -= take
        return out


def units_over(runs, tok_lo, tok_hi):
    return [(a, b, tok_lo, tok_hi, 0) for a, b in runs]


def timeit(fns: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def case_a(shuffled, gen):
    b, n = 64, 2080
    pool = Pool(b * n, shuffled, gen)
    segs = [(i, i + 1, pool.runs(n), n) for i in range(b)]
    q = torch.randn(b, HQ, D, generator=gen)
    block_k = torch.randn(b, n, HKV, D, generator=gen)
    block_v = torch.randn(b, n, HKV, D, generator=gen)
    old = lambda: suffix_attention(q.unsqueeze(1), block_k, block_v, None, SCALE)
    return pool, q, [], segs, {"old": old}


def tails(pool, rows, lengths):
    return [(i, i + 1, pool.runs(lengths[i]), lengths[i]) for i in range(rows)]


def old_decode(q, tail_k, tail_v, items):
    """DecodeBatch.attention's CPU path: one batched tail partial, then one level partial per item."""
    out, lse = suffix_attention(q.unsqueeze(1), tail_k, tail_v, None, SCALE)
    acc, acc_lse = out[:, 0].float(), lse[:, 0].contiguous()
    for k, v, i, j in items:
        o, lo = level_attention(q[i:j].unsqueeze(1), k.unsqueeze(0), v.unsqueeze(0), SCALE)
        merge_into(acc[i:j], acc_lse[i:j], o[:, 0], lo[:, 0])
    return acc


def case_b(shuffled, gen):
    b, shared, tail = 64, 2048, 64
    pool = Pool(shared + b * tail, shuffled, gen)
    node = pool.runs(shared)
    segs = tails(pool, b, [tail] * b)
    q = torch.randn(b, HQ, D, generator=gen)
    tk, tv = torch.randn(b, tail, HKV, D, generator=gen), torch.randn(b, tail, HKV, D, generator=gen)
    nk, nv = torch.randn(shared, HKV, D, generator=gen), torch.randn(shared, HKV, D, generator=gen)
    old = lambda: old_decode(q, tk, tv, [(nk, nv, 0, b)])
    return pool, q, units_over(node, 0, b), segs, {"old": old}


def case_c(shuffled, gen):
    b, tail = 64, 64
    sizes = torch.randint(100, 301, (36,), generator=gen).tolist()
    widths = torch.randint(1, 5, (36,), generator=gen).tolist()
    pool = Pool(1024 + sum(sizes) + b * tail, shuffled, gen)
    units = units_over(pool.runs(1024), 0, b)
    items = [(torch.randn(1024, HKV, D), torch.randn(1024, HKV, D), 0, b)]
    row = 0
    for size, width in zip(sizes, widths, strict=True):
        lo, hi = row % b, min(row % b + width, b)
        units += units_over(pool.runs(size), lo, hi)
        items.append((torch.randn(size, HKV, D), torch.randn(size, HKV, D), lo, hi))
        row += width
    segs = tails(pool, b, [tail] * b)
    q = torch.randn(b, HQ, D, generator=gen)
    tk, tv = torch.randn(b, tail, HKV, D, generator=gen), torch.randn(b, tail, HKV, D, generator=gen)
    return pool, q, units, segs, {"old": lambda: old_decode(q, tk, tv, items)}


def case_d(shuffled, gen, one_unit: bool):
    chunks, n, anc = 64, 16, 1024
    pool = Pool(anc + chunks * n, shuffled, gen)
    ancestor = pool.runs(anc)
    segs, units = [], []
    for c in range(chunks):
        segs.append((c * n, (c + 1) * n, pool.runs(n), 1))
        if not one_unit:
            units += units_over(ancestor, c * n, (c + 1) * n)
    if one_unit:
        units = units_over(ancestor, 0, chunks * n)
    q = torch.randn(chunks * n, HQ, D, generator=gen)
    ak, av = torch.randn(1, anc, HKV, D, generator=gen), torch.randn(1, anc, HKV, D, generator=gen)
    own_k, own_v = torch.randn(chunks, 1, n, HKV, D), torch.randn(chunks, 1, n, HKV, D)

    def old():
        for c in range(chunks):
            shared_prefix_attention(q[c * n : (c + 1) * n].unsqueeze(0), [ak], [av], own_k[c], own_v[c])

    return pool, q, units, segs, {"old": old}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cases", default="abcd")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--impls", default="cpp,torch", help="step_attention impls to time (comma-separated)")
    ap.add_argument("--cpu", action="store_true", help="process CPU time, not wall (steadier on a busy box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builders = {
        "a": case_a,
        "b": case_b,
        "c": case_c,
        "d (64 units)": lambda s, g: case_d(s, g, one_unit=False),
        "d (1 unit)": lambda s, g: case_d(s, g, one_unit=True),
    }
    clock = time.process_time if args.cpu else time.perf_counter
    what = "CPU" if args.cpu else "wall"
    print(f"threads {args.threads}, repeats {args.repeats}; per-layer {what} ms (median)")
    impls = args.impls.split(",")
    cols = ["old", *impls, "build"]
    head = f"{'case':14} {'pages':10} {'units':>5} {'runs':>5} {'pieces':>6} "
    print(head + " ".join(f"{c:>8}" for c in cols))
    for name, make in builders.items():
        if name[0] not in args.cases:
            continue
        for shuffled in (False, True):
            gen = torch.Generator().manual_seed(0)
            pool, q, units, segs, fns = make(shuffled, gen)
            t0 = time.perf_counter()
            meta = StepAttentionMeta.build(units, segs, q.shape[0], "cpu")
            build_ms = (time.perf_counter() - t0) * 1e3
            for impl in impls:
                fns[impl] = lambda m=meta, q=q, p=pool, i=impl: step_attention(q, p.k, p.v, m, SCALE, impl=i)
            ms = timeit(fns, args.repeats, clock)
            label = "shuffled" if shuffled else "consec."
            print(
                f"{name:14} {label:10} {meta.units.shape[0]:5d} {meta.runs.shape[0]:5d} "
                f"{meta.pieces.shape[0]:6d} "
                + " ".join(f"{ms[c]:8.2f}" for c in cols[:-1])
                + f" {build_ms:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
