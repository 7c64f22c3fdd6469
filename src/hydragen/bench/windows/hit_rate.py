"""Prefix-cache hit rate of a Gemma-like windowed model against the same model with every layer full, on a
shared-system-prompt chat workload, through the real engine (scheduler, KV manager, window-page release,
step loop) with a fake model, so it is cheap.

The fake model (built here from src parts, not the tests' ``fake_engine``): its next token is a fixed
function of the context, and its page pool (a real ``PagePool`` of one float a slot per row) stores each
slot's position in K and its token in V. Every forward first checks that each work item's context is
really there, in every KV group's pages, for the positions that group's layers read (a windowed group: the
last W positions; a full group: all), then writes the item's tokens in every group. A hit used with a hole
in a window, or an evicted page read, raises.

Workload (scaled down from a ~2K-token system prompt / 1,024-token window / 100-token reply): --requests
chat requests sharing a --system-token system prompt, each with its own user turn (--user-min..--user-max
tokens) and a --reply-token greedy reply, one arriving every --every steps. Models: --layers layers, every
--pattern-th full (Gemma 3: 5 windowed, 1 full), window --window tokens, page size 16; KV groups from
``window_groups``. The "full" model is the same with no window: one group. Both get the same KV bytes
(table pages x groups x rows is the same), at each --cache-pages.

Hit rate = the engine's cache_hit_tokens / prompt_tokens; the ceiling is every request hitting the whole
system prompt's full pages (the first request cannot). ``unreachable`` = ``kv.unreachable_pages()`` at
the end (cached pages no hit can use).

Usage:
  PYTHONPATH=src python -m hydragen.bench.windows.hit_rate [--cache-pages 1024 96 64 48] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from hydragen.attention.layer_spec import AttentionSpec
from hydragen.engine.config import EngineConfig
from hydragen.engine.engine import EngineCore
from hydragen.engine.sampling_params import SamplingParams
from hydragen.kv.layout import window_groups
from hydragen.kv.pool import PagePool

VOCAB, EOS, PAGE = 64, 0, 16


def next_token(context) -> int:
    return (context[-1] * 7 + (context[-2] if len(context) > 1 else 3) * 13 + len(context)) % (VOCAB - 1) + 1


class CheckedRunner:
    """The fake model: checks each item's reads in every KV group's pages, writes its tokens, returns
    logits whose argmax is ``next_token``."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.checked_reads = 0

    def pack(self, plan):
        return plan

    def step_raised(self) -> None:
        pass

    def sample(self, logits, seqs, top=None):
        return logits.argmax(-1), None, {}

    def forward(self, plan):
        pool, ps = self.pool, self.pool.page_size
        released = pool.layout.released
        rows = []
        for w in plan.work:
            t, context = w.seq.kv, w.seq.context
            if tuple(t.pages[: len(w.pages)]) != w.pages or t.computed != w.start:
                raise AssertionError(f"{w.seq.request.request_id}: its pages moved or its start is off")
            for g in range(pool.groups):
                pages = pool.in_group(w.pages, g)
                window = released.get(g)
                lowest = 0 if window is None else max(0, w.end - 1 - window + 1)
                for p in range(lowest, w.start):
                    slot = pages[p // ps] * ps + p % ps
                    if pages[p // ps] < 0 or (pool.k[0, slot, 0, 0].item(), pool.v[0, slot, 0, 0].item()) != (
                        p, context[p],
                    ):  # fmt: skip
                        raise AssertionError(f"{w.seq.request.request_id}: wrong key at {p} (group {g})")
                    self.checked_reads += 1
                slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(w.start, w.end)])
                pos = torch.arange(w.start, w.end, dtype=torch.float32).view(-1, 1, 1)
                tok = torch.tensor(w.tokens, dtype=torch.float32).view(-1, 1, 1)
                for row in range(pool.layout.rows):
                    pool.write(row, slots, pos, tok)
            if w.logit_rows:
                rows.append(next_token(list(context[: w.end])))
        if not rows:
            return None
        logits = torch.full((len(rows), VOCAB), -30.0)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 0.0
        return logits


class FakeModel:
    """EngineCore(parallel=...) hook: a real pool of one float a slot and the checked fake runner."""

    def make_pool(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout=None):
        return PagePool(num_layers, num_pages, page_size, 1, 1, torch.float32, "cpu", layout)

    def make_runner(self, model, cfg, pool, device, attention):
        return CheckedRunner(pool)


