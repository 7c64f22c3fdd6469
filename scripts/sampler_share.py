"""The sampler's share of a decode step in the engine: plain sampling against temperature 0.8 / top_p 0.95.

One prompt of P random token ids (flat next-token distributions: the hard case for top_p), n samples of T
tokens, ``ignore_eos``; the model runner's ``_sample_batch`` and ``forward`` are timed by wrapping them, and
the medians over the decode steps are printed per round.

    PYTHONPATH=src python scripts/sampler_share.py --prompt-len 512 --n 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hydragen import LLM, SamplingParams

SAMPLINGS = {"temperature 1": {}, "T 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95}}


def timed(obj, name: str, into: list[float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(kv_cache_tokens=args.prompt_len + args.n * (args.new_tokens + 16) + 4096)
    sample_s: list[float] = []
    forward_s: list[float] = []
    timed(llm.engine.runner, "_sample_batch", sample_s)
    timed(llm.engine.runner, "forward", forward_s)
    rng = random.Random(0)
    prompt = [rng.randrange(100, llm.config.vocab_size) for _ in range(args.prompt_len)]
    print(f"P={args.prompt_len} n={args.n} T={args.new_tokens}, {args.threads} threads; medians over decode")
    for r in range(args.rounds):
        for name, sampling in SAMPLINGS.items():
            llm.reset_prefix_cache()
            sample_s.clear()
            forward_s.clear()
            params = SamplingParams(n=args.n, max_tokens=args.new_tokens, ignore_eos=True, seed=0, **sampling)
            llm.generate([prompt], params, use_tqdm=False)
            sample, forward = (
                statistics.median(sample_s[1:]),
                statistics.median(forward_s[1:]),
            )  # [0]: prefill
            share = sample / (sample + forward)
            print(
                f"round {r + 1} {name:18s} sampler {sample * 1e3:6.1f} ms  forward {forward * 1e3:6.1f} ms  "
                f"share {share:6.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
