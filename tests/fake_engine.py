"""An engine with the real scheduler, KV manager, output processor and step loop, and a fake model.

The fake model's next token depends only on the context (``next_token``), so every output is known in
advance and exact whatever the batching, preemption or eviction. Its page pool keeps, instead of K/V
tensors, which (position, token) each slot holds; every forward first checks that each work item's
context is really there, in the pages the plan names, before "writing" the item's own tokens. A plan
that refers to an evicted, moved or never-computed page fails that check.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hydragen.engine.engine import Engine
from hydragen.engine.step_plan import StepPlan
from hydragen.kv.pool import PagePool

VOCAB = 48
EOS = 0


def next_token(context: list[int]) -> int:
    """The fake model's greedy choice: a fixed function of the last tokens and the length."""
    return (context[-1] * 7 + (context[-2] if len(context) > 1 else 3) * 13 + len(context)) % VOCAB


class PlanViolation(AssertionError):
    pass


class FakePool(PagePool):
    """A page pool whose slots remember the (position, token) written there, instead of K/V."""

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        super().__init__(1, num_pages, page_size, 1, 1, torch.float32, "cpu")  # tensors of one float a slot
        self.content: list[tuple[int, int] | None] = [None] * (num_pages * page_size)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            self.content[d] = self.content[s]


class FakeRunner:
    """Checks every plan against the pool at forward time, then fills the slots it computes."""

    def __init__(self, pool: FakePool):
        self.pool = pool
        self.fail_requests: set[str] = set()  # forwards that include these requests raise
        self.forwards = 0
        self.violations: list[str] = []  # kept even when the engine treats the raise as a failed forward

    def pack(self, plan: StepPlan) -> StepPlan:
        return plan

    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        try:
            return self._forward(plan)
        except PlanViolation as e:
            self.violations.append(str(e))
            raise

    def _forward(self, plan: StepPlan) -> torch.Tensor | None:
        self.forwards += 1
        pool, ps = self.pool, self.pool.page_size
        bad = [w for w in plan.work if w.seq.request.request_id in self.fail_requests]
        if bad:
            raise RuntimeError(f"injected forward failure for request {bad[0].seq.request.request_id}")
        written = set()
        for w in plan.work:
            t = w.seq.kv
            if tuple(t.pages[: len(w.pages)]) != w.pages:
                raise PlanViolation(f"seq {w.seq.request.request_id}/{w.seq.index}: its pages moved")
            if t.computed != w.start:
                raise PlanViolation(
                    f"seq {w.seq.request.request_id}: computed {t.computed} != start {w.start}"
                )
            for p in w.pages:
                if pool.refs[p] <= 0:
                    raise PlanViolation(f"page {p} in a plan is held by nobody (freed or evicted)")
            context = w.seq.context
            for p in range(w.start):
                slot = w.pages[p // ps] * ps + p % ps
                if pool.content[slot] != (p, context[p]):
                    raise PlanViolation(
                        f"seq {w.seq.request.request_id}/{w.seq.index} reads position {p} from slot {slot}, "
                        f"which holds {pool.content[slot]} instead of {(p, context[p])}"
                    )
            for p in range(w.start, w.end):
                slot = w.pages[p // ps] * ps + p % ps
                if slot in written:
                    raise PlanViolation(f"two work items write slot {slot} in one step")
                written.add(slot)
                pool.content[slot] = (p, w.tokens[p - w.start])
        rows = [w for w in plan.work if w.sample]
        if not rows:
            return None
        logits = torch.full((len(rows), VOCAB), -30.0)
        for i, w in enumerate(rows):
            logits[i, next_token(list(w.seq.context[: w.end]))] = 0.0
        return logits

    def sample(self, logits: torch.Tensor, seqs, top=None):
        return logits.argmax(-1), None, {}


class FakeParallel:
    """Engine(parallel=...) hook: the fake pool and runner instead of real ones."""

    def make_pool(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        return FakePool(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)

    def make_runner(self, model, cfg, pool, device, attention):
        return FakeRunner(pool)


def fake_engine(pages: int, page_size: int, *, sharing: bool = True, context: int = 256, **options) -> Engine:
    cfg = SimpleNamespace(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        vocab_size=VOCAB,
        max_position_embeddings=context,
        eos_token_ids=[EOS],
    )
    return Engine(
        None,
        cfg,
        None,
        "cpu",
        torch.float32,
        prefix_sharing=sharing,
        kv_cache_tokens=pages * page_size,
        page_size=page_size,
        parallel=FakeParallel(),
        **options,
    )


def expected_output(
    prompt: list[int], forced: dict[int, list[int]], max_tokens: int, ignore_eos: bool
) -> list[int]:
    """The tokens a sequence must produce: greedy next_token, with ``forced[i]`` appended after i tokens."""
    out: list[int] = []
    while len(out) < max_tokens:
        if len(out) in forced:
            out += forced[len(out)]
            continue
        t = next_token(prompt + out)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def all_tables(engine: Engine) -> list:
    return [s.kv for s in engine.scheduler.running]
