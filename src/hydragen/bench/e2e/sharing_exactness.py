"""hydragen bench exactness: how far apart are outputs with sharing on and off, alone and batched?

Shared-prefix attention is exact math, but floating-point addition is not associative: reading a prefix
through a batched call and merging by log-sum-exp rounds differently from reading it per sequence, and
batch composition changes which calls run. This measures what that does on a real model (default: the
embedded SmolLM2-135M, fp32): greedy decoding of many prompts (groups sharing a few-shot block), under

* ``on-batched``  sharing on, every prompt at once (cold cache)
* ``on-warm``     sharing on, the same prompts again (every prompt served from the prefix cache)
* ``on-alone``    sharing on, one prompt at a time on an empty cache
* ``off-batched`` sharing off, every prompt at once
* ``off-alone``   sharing off, one prompt at a time (the reference: nothing shared, nothing batched)

For each mode against the reference: the fraction of sequences whose greedy tokens are identical, and
the largest difference of any log-probability (chosen token and top alternatives) over the positions
where both runs fed identical tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from hydragen.bench.core.common import machine_description, write_table

TOPICS = ["rivers", "owls", "volcanoes", "bread", "trains", "glaciers", "bees", "comets", "tides", "maps"]
SHOTS = [
    ("What is a delta?", "A delta is land formed where a river deposits sediment as it meets the sea."),
    ("Why do owls hunt at night?", "Many owls are nocturnal: their eyes and hearing suit low light."),
    ("What makes bread rise?", "Yeast ferments sugars and releases carbon dioxide that lifts the dough."),
]


def make_prompts(n: int, seed: int) -> list[str]:
    """n prompts in groups: each group shares a few-shot block, each prompt asks its own question."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in SHOTS[: 1 + (i % len(TOPICS)) % len(SHOTS)])
        question = f"Q: Tell me fact number {rng.randrange(1, 99)} about {topic}.\nA:"
        prompts.append(f"You answer questions about {topic} in one sentence.\n\n{shots}{question}")
    return prompts


def run_mode(llm, prompts: list[str], mode: str, params) -> list[tuple[list[int], list[dict]]]:
    if mode.endswith("alone"):
        outs, t0 = [], time.perf_counter()
        for i, p in enumerate(prompts, 1):
            llm.reset_prefix_cache()
            outs += llm.generate([p], params, use_tqdm=False)
            if i % 16 == 0 or i == len(prompts):  # the alone modes are the long part: show the rate
                rate = i / (time.perf_counter() - t0)
                print(f"[exactness] {mode}: {i}/{len(prompts)} prompts, {rate:.2f}/s", file=sys.stderr)
    else:
        if mode != "on-warm":
            llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare(got, ref) -> tuple[float, float]:
    """(fraction of identical token sequences, max |logprob difference| while the inputs agreed)."""
    same, worst = 0, 0.0
    for (toks, lps), (rtoks, rlps) in zip(got, ref, strict=True):
        same += toks == rtoks
        for t, rt, lp, rlp in zip(toks, rtoks, lps, rlps, strict=False):
            common = lp.keys() & rlp.keys()
            worst = max(worst, max((abs(lp[k] - rlp[k]) for k in common), default=0.0))
            if t != rt:
                break  # later positions were fed different tokens
    return same / len(ref), worst


def run(model, num_prompts: int, new_tokens: int, out: Path, seed: int, batch: int) -> list[dict]:
    from hydragen import LLM, SamplingParams

    prompts = make_prompts(num_prompts, seed)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=5, ignore_eos=True)
    results: dict[str, list] = {}
    llms = {
        "on": LLM(model, prefix_sharing=True, max_num_seqs=batch),
        "off": LLM(model, prefix_sharing=False, max_num_seqs=batch),
    }
    print(
        f"[exactness] {machine_description()}; {num_prompts} prompts x {new_tokens} tokens", file=sys.stderr
    )
    for mode in ("off-alone", "off-batched", "on-alone", "on-batched", "on-warm"):
        t0 = time.perf_counter()
        results[mode] = run_mode(llms[mode.split("-")[0]], prompts, mode, params)
        print(f"[exactness] {mode:12s} {time.perf_counter() - t0:6.1f} s", file=sys.stderr)
    rows = []
    for mode, got in results.items():
        same, worst = compare(got, results["off-alone"])
        rows.append(
            dict(mode=mode, prompts=num_prompts, tokens=new_tokens, identical=same, max_logprob_diff=worst)
        )
    notes = (
        "Reference: off-alone (sharing off, one prompt at a time). identical: fraction of sequences with the "
        "same greedy tokens; max_logprob_diff: largest |difference| of any returned log-probability (chosen "
        f"token + top 5) at positions fed identical inputs. Batch size {batch}."
    )
    md = write_table(
        rows,
        ["mode", "prompts", "tokens", "identical", "max_logprob_diff"],
        out,
        "exactness",
        "Exactness: sharing on/off, alone/batched, cold/warm",
        notes,
    )
    print(md)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench exactness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint (default: embedded model)")
    p.add_argument("--prompts", type=int, default=128, help="number of prompts (default 128)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--batch", type=int, default=64, help="sequences decoded at once (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a result")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.tokens = 6, 4
    run(a.model, a.prompts, a.tokens, a.out, a.seed, a.batch)


if __name__ == "__main__":
    main()
