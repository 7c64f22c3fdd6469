"""Sliding-window groups' pages: held while a window can read them, then released, and kept for prefix hits.

A sliding layer of window W lets the token at position p see keys at positions (p - W, p]. Once a page
table has computed up to position c, its next token is at c or later, so its window groups never read
a page that ends at or before c - W again: the table drops its hold on those groups' pages (``slide``),
while its full-attention group 0 keeps them. A long context then costs the KV of its full layers plus one
window per sliding group, not every layer in full.

A dropped page nobody else holds goes straight back to the pool, unless its table page is in the prefix
tree: then it is an **idle part**, kept for a later hit and evicted, least recently used, beside the tree's
idle leaves (``KVManager._make_room``). A hit is valid only where the window's keys exist: a request whose
first uncached position is ``n * P`` needs, in every window group, the pages holding positions
``[n * P - W + 1, n * P)`` (``valid_prefix``), so a match is cut back to its last valid end, never used
with a hole in the window. An evicted part can leave idle leaves that are no longer a valid end for any
hit: they are evicted with it (``prune``), so the tree never keeps full-attention pages that cannot hit
(``unreachable`` counts any that remain, held ones, as a metric).

A table that starts on a prefix hit also **anchors** the window at the hit's end: it holds those parts until
it ends (``anchor``/``drop_anchor``), where its own window moves on after a few tokens. The hit's end is a
point other requests share (a system prompt, a document, a conversation so far), and the next request that
shares it needs exactly that window. Without the anchor, a tight cache evicted those idle parts while the
requests that used them still ran: a shared-system-prompt workload hit 0.442 at 48 pages where the same
model with every layer full hit 0.863; anchored, it hits 0.863 too (bench/windows/hit_rate.py). It costs
at most one window of the sliding groups per running table, shared by every table anchored at the same end.

The KV manager owns the tables and the tree; this class owns the window parts' holds (``pool.part_refs``)
and the idle parts, and is called at each point where a table gains, moves past or drops pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from hydragen.kv.pool import PagePool
from hydragen.kv.radix import PageNode, PrefixTree, tick


def first_window_page(position: int, window: int | None, page_size: int) -> int:
    """The first page a token at ``position`` or later can still read through ``window`` (None: page 0)."""
    return 0 if window is None else max(0, (position - window + 1) // page_size)


class WindowPages:
    def __init__(self, pool: PagePool, tree: PrefixTree):
        self.pool, self.tree, self.page_size = pool, tree, pool.page_size
        self.windows: dict[int, int] = pool.layout.released  # {group: window}
        self.idle = 0  # idle parts: present, unheld, beside a page in the tree
        self._since = {g: [0] * len(pool.refs) for g in self.windows}  # when a part went idle (0: not idle)
        self._heap: list[tuple[int, int, int, int]] = []  # (LRU time, depth, group, page)

    def __bool__(self) -> bool:
        return bool(self.windows)

    def first_page(self, position: int, window: int) -> int:
        return first_window_page(position, window, self.page_size)

    # ---- holds ---------------------------------------------------------------------------------------
    def retain(self, group: int, page: int) -> None:
        held = self.pool.part_refs[group]
        if not held[page] and self._since[group][page]:
            self._since[group][page] = 0
            self.idle -= 1
        if self.pool.group_pages[group][page] < 0:
            raise RuntimeError(f"group {group}'s page beside {page} is gone but a window needs it")
        held[page] += 1

    def release(self, group: int, page: int) -> None:
        """Drop one hold; an unheld part stays idle beside a cached page, else goes back to the pool."""
        held = self.pool.part_refs[group]
        held[page] -= 1
        if held[page] < 0:
            raise RuntimeError(f"group {group}'s page beside {page} released more often than held")
        if held[page]:
            return
        if page in self.tree:
            now = tick()
            self._since[group][page] = now
            self.idle += 1
            heapq.heappush(self._heap, (now, self.tree.nodes[page].depth, group, page))
        else:
            self.pool.free_part(group, page)

    def _reach(self, pages: list[int], position: int) -> dict[int, int]:
        """Per window group, the first of ``pages`` a table computing from ``position`` reads."""
        return {g: min(self.first_page(position, w), len(pages)) for g, w in self.windows.items()}

    def start(self, window_from: dict[int, int], pages: list[int], position: int) -> None:
        """A table starts on ``pages`` (a prefix hit) and computes from ``position``: it holds each window
        group's pages from the first its window reads."""
        window_from.update(self._retain_reach(pages, position))

    def _retain_reach(self, pages: list[int], position: int) -> dict[int, int]:
        """Hold, in each window group, ``pages`` from the first one reached from ``position``; that reach."""
        reach = self._reach(pages, position)
        for g, lo in reach.items():
            for p in pages[lo:]:
                self.retain(g, p)
        return reach

    def anchor(self, pages: list[int]) -> int:
        """A table starting on the hit ``pages`` holds the window at their end a second time, to its end:
        the parts a later hit at the same end reads. Returns the anchor (``PageTable.anchor``)."""
        self._retain_reach(pages, len(pages) * self.page_size)
        return len(pages)

    def anchored(self, pages: list[int], anchor: int) -> dict[int, list[int]]:
        """Per window group, the pages an ``anchor`` on ``pages`` holds."""
        return {g: pages[lo:anchor] for g, lo in self._reach(pages[:anchor], anchor * self.page_size).items()}

    def drop_anchor(self, pages: list[int], anchor: int) -> None:
        for g, held in self.anchored(pages, anchor).items():
            for p in held:
                self.release(g, p)

    def slide(self, window_from: dict[int, int], pages: list[int], position: int) -> None:
        """The table's next token is at ``position`` or later: its holds before its windows are dropped."""
        for g, w in self.windows.items():
            lo, new = window_from.get(g, 0), min(self.first_page(position, w), len(pages))
            for p in pages[lo:new]:
                self.release(g, p)
            window_from[g] = max(lo, new)

    def drop(self, window_from: dict[int, int], pages: list[int], first: int = 0) -> None:
        """Drop the holds on ``pages[first:]`` (a table released, truncated or replaced)."""
        for g in self.windows:
            for p in pages[max(first, window_from.get(g, 0)) :]:
                self.release(g, p)

    def drop_all(self, pages: Iterable[int]) -> None:
        """Drop the holds of pages taken outside any table (a fork's unused reservation)."""
        for g in self.windows:
            for p in pages:
                self.release(g, p)

    def present(self, page: int, groups: Iterable[int] | None = None) -> bool:
        gp = self.pool.group_pages
        return all(gp[g][page] >= 0 for g in (self.windows if groups is None else groups))

    # ---- the tree's side ------------------------------------------------------------------------------
    def left_tree(self, page: int) -> None:
        """A node left the tree (evicted or unpublished): its idle parts go back to the pool."""
        for g in self.windows:
            if self._since[g][page]:
                self._since[g][page] = 0
                self.idle -= 1
                self.pool.free_part(g, page)

    def valid_end(self, node: PageNode) -> bool:
        """Whether a hit may end after ``node``: every window group's pages its next token reads exist."""
        end = (node.depth + 1) * self.page_size
        gp = self.pool.group_pages
        for g, w in self.windows.items():
            lo, anc = self.first_page(end, w), node
            while anc.parent is not None and anc.depth >= lo:
                if gp[g][anc.page] < 0:
                    return False
                anc = anc.parent
        return True

    def valid_prefix(self, nodes: list[PageNode]) -> int:
        """The longest prefix of a match (nodes along one path) a hit may use: its last valid end (0: none).
        The first end tried is nearly always valid; a cut-back tries each shorter one."""
        n = len(nodes)
        while n > 0 and not self.valid_end(nodes[n - 1]):
            n -= 1
        return n

    def idle_in(self, pages: list[int], position: int) -> int:
        """Idle parts a table starting on ``pages`` and computing from ``position`` would hold again (no
        longer evictable): what ``start`` would retain."""
        return sum(
            1 for g, lo in self._reach(pages, position).items() for p in pages[lo:] if self._since[g][p]
        )

    # ---- eviction ---------------------------------------------------------------------------------------
    def oldest_idle(self) -> tuple[int, int, int] | None:
        """(LRU time, group, page) of the least recently used idle part, or None.

        A part is as recent as its release or its page's last use in the tree, whichever is later: a hit
        or a table's release touches every page of its path, so the window pages at the end of a hot shared
        prefix stay, while those of a conversation nobody came back to go first. Of parts used at the same
        time, the shallower go first: the parts a hit at the end of a prefix needs are its deepest."""
        nodes = self.tree.nodes
        while self._heap:
            key, depth, g, p = self._heap[0]
            since = self._since[g][p]
            if not since:
                heapq.heappop(self._heap)  # held again, or gone with its node
                continue
            now = max(since, nodes[p].last_used)
            if now > key:  # used since it was queued: back in line at its new time
                heapq.heapreplace(self._heap, (now, depth, g, p))
                continue
            return key, g, p
        return None

    def evict(self, group: int, page: int) -> list[PageNode]:
        """Free one idle part; returns the idle leaves that it leaves with no valid end (to be evicted)."""
        self._since[group][page] = 0
        self.idle -= 1
        self.pool.free_part(group, page)
        node = self.tree.nodes[page]
        reach = node.depth + -(-self.windows[group] // self.page_size) + 1
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            if n.depth > reach:
                continue
            if not n.children and not self.pool.refs[n.page] and not self.valid_end(n):
                out.append(n)
            stack += n.children.values()
        return out

    def check(self, tables, holders: list[int]) -> None:
        """Assert (tests, ``KVManager.check``) that every window group's page is held exactly by the page
        tables whose window reads it (``holders``: how many tables hold each table page), present while
        held, idle only beside a cached page, counted; and that no idle leaf of the tree is a dead end."""
        pool, tree = self.pool, self.tree
        idle = 0
        for g, w in self.windows.items():
            held = [0] * len(pool.refs)
            for t in tables:
                lo = t.window_from.get(g, 0)
                # never past the first page its next token reads (where it computes from: past its hit)
                reads_from = self.first_page(max(t.computed, t.own_from * self.page_size), w)
                assert lo <= min(reads_from, len(t.pages)), f"group {g}'s window is ahead of its table"
                for p in t.pages[lo:]:
                    held[p] += 1
                for p in self.anchored(t.pages, t.anchor).get(g, []):
                    held[p] += 1
            assert held == pool.part_refs[g], f"group {g}'s page holds differ from the tables' windows"
            for p in range(len(pool.refs)):
                present = pool.group_pages[g][p] >= 0
                if held[p]:
                    assert present, f"group {g}'s page beside {p} is held but gone"
                elif present and (holders[p] or p in tree):
                    assert p in tree, f"group {g}'s page beside {p} is kept for nothing"
                    idle += 1
        assert idle == self.idle, f"idle window pages: counted {self.idle}, found {idle}"
        for page, node in tree.nodes.items():
            if not node.children and not holders[page]:
                assert self.valid_end(node), f"idle leaf {page} can never be hit: its windows are gone"

    def unreachable(self) -> int:
        """Tree pages no hit can ever use: no valid end at or below them (a metric; walks the tree)."""
        order, stack = [], list(self.tree.root.children.values())
        while stack:  # parents before children; read back to front: children before parents
            node = stack.pop()
            order.append(node)
            stack += node.children.values()
        useful: dict[int, bool] = {}
        for node in reversed(order):
            useful[node.page] = self.valid_end(node) or any(useful[c.page] for c in node.children.values())
        return sum(1 for ok in useful.values() if not ok)
