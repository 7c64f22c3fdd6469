"""Where the tile kernel starts to beat the op's own loop: the numbers behind step_work.TILE_MIN_ROWS/KEYS.

One shared node of K keys over T decode tokens (each with a one-key private tail), the embedded model's heads
(Hq 9, Hkv 3, D 64, fp32), as a decode step with a shared prompt calls it. Each cell times step attention per
layer call with every piece through the own loop, then through the tile kernel, over enough layers cycled that
the keys come from memory. Rows per tile piece are T x g (g = 3 here). Usage:
  PYTHONPATH=src python scripts/bench_tile_threshold.py [--threads 1] [--tokens 2,4,8,16,32,64]
                                                       [--keys 16,32,64,128,256,512,2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from hydragen.attention import step_work
from hydragen.attention.step_attention import StepAttentionMeta, step_attention

HQ, HKV, D = 9, 3, 64
LAYERS = 24


def per_call(tokens: int, keys: int, tile: bool, repeats: int = 5) -> float:
    step_work.TILE_MIN_ROWS, step_work.TILE_MIN_KEYS = (0, 0) if tile else (-1, 0)
    slots = keys + tokens + 64
    units = [(0, keys, 0, tokens, 0)]
    segments = [(t, t + 1, [(keys + t, keys + t + 1)], 1) for t in range(tokens)]
    meta = StepAttentionMeta.build(units, segments, tokens, "cpu")
    ks = [torch.randn(slots, HKV, D) for _ in range(LAYERS)]
    vs = [torch.randn(slots, HKV, D) for _ in range(LAYERS)]
    q = torch.randn(tokens, HQ, D)

    def run() -> None:
        for k, v in zip(ks, vs, strict=True):
            step_attention(q, k, v, meta, D**-0.5, impl="cpp")

    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - t0) / LAYERS)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="2,4,8,16,32,64")
    p.add_argument("--keys", default="16,32,64,128,256,512,2048")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print("| tokens | rows per KV head | keys | own loop, us | tile kernel, us | own / tile |")
    print("|---|---|---|---|---|---|")
    for t in map(int, a.tokens.split(",")):
        for k in map(int, a.keys.split(",")):
            own, tile = per_call(t, k, False), per_call(t, k, True)
            cells = (t, t * HQ // HKV, k, f"{own * 1e6:.1f}", f"{tile * 1e6:.1f}", f"{own / tile:.2f}")
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