def make_engine(windowed: bool, pages: int, args) -> EngineCore:
    kinds = [(i + 1) % args.pattern != 0 for i in range(args.layers)]  # Gemma 3: every 6th layer full
    window = args.window if windowed else None
    specs = tuple(AttentionSpec(scale=1.0, window=window if k else None) for k in kinds)
    cfg = SimpleNamespace(
        num_layers=len(specs), layer_specs=specs, kv_groups=window_groups(kinds) if windowed else (),
        num_kv_heads=1, head_dim=1, vocab_size=VOCAB, max_position_embeddings=4096, eos_token_ids=[EOS],
    )  # fmt: skip
    config = EngineConfig(
        prefix_sharing=True, kv_cache_tokens=pages * PAGE, page_size=PAGE, prefill_chunk=args.chunk
    )
    return EngineCore(None, cfg, None, config, parallel=FakeModel())


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1, VOCAB) for _ in range(args.system)]
    return [
        system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(args.user_min, args.user_max))]
        for _ in range(args.requests)
    ]


def run(windowed: bool, pages: int, args) -> dict:
    engine = make_engine(windowed, pages, args)
    prompts = workload(args)
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    reqs, step, i = [], 0, 0
    while i < len(prompts) or engine.has_unfinished():
        if i < len(prompts) and step % args.every == 0:
            reqs.append(engine.add_request(prompts[i], params))
            i += 1
        engine.step()
        step += 1
        if step > 200_000:
            raise RuntimeError("the engine did not finish")
    for prompt, r in zip(prompts, reqs, strict=True):  # the fake model's output is known
        want, ctx = [], list(prompt)
        for _ in range(args.reply):
            want.append(next_token(ctx))
            ctx.append(want[-1])
        got = list(r.seqs[0].generated)
        if got != want:
            raise AssertionError(f"request {r.request_id}: wrong output")
    kv, st = engine.kv, engine.stats
    kv.check([])
    ceiling = (len(prompts) - 1) * (args.system // PAGE * PAGE) / st.prompt_tokens
    return {
        "model": "windowed (Gemma-like)" if windowed else "every layer full",
        "cache pages": pages,
        "KV groups": engine.pool.groups,
        "requests": len(prompts),
        "prompt tokens": st.prompt_tokens,
        "cache hit tokens": st.cache_hit_tokens,
        "hit rate": round(st.hit_rate, 3),
        "ceiling": round(ceiling, 3),
        "prefill tokens": st.prefill_tokens,
        "preemptions": st.preemptions,
        "unreachable pages": kv.unreachable_pages(),
        "reads checked": engine.runner.checked_reads,
    }


COLUMNS = [
    "model", "cache pages", "KV groups", "requests", "prompt tokens", "cache hit tokens", "hit rate",
    "ceiling", "prefill tokens", "preemptions", "unreachable pages", "reads checked",
]  # fmt: skip


def main() -> None:
    from hydragen.bench.core.common import write_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-pages", type=int, nargs="+", default=[1024, 96, 64, 48])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user-min", type=int, default=24)
    ap.add_argument("--user-max", type=int, default=96)
    ap.add_argument("--reply", type=int, default=100)
    ap.add_argument("--every", type=int, default=12, help="steps between arrivals")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--pattern", type=int, default=6, help="every pattern-th layer is full")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/results/windows"))
    args = ap.parse_args()
    rows = []
    for pages in args.cache_pages:
        for windowed in (True, False):
            rows.append(run(windowed, pages, args))
            print(rows[-1], flush=True)
    notes = (
        f"{args.requests} requests, a {args.system}-token shared system prompt, user turns of "
        f"{args.user_min}-{args.user_max} tokens, {args.reply}-token replies, one arrival every {args.every} "
        f"engine steps; {args.layers} layers, every {args.pattern}th full, window {args.window}, page "
        f"{PAGE}, prefill chunk {args.chunk}. Same KV bytes for both models at each cache size. Every "
        "read of every forward checked against the context; every output checked."
    )
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    md = write_table(
        rows, COLUMNS, args.out, "hit_rate", "Prefix-cache hit rate: windowed vs every layer full",
        notes, params=params,
    )  # fmt: skip
    print(md)


if __name__ == "__main__":
    main()
