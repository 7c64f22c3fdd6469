"""The KV manager: owns every page and every pin (pool, radix tree, sequences' own pages, cost rule).

Where memory goes:
* a tree node holds the pages of its tokens; running sequences pin their path;
* a running sequence holds its *own* pages for the context past its path node (the last prompt token,
  generated tokens); with sharing off it holds a private copy of its whole context;
* a sequence that leaves hands its own pages to the tree (its context becomes a cached prefix), so a
  finished, preempted or aborted sequence loses nothing that a later request could reuse.
Allocation evicts least-recently-used unpinned prefixes when free pages run short, and succeeds whenever
free plus evictable pages cover it, however scattered they are.
"""

from __future__ import annotations

import torch

from hydragen.engine.sequence import Sequence
from hydragen.kv.pool import (
    OutOfPages,
    PagePool,
    Runs,
    append_runs,
    runs_len,
    slot_list,
    split_runs,
    take_runs,
)
from hydragen.kv.radix import Node, RadixTree

# The cost rule: a group of nodes held by h running sequences is read by one batched call when
# (h - 1) x (tokens - MERGE_ROW_TOKENS) >= min_shared_reads: the KV-token reads it saves per step, less
# the LSE merge of each extra query row (worth about MERGE_ROW_TOKENS reads), must pay for the extra
# work. Below it the group is read per sequence, in place (no copy). Fitted on a 2-core CPU
# (docs/performance.md, "cost rule").
DEFAULT_MIN_SHARED_READS = 2048
MERGE_ROW_TOKENS = 16

# (slot_lo, slot_hi, i, j): a shared KV run read by the contiguous running sequences [i, j).
Item = tuple[int, int, int, int]


def sharing_pays(
    holders: int, tokens: int, min_shared_reads: int, merge_row_tokens: int = MERGE_ROW_TOKENS
) -> bool:
    """The cost rule for one group of nodes (0 turns it off: everything held by two is shared).
    ``merge_row_tokens`` is the calibration's free parameter (``bench cost-rule`` fits it)."""
    return min_shared_reads == 0 or (holders - 1) * (tokens - merge_row_tokens) >= min_shared_reads


