"""An engine with the real scheduler, KV manager, output processor and step loop, and a fake model.

The fake model's next token depends only on the context (``next_token``), so every output is known in
advance and exact whatever the batching, preemption or eviction. Its page pool keeps, instead of K/V
tensors, which (position, token) each slot holds; every forward first checks that each work item's
context is really there, in the pages the plan names, before "writing" the item's own tokens. A plan
that refers to an evicted, moved or never-computed page fails that check. It also packs the plan with the
real packing and checks what the step's attention would read: every token sees exactly the slots of its
own context, each once, through the shared runs and cuts the plan chose, at its own position. A draft
tree's token (``Work.parents``) sees the context and its ancestors only, sits at start + its depth, and
its slot remembers that position: read as the context position of its slot, it fails the check unless it
lies on the leading chain (depth = index). Its model may declare several layers with their attention specs
(``layer_specs``) in several KV groups (``kv_groups``): the plan is then packed with them, every group's
pages are checked and written as the table's are, and every layer's metadata is checked the same way in
its group's pages; a sliding layer's (``AttentionSpec.window`` W) to read exactly the keys of its token's
context at positions (p - W, p].

Faults can be injected: forwards that fail for given requests, a fork's KV copy that fails, a step that
raises before its commit (Ctrl-C, or every request of the step failing alone).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hydragen.attention.layer_spec import LayerSpecs, model_layer_specs
from hydragen.engine.config import EngineConfig
from hydragen.engine.engine import EngineCore
from hydragen.engine.packing import pack
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

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout=None):
        # tensors of one float a slot
        super().__init__(num_layers, num_pages, page_size, 1, 1, torch.float32, "cpu", layout)
        self.content: list[tuple[int, int] | None] = [None] * (len(self.refs) * page_size)
        self.fail_copies = 0  # the next that many copies (a fork taking its leader's partial page) raise
        self.failed_copies = 0

    def copy_physical(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.fail_copies:
            self.fail_copies -= 1
            self.failed_copies += 1
            raise RuntimeError("injected copy failure")
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            self.content[d] = self.content[s]


class FakeRunner:
    """Checks every plan against the pool at forward time, then fills the slots it computes."""

    def __init__(self, pool: FakePool, specs: LayerSpecs | None = None):
        self.pool = pool
        self.specs = specs
        self.fail_requests: set[str] = set()  # forwards that include these requests raise
        self.raise_next: str | None = None  # "interrupt": the next forward raises KeyboardInterrupt;
        # "every request": every forward raises until the engine's step has raised (``step_raised``)
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

    def step_raised(self) -> None:
        """The engine's step raised: an injected step failure is over."""
        self.raise_next = None

    def _forward(self, plan: StepPlan) -> torch.Tensor | None:
        self.forwards += 1
        pool, ps = self.pool, self.pool.page_size
        if self.raise_next == "interrupt":
            self.raise_next = None
            raise KeyboardInterrupt
        if self.raise_next == "every request":
            raise RuntimeError("injected step failure")
        bad = [w for w in plan.work if w.seq.request.request_id in self.fail_requests]
        if bad:
            raise RuntimeError(f"injected forward failure for request {bad[0].seq.request.request_id}")
        check_shared_runs(plan, ps)
        groups = range(pool.groups)
        check_reads(plan, ps, self.specs, pool.in_group)
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
            released = pool.layout.released
            for g in groups:  # each KV group's pages hold the context, as the table's do (a sliding one's:
                pages = pool.in_group(w.pages, g)  # from the first page its window reads)
                window = released.get(g)
                lowest = 0 if window is None else max(0, (w.start - window + 1) // ps) * ps
                for p in range(lowest, w.start):
                    slot = pages[p // ps] * ps + p % ps
                    if pool.content[slot] != (p, context[p]):
                        raise PlanViolation(
                            f"seq {w.seq.request.request_id}/{w.seq.index} reads position {p} from slot "
                            f"{slot} (KV group {g}), which holds {pool.content[slot]}, not {(p, context[p])}"
                        )
            positions = work_positions(w)
            for g in groups:
                pages = pool.in_group(w.pages, g)
                for p in range(w.start, w.end):
                    slot = pages[p // ps] * ps + p % ps
                    if slot in written:
                        raise PlanViolation(f"two work items write slot {slot} in one step")
                    written.add(slot)
                    pool.content[slot] = (positions[p - w.start], w.tokens[p - w.start])
        rows = [(w, j) for w in plan.work for j in range(len(w.tokens) - w.logit_rows, len(w.tokens))]
        if not rows:
            return None
        logits = torch.full((len(rows), VOCAB), -30.0)
        for i, (w, j) in enumerate(rows):  # each item's last logit_rows tokens, in order
            path = [w.tokens[a] for a in lineage(w, j)]
            logits[i, next_token(list(w.seq.context[: w.start]) + path)] = 0.0
        return logits

    def sample(self, logits: torch.Tensor, seqs, top=None, offsets=None):
        return logits.argmax(-1), None, {}

    def step_seconds(self, rows: int) -> float:
        """The fake model's step cost for the speculative cost rule (tests replace it)."""
        return 1.0 + 0.01 * rows

    def time_rows(self, rows: int, repeats: int = 1) -> float:
        return self.step_seconds(rows)


class ScriptedProposer:
    """Drafts for the fake model (stands for the speculator's n-gram proposer): its true greedy continuation,
    made wrong from a position that ``wrong_from(seq, k)`` picks (k: all right), so verification accepts
    exactly a known prefix of them."""

    def __init__(self, wrong_from=lambda seq, k: k):
        self.wrong_from = wrong_from
        self.proposed = 0

    def propose(self, seqs, limits, siblings=False):
        rows = []
        for s, k in zip(seqs, limits, strict=True):
            context, drafts = list(s.context), []
            for _ in range(max(k, 0)):
                drafts.append(next_token(context))
                context.append(drafts[-1])
            bad = self.wrong_from(s, len(drafts))
            rows.append(drafts[:bad] + [(t + 1) % VOCAB for t in drafts[bad:]])
        self.proposed += sum(map(len, rows))
        width = max(map(len, rows), default=0)
        table = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table, [len(r) for r in rows]

    def forget(self, seq_ids) -> None:
        pass


def check_shared_runs(plan: StepPlan, page_size: int) -> None:
    """The plan's shared runs name pages that every item of their range holds, at the same place, and that
    hold only context computed before this step; each item's cut is exactly the pages its runs cover."""
    covered: list[list[tuple[int, int]]] = [[] for _ in plan.work]
    for r in plan.shared:
        if not (0 <= r.lo < r.hi <= len(plan.work) and r.hi - r.lo >= 2 and 0 <= r.page_lo < r.page_hi):
            raise PlanViolation(f"malformed shared run {r}")
        first = plan.work[r.lo].pages[r.page_lo : r.page_hi]
        for i in range(r.lo, r.hi):
            w = plan.work[i]
            if w.pages[r.page_lo : r.page_hi] != first or r.page_hi * page_size > w.start:
                raise PlanViolation(f"shared run {r}: item {i} does not hold those pages as computed context")
            covered[i].append((r.page_lo, r.page_hi))
    cuts = plan.cuts or (0,) * len(plan.work)
    for i, spans in enumerate(covered):
        spans.sort()
        edge = 0
        for lo, hi in spans:  # the runs over an item tile [0, cut): nested levels, no gap, no overlap
            if lo != edge:
                raise PlanViolation(f"item {i}: its shared runs {spans} leave a gap or overlap")
            edge = hi
        if edge != cuts[i]:
            raise PlanViolation(f"item {i}: cut {cuts[i]} but its shared runs cover {edge} pages")


def check_reads(plan: StepPlan, page_size: int, specs: LayerSpecs | None = None, group_pages=None) -> None:
    """Pack ``plan`` as the model runner does and check what the attention reads: each token of each item
    sees exactly the slots of context positions [0, its position] in the item's pages (its KV group's:
    ``group_pages(pages, g)``), each once, and writes its own slot there, through every layer's metadata
    (one per layer kind of ``specs``)."""
    batch, starts = pack(plan, page_size, "cpu", specs, group_pages)
    if specs is None:
        check_meta_reads(plan, page_size, batch, starts, batch.meta, lambda pages: pages, batch.slots)
        return
    if len(batch.metas) != len(specs.specs):
        raise PlanViolation(f"{len(batch.metas)} attention metadata for {len(specs.specs)} layer kinds")
    for layer in range(len(specs)):
        g = specs.groups[specs.of_layer[layer]]
        in_group = (lambda pages: pages) if g == 0 else (lambda pages, g=g: group_pages(pages, g))
        check_meta_reads(
            plan, page_size, batch, starts, batch.layer_meta(specs, layer), in_group, batch.slots_of(g)
        )


def check_meta_reads(plan: StepPlan, page_size: int, batch, starts: list[int], meta, in_group, slots) -> None:
    seen: list[list[int]] = [[] for _ in range(meta.num_tokens)]
    written = slots.tolist()
    # a window: token t reads only the keys at positions >= first[t] (unit and segment keys sit at
    # consecutive positions from the metadata's unit_pos / seg_pos)
    first = meta.tok_first.tolist() if meta.window is not None else [-(10**9)] * meta.num_tokens
    units = zip(meta.unit_list, meta.unit_positions(), strict=True)
    for (kv_lo, kv_hi, tok_lo, tok_hi, causal), pos in units:
        for t in range(tok_lo, tok_hi):
            end = min(kv_hi, kv_lo + t - tok_lo + 1) if causal else kv_hi
            seen[t] += range(max(kv_lo, kv_lo + first[t] - pos), end)
    for (tok_lo, tok_hi, runs, visible), pos in zip(meta.segment_list, meta.segment_positions(), strict=True):
        slots = [x for lo, hi in runs for x in range(lo, hi)]
        for t in range(tok_lo, tok_hi):
            seen[t] += slots[max(0, first[t] - pos) : max(0, visible + t - tok_lo)]
    for w, t0 in zip(plan.work, starts, strict=True):
        name = f"seq {w.seq.request.request_id}/{w.seq.index}"
        if batch.positions[t0 : t0 + len(w.tokens)].tolist() != work_positions(w):
            raise PlanViolation(f"{name}: packed at the wrong positions")
        pages = in_group(w.pages)
        slots = [pages[q // page_size] * page_size + q % page_size for q in range(w.end)]
        if written[t0 : t0 + len(w.tokens)] != slots[w.start :]:
            raise PlanViolation(f"{name}: writes its tokens' K/V at the wrong slots")
        positions = work_positions(w)
        for j in range(len(w.tokens)):
            keys = [(slots[p], p) for p in range(w.start)]
            keys += [(slots[w.start + a], positions[a]) for a in lineage(w, j)]
            lowest = positions[j] - meta.window + 1 if meta.window is not None else 0
            want = sorted(s for s, p in keys if p >= lowest)
            if sorted(seen[t0 + j]) != want:
                raise PlanViolation(
                    f"{name}: token {j} of its work reads slots {sorted(seen[t0 + j])} instead of its "
                    f"context's {want}"
                )


def lineage(w, j: int) -> list[int]:
    """Token j of work item ``w`` and the item's tokens before it that it sees, in order: all of them for
    ordinary work, its ancestors in a draft tree."""
    if w.parents is None:
        return list(range(j + 1))
    out = [j]
    while w.parents[out[-1]] >= 0:
        out.append(w.parents[out[-1]])
    return out[::-1]


def work_positions(w) -> list[int]:
    """The context position of each token of ``w``: start + its index, or start + its depth in a tree."""
    return [w.start + len(lineage(w, j)) - 1 for j in range(len(w.tokens))]


class FakeParallel:
    """EngineCore(parallel=...) hook: the fake pool and runner instead of real ones."""

    def make_pool(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout=None):
        return FakePool(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout)

    def make_runner(self, model, cfg, pool, device, attention):
        return FakeRunner(pool, model_layer_specs(cfg))


def fake_engine(
    pages: int,
    page_size: int,
    *,
    sharing: bool = True,
    context: int = 256,
    layer_specs=(),
    kv_groups=(),
    **options,
) -> EngineCore:
    """The fake engine; ``layer_specs`` (AttentionSpecs) gives its model that many layers attending so, and
    ``kv_groups`` each layer's KV group."""
    cfg = SimpleNamespace(
        num_layers=len(layer_specs) or len(kv_groups) or 1,
        layer_specs=tuple(layer_specs),
        kv_groups=tuple(kv_groups),
        num_kv_heads=1,
        head_dim=1,
        vocab_size=VOCAB,
        max_position_embeddings=context,
        eos_token_ids=[EOS],
    )
    config = EngineConfig(
        prefix_sharing=sharing, kv_cache_tokens=pages * page_size, page_size=page_size, **options
    )
    return EngineCore(None, cfg, None, config, parallel=FakeParallel())


def expected_output(
    prompt: list[int], forced: dict[int, list[int]], max_tokens: int, ignore_eos: bool
) -> list[int]:
    """The tokens a sequence must produce: greedy next_token, with ``forced[i]`` appended after i tokens."""
    out: list[int] = []
    while len(out) < max_tokens:
        if len(out) in forced:
            for t in forced[len(out)]:  # forced text is checked token by token: an EOS in it ends it there
                out.append(t)
                if t == EOS and not ignore_eos:
                    return out
            continue
        t = next_token(prompt + out)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def run(engine: EngineCore, max_steps: int = 5_000) -> None:
    """Step ``engine`` until every request has finished."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def all_tables(engine: EngineCore) -> list:
    return [s.kv for s in engine.scheduler.running]
