"""Are seeded samples the same with 1 and 2 threads, and alone or batched? (the README's reproducibility note)

    python scripts/sample_repro.py [--prompts 16] [--n 4] [--max-tokens 24]

Samples chat prompts on the embedded model at temperature 0.8 / top_p 0.9 with fixed seeds: every prompt in
one batch and each prompt alone, with torch at 1 thread and at 2. Prints how many sampled sequences agree
with the 2-thread batched run, token for token.
"""

from __future__ import annotations

import argparse

import torch

from hydragen import LLM, SamplingParams

TOPICS = [
    "a friendly robot", "the sea", "a lighthouse", "autumn", "a library", "mountains", "a market", "rain",
    "a violin", "the moon", "a garden", "trains", "a bakery", "winter", "a river", "a clock",
]  # fmt: skip


def tokens(llm: LLM, convs, params, batched: bool) -> list[list[int]]:
    if batched:
        outs = llm.chat(convs, params, use_tqdm=False)
    else:
        outs = [llm.chat(c, params, use_tqdm=False)[0] for c in convs]
    return [c.token_ids for o in outs for c in o.outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    llm = LLM()
    convs = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in TOPICS[: args.prompts]]
    params = SamplingParams(n=args.n, temperature=0.8, top_p=0.9, max_tokens=args.max_tokens, seed=11)
    runs = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for batched in (True, False):
            llm.reset_prefix_cache()
            runs[(threads, batched)] = tokens(llm, convs, params, batched)
    ref = runs[(2, True)]
    for (threads, batched), toks in runs.items():
        same = sum(a == b for a, b in zip(toks, ref, strict=True))
        how = "batched" if batched else "one prompt at a time"
        print(
            f"{threads} thread(s), {how}: {same}/{len(ref)} sampled sequences identical to 2 threads batched"
        )


if __name__ == "__main__":
    main()