class KVManager:
    def __init__(
        self,
        pool: PagePool,
        prefix_sharing: bool,
        min_shared_reads: int = DEFAULT_MIN_SHARED_READS,
        share_limit: int | None = None,
    ):
        self.pool = pool
        self.tree = RadixTree(pool)
        self.prefix_sharing = prefix_sharing
        self.min_shared_reads = min_shared_reads
        # Ablation knob (bench tree's one-level mode): share at most this many leading context tokens.
        self.share_limit = share_limit
        # Triton decode: a sequence's own pages are reserved for its whole length at once (one run).
        self.reserve_whole = False

    @property
    def join_copies(self) -> bool:
        """Whether join() copies path KV (which must then be computed before the joining step)."""
        return not self.prefix_sharing or self.share_limit is not None

    # ---- pages --------------------------------------------------------------------------------
    def can_fit(self, pages: int) -> bool:
        return self.pool.allocator.free >= pages or (
            self.pool.allocator.free + self.tree.evictable_pages() >= pages
        )

    def _make_room(self, pages: int) -> None:
        if self.pool.allocator.free >= pages:
            return
        if self.pool.allocator.free + self.tree.evictable_pages() < pages:
            raise OutOfPages(f"need {pages} KV pages: {self.pool.allocator.free} free, the rest is in use")
        self.tree.evict(pages)
        if self.pool.allocator.free < pages:
            raise OutOfPages(f"need {pages} KV pages, {self.pool.allocator.free} free after eviction")

    def allocate(self, tokens: int) -> Runs:
        """Slot runs (whole pages) for ``tokens`` slots, evicting cached prefixes if needed."""
        self._make_room(self.pool.pages_for(tokens))
        return self.pool.allocate(tokens)

    def usage(self) -> dict:
        """Pages in use, pages the prefix cache holds, total: after all requests end, used == cached."""
        cached = set()
        stack = [self.tree.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            cached |= self.pool.pages(n.runs)
        return {"used": self.pool.used_pages, "cached": len(cached), "total": self.pool.num_pages}

    # ---- a sequence's life ------------------------------------------------------------------------
    def tree_for(self, s: Sequence) -> RadixTree:
        if self.prefix_sharing:
            return self.tree
        if s.request.private_tree is None:
            s.request.private_tree = RadixTree(self.pool)
        return s.request.private_tree

    def admit(self, s: Sequence) -> int:
        """Pin the tree path for the sequence's computed context; returns how much of it was cached."""
        tree = self.tree_for(s)
        context = s.context[: s.computed]
        hit = tree.match_len(context)
        s.node = tree.insert(context)
        if self.share_limit is not None:  # a node boundary at the limit, so the part above can be shared
            for n in s.node.path():
                tree.split_at(n, self.share_limit)
        tree.pin(s.node, 1)
        return hit

    def admission_pages(self, s: Sequence) -> int:
        """Pages a waiting sequence needs to start: its uncached context and its first own page."""
        cached = self.tree_for(s).match_len(s.context[: s.computed]) if self.prefix_sharing else 0
        return self.pool.pages_for(max(s.computed - cached, 0)) + self.pool.pages_for(s.pending)

    def allocate_node(self, tree: RadixTree, node: Node) -> None:
        if not node.allocated:
            tree.assign_kv(node, take_runs(self.allocate(len(node.tokens)), len(node.tokens)), filled=0)

    def unpin(self, s: Sequence) -> None:
        if s.node is not None:
            self.tree_for(s).pin(s.node, -1)
            s.node = None

    def join(self, s: Sequence) -> None:
        """A prefilled sequence starts decoding; its own pages come from ``reserve``.

        Sharing off, its own pages get a private copy of the whole computed context (the baseline), and
        the request's private tree is dropped once every sequence of it has its copy. Raises OutOfPages
        (nothing changed) when the copy does not fit.
        """
        end = s.node.end_pos if s.node is not None else 0
        s.own_runs = []
        if self.prefix_sharing:
            # share_limit (one-level ablation): the context past the limit is a private copy.
            s.own_start = end if self.share_limit is None else min(end, self.share_limit)
        else:
            s.own_start = 0
        if s.own_start < end:
            try:
                self.reserve(s)
            except OutOfPages:
                s.own_runs, s.own_start = [], 0
                raise
            self._copy_path(s, end)
        if not self.prefix_sharing:
            self.unpin(s)
        req = s.request
        if req.private_tree is not None and all(x.node is None for x in req.seqs if not x.finished):
            req.private_tree.clear()
            req.private_tree = None

    def _copy_path(self, s: Sequence, end: int) -> None:
        """Copy the path's KV for positions [own_start, end) into the sequence's own pages."""
        if s.own_start >= end:
            return
        src = [slot for n in s.node.path() if n.start_pos >= s.own_start for slot in slot_list(n.runs)]
        dst = slot_list(take_runs(s.own_runs, end - s.own_start))
        dev = self.pool.k.device
        self.pool.copy_slots(torch.tensor(dst, device=dev), torch.tensor(src, device=dev))

    def reserve(self, s: Sequence, extra: int = 0) -> None:
        """Own pages for the whole context (and ``extra`` more tokens). Raises OutOfPages."""
        if self.reserve_whole and not s.own_runs:
            extra = max(extra, s.max_len - s.context_len)
        need = s.context_len + extra - s.own_start - runs_len(s.own_runs)
        if need > 0:
            self._make_room(self.pool.pages_for(need))
            append_runs(s.own_runs, self.pool.extend(s.own_runs, need))

    def own_slots(self, s: Sequence, start: int, end: int) -> list[int]:
        """Slots of context positions [start, end) in the sequence's own pages."""
        a, b = start - s.own_start, end - s.own_start
        return slot_list(split_runs(split_runs(s.own_runs, b)[0], a)[1])

    def leave(self, s: Sequence) -> None:
        """Release a running sequence: its computed context becomes a cached prefix (sharing on), the
        own pages the tree does not take are freed, its path is unpinned."""
        handed: Runs = []
        if self.prefix_sharing and s.node is not None and s.computed > s.own_start:
            leaf = self.tree.insert(s.context[: s.computed])
            if (
                leaf.parent is not None
                and not leaf.allocated
                and leaf.start_pos >= s.own_start
                and all(n.has_kv for n in leaf.path()[:-1])
            ):
                own = take_runs(s.own_runs, s.computed - s.own_start)
                handed = split_runs(own, leaf.start_pos - s.own_start)[1]
                self.tree.assign_kv(leaf, handed)
                self.tree.pin(leaf, 0)  # refresh its LRU time
        keep = self.pool.pages(handed)
        self.pool.release(self.pool.pages(s.own_runs) - keep)
        s.own_runs, s.own_start, s.cut = [], 0, 0
        self.unpin(s)

    # ---- the decode plan --------------------------------------------------------------------------
    def plan(self, seqs: list[Sequence], all_nodes: bool = False) -> list[Item]:
        """Set each running sequence's cut by the cost rule; return the shared items (DFS-ordered seqs).

        Consecutive path nodes held by the same number of sequences form a group, read by the same
        contiguous range of sequences. A group is read by one batched call when ``sharing_pays``;
        groups above the deepest group that pays are shared too (a cut is a prefix). Everything below
        the cut is read per sequence, in place. ``all_nodes`` reads every path node as an item, even a
        node held by one sequence (the Triton decode kernels read private KV only from one run).
        """
        if not self.prefix_sharing:
            for s in seqs:
                s.cut = 0
            return []
        holders: dict[int, int] = {}
        for s in seqs:
            if s.node is not None:
                for n in s.node.path():
                    holders[id(n)] = holders.get(id(n), 0) + 1
        if all_nodes:
            for s in seqs:
                s.cut = s.node.end_pos if s.node is not None else 0
            return _items(seqs)
        for s in seqs:
            cut, group_holders, group_tokens = 0, 0, 0
            for n in s.node.path() if s.node is not None else ():
                h = holders[id(n)]
                if h < 2 or (self.share_limit is not None and n.end_pos > self.share_limit):
                    break
                if h != group_holders:
                    group_holders, group_tokens = h, 0
                group_tokens += len(n.tokens)
                if sharing_pays(h, group_tokens, self.min_shared_reads):
                    cut = n.end_pos
            s.cut = cut
        return _items(seqs)


def _items(seqs: list[Sequence]) -> list[Item]:
    """(slot_lo, slot_hi, i, j) for every shared node run read by the contiguous sequences [i, j).

    Consecutive runs read by the same range whose slots touch are fused, so a chain of short nodes on
    consecutive pages costs one unit.
    """
    spans: dict[int, list] = {}  # id(node) -> [node, first, last]
    order = []
    for idx, s in enumerate(seqs):
        if s.node is None:
            continue
        for node in s.node.path():
            if node.end_pos > s.cut:
                break
            span = spans.get(id(node))
            if span is None or span[2] != idx - 1:
                span = [node, idx, idx]
                spans[id(node)] = span
                order.append(span)
            else:
                span[2] = idx
    items: list[Item] = []
    for node, i, last in order:
        for lo, hi in node.runs:
            prev = items[-1] if items else None
            if prev and prev[2:] == (i, last + 1) and prev[1] == lo:
                items[-1] = (prev[0], hi, i, last + 1)
            else:
                items.append((lo, hi, i, last + 1))
    return items
