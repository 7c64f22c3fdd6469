"""Sampler cost, old (full-vocabulary sort) vs new (candidate sets), on the embedded model's logits.

    PYTHONPATH=src python scripts/bench_sampler.py [--batches 1 8 64 256] [--rounds 3] [--repeats 5]
                                                   [--threads N]

Logits are the embedded model's next-token logits along its own temperature-1 samples from a few
prompts, so the distributions (and the candidate sets they give) are the ones generation meets. Each
(batch, setting, logprobs) cell is timed `repeats` times per round; the table shows the median over
rounds of the per-round medians, in milliseconds. With ``--threads 1`` the times are the thread's CPU
time, which other processes on a shared machine disturb far less than wall-clock time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from hydragen import LLM, SamplingParams
from hydragen.engine.sampler import Sampler, derive_seed

TEXTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived a baker who",
    "The difference between TCP and UDP is that TCP provides reliable, ordered delivery of a stream",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre, and its cafes, where",
    "In twilight's hush the sea lies still, a silver path beneath the moon; the waves recall",
    "To make a good cup of coffee, start with freshly ground beans and water just off the boil, then",
]
# (name, temperature, top_k, top_p, min_p)
SETTINGS = [
    ("T1.0", 1.0, 0, 1.0, 0.0),
    ("T0.7 p0.9", 0.7, 0, 0.9, 0.0),
    ("T1.0 p0.95", 1.0, 0, 0.95, 0.0),
    ("T0.8 k40 p0.95", 0.8, 40, 0.95, 0.0),
    ("T1.0 p0.95 mp0.05", 1.0, 0, 0.95, 0.05),
    ("T0.7 k40 p0.9 mp0.05", 0.7, 40, 0.9, 0.05),
]


def model_logits(new_tokens: int = 48) -> torch.Tensor:
    """The embedded model's next-token logits [rows, V] along its own samples (temperature 1) from the
    texts: the distributions a sampler meets in generation."""
    llm = LLM(kv_cache_tokens=8192)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    net = llm.model

    def attend(layer, q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)

    rows = []
    for out in outs:
        ids = torch.tensor(out.prompt_token_ids + out.outputs[0].token_ids)
        logits = net.logits(net(ids, torch.arange(len(ids)), attend))
        rows.append(logits[len(out.prompt_token_ids) - 1 : -1])  # the steps that sampled the output
    return torch.cat(rows)


def old_sampler(logits, temperature, top_k, top_p, min_p, bits):
    """The sampler this replaced: softmax, then a sort of the whole vocabulary for top_p. It had no
    min_p; here min_p is a full-size mask, which costs what adding it the plain way would cost."""
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[1]).clamp_max(logits.shape[1])
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), 0.0)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p.unsqueeze(1)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)
    total = cdf[:, -1]
    u = (bits.float() + 0.5) / 16777216.0
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


def old_logprobs(logits, tokens, n):
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1))
    return (chosen, logp.topk(n, dim=-1)) if n else (chosen,)


def _old(logits, temperature, top_k, top_p, min_p, bits, n):
    tokens = old_sampler(logits, temperature, top_k, top_p, min_p, bits)
    return old_logprobs(logits, tokens, n) if n is not None else tokens


def timed(fn, repeats: int, clock) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: report CPU time)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    pool = model_logits()
    kind = "thread CPU time" if clock is time.thread_time else "wall-clock time"
    print(f"logits: {pool.shape[0]} rows x {pool.shape[1]} tokens; {torch.get_num_threads()} threads, {kind}")
    sampler = Sampler()
    cells: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            logits = pool[torch.arange(batch) % pool.shape[0]].contiguous()
            seeds = torch.tensor([derive_seed(7, i) for i in range(batch)])
            steps = torch.zeros(batch, dtype=torch.long)
            bits = sampler.uniform_bits(seeds, steps)
            for name, t, k, p, mp in SETTINGS:
                rows = [torch.full((batch,), v) for v in (t, k, p, mp)]
                new_args = (logits, *rows[:3], seeds, steps, True, k > 0, p < 1, rows[3], mp > 0)
                for n in (None, 5):
                    old = functools.partial(_old, logits, *rows, bits, n)
                    new = functools.partial(sampler.sample, *new_args, num_logprobs=n)
                    for impl, fn in (("old", old), ("new", new)):
                        cells.setdefault((batch, name, n, impl), []).append(timed(fn, args.repeats, clock))
    print(f"{'B':>4} {'setting':<22} {'logprobs':>8} {'old ms':>9} {'new ms':>9} {'speedup':>8}")
    for batch in args.batches:
        for name, *_ in SETTINGS:
            for n in (None, 5):
                old = statistics.median(cells[(batch, name, n, "old")])
                new = statistics.median(cells[(batch, name, n, "new")])
                print(f"{batch:>4} {name:<22} {str(n or 0):>8} {old:9.2f} {new:9.2f} {old / new:7.1f}x")


if __name__ == "__main__":
    main()
