"""A frozen step plan as one packed batch: token ids, positions, KV slots and the attention metadata.

Every work item's tokens go into one varlen batch, in the plan's depth-first order, so the items that share
pages are neighbours and each shared run is read for a contiguous range of query tokens:

* a **shared run** (pages held by several items, chosen by the cost rule) is one non-causal unit over its
  slot runs for all those items' tokens: one matrix product reads it once;
* the rest of an item's context, from its cut, is read per item, in place through its pages: one segment
  for a decode token or a short extend; for a long prefill chunk, non-causal units over the context before
  the chunk and a causal unit over the chunk itself (matrix products again);
* a **draft tree** (``Work.parents``) reads the rest of its context by non-causal units over all its tokens
  (once for the whole tree), and each token its ancestors and itself as a one-token segment
  (``step_attention.tree_segments``); its tokens sit at position start + depth, each in its own slot.

Each layer writes the step's new K/V into the pool before attending, so a chunk sees its own keys.

The metadata is built once per layer kind's KV group and mask (``attention/layer_spec.py``), not per layer:
kinds of one group that see the same keys (``AttentionSpec.mask_key``: the window) share one, and each layer
reads the one of its kind (``PackedBatch.layer_meta``). Every unit and segment carries the position of its
first key (consecutive positions follow), so a sliding layer's metadata (``StepAttentionMeta.build`` with the
window and the tokens' positions) bounds each token's keys below at its window and leaves out the work no
token's window reaches; the same reads serve every mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hydragen.attention.layer_spec import LayerSpecs
from hydragen.attention.step_attention import StepAttentionMeta, tree_segments
from hydragen.engine.step_plan import StepPlan, tree_depths
from hydragen.kv.layout import released_groups
from hydragen.kv.window_pages import first_window_page

UNIT_TOKENS = 16  # items with at least this many tokens read their context by matrix products (units)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V is written
    metas: tuple[StepAttentionMeta, ...]  # per distinct layer spec; specs with one mask share one
    logit_rows: torch.Tensor  # [R] the tokens whose logits are wanted: each item's last Work.logit_rows
    num_prefill_tokens: int  # tokens of items that do not sample (prompt chunks before the last)
    # Triton decode (attention="triton", a step of one decode token per item): the kernels' tables, the
    # first kind's (tree_plan) and every kind's (tree_plans: kinds of one mask share one).
    tree_plan: object | None = None
    tail_lens: torch.Tensor | None = None
    tree_plans: tuple = ()
    shared_items: int = 0  # shared runs read by ranges of items
    group_slots: tuple[torch.Tensor, ...] = ()  # KV groups 1..: each token's slot in that group's pages

    def slots_of(self, group: int) -> torch.Tensor:
        return self.slots if group == 0 else self.group_slots[group - 1]

    @property
    def meta(self) -> StepAttentionMeta:
        """The first spec's metadata: the step's, for a model whose layers all attend alike."""
        return self.metas[0]

    def layer_meta(self, specs: LayerSpecs, layer: int) -> StepAttentionMeta:
        return self.metas[specs.of_layer[layer]]


def positioned(runs: list[tuple[int, int]], first: int) -> list[tuple[int, int, int]]:
    """``runs`` holding consecutive positions from ``first`` as (lo, hi, position of lo)."""
    out = []
    for lo, hi in runs:
        out.append((lo, hi, first))
        first += hi - lo
    return out


def slot_runs(pages, page_size: int, first: int, end: int) -> list[tuple[int, int]]:
    """Slot runs holding positions [first, end) of a context stored in ``pages`` (consecutive pages merge)."""
    out: list[tuple[int, int]] = []
    pos = first
    while pos < end:
        i = pos // page_size
        lo = pages[i] * page_size + pos % page_size
        take = min(end - pos, page_size - pos % page_size)
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], lo + take)
        else:
            out.append((lo, lo + take))
        pos += take
    return out


@dataclass
class _Reads:
    """One KV group's side of a step: the slot each token's K/V goes to, and what each token reads."""

    slots: list[int] = field(default_factory=list)
    # units (kv_lo, kv_hi, tok_lo, tok_hi, causal, first key's position); segments (tok_lo, tok_hi, runs,
    # visible, first key's position): every key's position is known, for a window
    units: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    segments: list[tuple[int, int, list[tuple[int, int]], int, int]] = field(default_factory=list)

    def add_item(self, w, cut: int, t0: int, pages, page_size: int, window: int | None = None) -> None:
        """Work item ``w`` (its first token at ``t0``), its context read from ``pages`` past its cut; with
        ``window`` (a group whose pages before it are released), from the first page its window reads."""
        k = len(w.tokens)
        own = slot_runs(pages, page_size, w.start, w.end)
        for lo, hi in own:
            self.slots += range(lo, hi)
        first = max(cut, first_window_page(w.start, window, page_size)) * page_size
        context = slot_runs(pages, page_size, first, w.start) if first < w.start else []
        if w.parents is not None:  # a draft tree: context by units, ancestors per token (root at start)
            self.units += [(lo, hi, t0, t0 + k, 0, p) for lo, hi, p in positioned(context, first)]
            self.segments += [(*s, w.start) for s in tree_segments(t0, self.slots[t0:], w.parents)]
        elif k >= UNIT_TOKENS:
            self.units += [(lo, hi, t0, t0 + k, 0, p) for lo, hi, p in positioned(context, first)]
            if len(own) == 1:
                self.units.append((own[0][0], own[0][1], t0, t0 + k, 1, w.start))
                self.segments.append((t0, t0 + k, [], 0, w.start))
            else:
                self.segments.append((t0, t0 + k, own, 1, w.start))
        else:
            self.segments.append((t0, t0 + k, context + own, w.start - first + 1, first))

    def add_shared(
        self, plan: StepPlan, starts: list[int], page_size: int, pages_of, window: int | None = None
    ) -> None:
        """The plan's shared runs: one non-causal unit each over its slots, for all its items' tokens; with
        ``window``, from the first page one of their windows reads."""
        for run in plan.shared:
            lo_page = run.page_lo
            if window is not None:
                reach = min(first_window_page(w.start, window, page_size) for w in plan.work[run.lo : run.hi])
                lo_page = max(lo_page, reach)
            if lo_page >= run.page_hi:
                continue
            pages = pages_of(plan.work[run.lo].pages)
            first = lo_page * page_size
            for lo, hi, p in positioned(slot_runs(pages, page_size, first, run.page_hi * page_size), first):
                self.units.append((lo, hi, starts[run.lo], starts[run.hi], 0, p))


def pack(
    plan: StepPlan, page_size: int, device, specs: LayerSpecs | None = None, group_pages=None
) -> tuple[PackedBatch, list[int]]:
    """The packed batch of ``plan`` with a metadata per layer kind of ``specs`` (None: one), and per work
    item its first token's index in it. ``group_pages(pages, g)`` gives KV group g's pages beside a
    table's (``PagePool.in_group``); a model with one group needs none."""
    if specs is not None and (why := specs.unsupported()):
        raise ValueError(f"cannot pack a step for this model: {why}, which the kernels do not compute yet")
    groups = max(specs.groups) + 1 if specs is not None else 1
    if groups > 1 and group_pages is None:
        raise ValueError(f"a step of a model with {groups} KV groups needs their pages (group_pages)")
    ids: list[int] = []
    pos: list[int] = []
    logit_rows: list[int] = []
    starts: list[int] = []
    not_sampling = 0
    lead = _Reads()  # group 0: the table's own pages
    cuts = plan.cuts or (0,) * len(plan.work)
    for w, cut in zip(plan.work, cuts, strict=True):
        t0, k = len(ids), len(w.tokens)
        starts.append(t0)
        ids += w.tokens
        if w.parents is not None:  # a draft tree: positions by depth (its parents checked first)
            pos += [w.start + d for d in tree_depths(w.parents, k)]
        else:
            pos += range(w.start, w.end)
        lead.add_item(w, cut, t0, w.pages, page_size)
        n = w.logit_rows
        if n == 1:
            logit_rows.append(t0 + k - 1)
        elif n:
            if not 0 < n <= k:
                raise ValueError(f"a work item of {k} tokens asks for {n} logits rows")
            logit_rows += range(t0 + k - n, t0 + k)
        else:
            not_sampling += k
    starts.append(len(ids))
    lead.add_shared(plan, starts, page_size, lambda pages: pages)
    reads = [lead]
    released = released_groups(specs.group_windows()) if specs is not None else {}
    for g in range(1, groups):  # the same reads in each other group's pages (a sliding one's: its windows')
        mine, window = _Reads(), released.get(g)
        for w, cut, t0 in zip(plan.work, cuts, starts, strict=False):
            mine.add_item(w, cut, t0, group_pages(w.pages, g), page_size, window)
        mine.add_shared(plan, starts, page_size, lambda pages, g=g: group_pages(pages, g), window)
        reads.append(mine)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    built: dict[tuple[int, int | None], StepAttentionMeta] = {}  # per (group, mask): kinds share them
    metas = []
    for g, spec in zip(specs.groups, specs.specs, strict=True) if specs is not None else [(0, None)]:
        window = spec.window if spec is not None else None
        key = (g, spec.mask_key if spec is not None else None)
        if key not in built:
            built[key] = StepAttentionMeta.build(
                reads[g].units, reads[g].segments, len(ids), device, window=window, positions=pos
            )
        metas.append(built[key])
    slots = [as_tensor(r.slots) for r in reads]
    batch = PackedBatch(
        as_tensor(ids),
        as_tensor(pos),
        slots[0],
        tuple(metas),
        as_tensor(logit_rows),
        not_sampling,
        shared_items=len(plan.shared),
        group_slots=tuple(slots[1:]),
    )
    return batch, starts[:-1]


def triton_tables(
    plan: StepPlan, page_size: int, device, group: int, num_kv_heads: int, options: dict, window=None
):
    """The Triton tree-decode tables (``tree_plan.py``) for a step where every item decodes one token:
    shared runs as slot ranges read by item ranges, and each item's tail (from its cut) as a page table;
    with ``window``, each item's bounds. None for any other step (it takes the general path)."""
    if not plan.work or any(len(w.tokens) != 1 for w in plan.work):
        return None
    from hydragen.attention.tree_plan import build_tree_plan

    items = []
    for run in plan.shared:
        first = plan.work[run.lo]
        at = run.page_lo * page_size
        for lo, hi, p in positioned(slot_runs(first.pages, page_size, at, run.page_hi * page_size), at):
            items.append((lo, hi, run.lo, run.hi, p))
    cuts = plan.cuts or (0,) * len(plan.work)
    tails = [w.pages[cut:] for w, cut in zip(plan.work, cuts, strict=True)]
    lens = [w.end - cut * page_size for w, cut in zip(plan.work, cuts, strict=True)]
    table = torch.zeros(len(tails), max(map(len, tails)), dtype=torch.int32)
    for i, pages in enumerate(tails):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    tree = build_tree_plan(
        items,
        table.to(device),
        page_size,
        group=group,
        num_kv_heads=num_kv_heads,
        tail_cap=max(lens),
        window=window,
        positions=[w.start for w in plan.work],
        tail_start=[cut * page_size for cut in cuts],
        **options,
    )
    return tree, torch.tensor(lens, dtype=torch.long, device=device)
