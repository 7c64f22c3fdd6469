"""The KV manager: every page's fate (held, cached, idle, free) and every sequence's page table.

A **page table** lists the pages holding one context's KV, page i holding positions [i * P, (i + 1) * P)
for page size P; ``computed`` is how many leading positions hold KV. Its full pages may be shared with
other tables (same page id, counted in ``pool.refs``); its last, partial page is always its own, since
it is where the context grows.

Pages move between four states, and only through this module:

* **held**: in at least one page table (``refs > 0``);
* **cached**: in the prefix tree (full pages only); cached and held are independent;
* **idle**: cached and not held: kept for reuse, evicted least recently used when pages run short;
* **free**: in the allocator.

The scheduler decides *what* to share (its policy: everything, nothing, or pages below a limit); this
module only offers the mechanisms, and never changes a table behind the scheduler's back: tables change
between steps, never between a step's plan and the end of its forward.

**The contract.** The scheduler uses these calls and nothing else of the KV cache (never the pool or the
tree), as vLLM's scheduler uses ``allocate_slots``:

* ``cached_pages(table, tokens, limit)``: how much of a context is cached (to rank the waiting);
* ``admit(table, tokens, limit, publish)``: start a table on its cached prefix plus pages of its own for
  the rest, or ``None`` when that does not fit now (nothing changes);
* ``allocate(table, upto)``: pages for positions [0, upto), evicting idle cached pages; False if short;
* ``ready(table)``: whether its next position can be computed (not in a page another table still writes);
* ``computed_to(table, end)`` after a forward, ``publish(table, tokens, upto)`` to cache full pages;
* ``truncate(table, length)``: back to a computed length (rejected draft tokens);
* ``reserve(n)`` / ``give_back(pages)`` / ``fork(dst, src, ...)``: a sibling takes another table's KV;
* ``in_flight(table)``, ``dependents(table, others)``, ``release(table, tokens)``.

The engine also reads ``usage()``, resets with ``evict_idle()`` and drains KV events.

**Hashes.** A table caches the chained hashes of its context's full pages (``PageTable.hashes``, computed
once per sequence as its context grows), which key the prefix tree; matching costs a dict lookup and a
token comparison per page. Only a table's context is ever hashed or published: tokens a forward computes
past it (drafts being verified) are never cached, and ``truncate`` drops their KV.

**Sliding windows** (``kv/window_pages.py``). A model with sliding-window KV groups holds, in each table,
those groups' pages only from ``window_from[g]`` on: the rest went back to the pool, or stay as idle
parts for prefix hits, except the window at the end of its prefix hit (``anchor``), which it holds to the
end. Counts of what an allocation can get are then in pages of any group
(``available``), a match is cut back to where every window's keys exist, and eviction weighs idle leaves
and idle parts by one LRU clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hydragen.kv.page_hash import page_hashes
from hydragen.kv.pool import OutOfPages, PagePool
from hydragen.kv.radix import Location, PageEvent, PageNode, PrefixTree
from hydragen.kv.window_pages import WindowPages


@dataclass(eq=False)
class PageTable:
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # leading positions whose KV is written
    published: int = 0  # leading pages that are prefix-tree nodes on this table's path
    own_from: int = 0  # pages before it came from the tree (others write them); from it on, this table writes
    salt: str | None = None  # the request's cache salt: seeds the hash chain (tenants never share pages)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the context's first full pages
    window_from: dict[int, int] = field(default_factory=dict)  # per window group: its first page held
    anchor: int = 0  # pages of its prefix hit, whose last window it holds until it ends (window_pages.py)


class KVManager:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.tree = PrefixTree(pool.page_size)
        self.idle = 0  # cached pages nobody holds
        self._event_sink: Callable[[list[PageEvent]], None] | None = None
        self.windows = WindowPages(pool, self.tree)
        # Pages of any group an idle table page frees with it (itself and the groups that never slide)
        self._fixed = pool.groups - len(self.windows.windows)
        self._unreachable: tuple[float, int] | None = None  # (when, count) of the last tree walk

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Pages an allocation can get: free ones plus idle cached ones (all evictable). With window groups,
        table pages out of the pages of any group free or evictable (each table page takes one of each)."""
        if not self.windows:
            return self.pool.free_pages + self.idle
        return self._physical_left() // self.pool.groups

    def _physical_left(self, revived_pages: int = 0, revived_parts: int = 0) -> int:
        """Pages of any group free or evictable, after reviving some idle table pages and idle parts."""
        idle = (self.idle - revived_pages) * self._fixed + self.windows.idle - revived_parts
        return self.pool.free_physical + idle

    def unreachable_pages(self, max_age: float = 0.0) -> int:
        """Cached pages no prefix hit can use (their sliding windows' pages are gone): a metric, 0 for a
        model without window groups. It walks the tree, so a caller after every step (the server's
        snapshot) passes ``max_age``: a count at most that many seconds old is reused."""
        if not self.windows:
            return 0
        now = time.monotonic()
        if self._unreachable is None or now - self._unreachable[0] > max_age:
            self._unreachable = (now, self.windows.unreachable())
        return self._unreachable[1]

    def usage(self) -> dict:
        """Pages in use (held or cached), cached, total: after every request ends, used == cached."""
        return {"used": self.pool.used_pages, "cached": len(self.tree), "total": self.pool.num_pages}

    @property
    def capacity(self) -> int:
        """Pages the cache has in all."""
        return self.pool.num_pages

    def pages_for(self, tokens: int) -> int:
        return self.pool.pages_for(tokens)

    # ---- finding and admitting ------------------------------------------------------------------------
    def cached_pages(self, table: PageTable, tokens: list[int], limit: int | None = None) -> int:
        """Pages of the longest cached prefix of a context (at most ``limit``; never its last token, whose
        forward gives the logits to sample from), computed or in flight."""
        return len(self._match(table, tokens, limit))

    def admit(
        self, table: PageTable, tokens: list[int], limit: int | None, publish: int | None
    ) -> int | None:
        """Start the empty ``table`` for the context ``tokens``: its cached prefix (at most ``limit`` pages)
        shared, pages of its own for the rest, all taken now; its full pages below position ``publish`` go
        into the tree (None: none). Returns the pages it shares, or None when that does not fit now (then
        nothing changed): the pages it takes plus the idle cached ones it revives must be available."""
        nodes = self._match(table, tokens, limit)
        revived = sum(1 for n in nodes if not self.pool.refs[n.page])
        new = self.pages_for(len(tokens)) - len(nodes)
        if self.windows:
            parts = self.windows.idle_in([n.page for n in nodes], len(nodes) * self.page_size)
            if new * self.pool.groups > self._physical_left(revived, parts):
                return None
        elif new + revived > self.available:
            return None
        self._hold(table, nodes)
        self._grow(table, len(tokens))
        if publish is not None:
            self.publish(table, tokens, publish)
        return len(nodes)

    def allocate(self, table: PageTable, upto: int) -> bool:
        """Pages for positions [0, upto) of ``table``, evicting idle cached pages; False (table unchanged)
        when there are not enough."""
        if self.pages_for(upto) - len(table.pages) > self.available:
            return False
        self._grow(table, upto)
        return True

    def ready(self, table: PageTable) -> bool:
        """Whether the table's next position can be computed: not in a page another table is still writing
        (it moves past the held pages their writers have finished meanwhile)."""
        ps, nodes = self.page_size, self.tree.nodes
        while table.computed < table.own_from * ps and nodes[table.pages[table.computed // ps]].computed:
            table.computed += ps
        return table.computed >= table.own_from * ps

    def _match(self, table: PageTable, tokens: list[int], limit: int | None) -> list[PageNode]:
        n = (len(tokens) - 1) // self.page_size
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return []
        hashes = self._hashes(table, tokens, n)
        nodes = self.tree.match(tokens, hashes if len(hashes) == n else hashes[:n])
        if self.tree.outside_pool:  # usable: the prefix whose KV is in the pool
            for i, node in enumerate(nodes):
                if node.location is not Location.POOL:
                    nodes = nodes[:i]
                    break
        if self.windows:  # usable: up to where every window's keys exist
            nodes = nodes[: self.windows.valid_prefix(nodes)]
        return nodes

    def _hashes(self, table: PageTable, tokens: list[int], pages: int) -> list[int]:
        """The table's cached chain of page hashes, extended to at least ``pages`` pages of ``tokens``."""
        have = table.hashes
        if len(have) < pages:
            have += page_hashes(
                tokens[: pages * self.page_size], self.page_size,
                salt=table.salt, parent=have[-1] if have else None, start=len(have),
            )  # fmt: skip
        return have

    # ---- taking pages -------------------------------------------------------------------------------
    def _make_room(self, pages: int) -> None:
        """Evict idle pages until ``pages`` are free; raises OutOfPages (nothing evicted) if it cannot."""
        if self.windows:
            return self._make_room_windowed(pages * self.pool.groups)
        short = pages - self.pool.free_pages
        if short <= 0:
            return
        if short > self.idle:
            raise OutOfPages(f"need {pages} KV pages: {self.pool.free_pages} free and {self.idle} idle")
        gone = self.tree.evict(short, self.pool.refs)
        self.idle -= len(gone)
        self.pool.free(gone)
        if self.pool.free_pages < pages:  # the idle count and the tree disagree: a bug, never a silent hang
            raise RuntimeError(f"evicted {len(gone)} of {short} idle KV pages: prefix tree inconsistent")

    def _make_room_windowed(self, physical: int) -> None:
        """Evict idle leaves and idle window parts, least recently used first, until ``physical`` pages of
        any group are free; raises OutOfPages (nothing evicted) if it cannot."""
        pool, tree, windows = self.pool, self.tree, self.windows
        if physical - pool.free_physical > self._physical_left() - pool.free_physical:
            raise OutOfPages(
                f"need {physical} KV pages of any group: {pool.free_physical} free, "
                f"{self.idle} idle table pages and {windows.idle} idle window pages"
            )
        while pool.free_physical < physical:
            leaf, part = tree.oldest_idle_leaf(pool.refs), windows.oldest_idle()
            if leaf is None and part is None:
                raise RuntimeError("window pages' idle counts and the prefix tree disagree: a bug")
            if part is None or (leaf is not None and leaf.last_used <= part[0]):
                self._evict_leaf(leaf)
            else:
                for dead in windows.evict(part[1], part[2]):
                    self._prune(dead)

    def _dead_end(self, node: PageNode) -> bool:
        """Whether ``node`` is an idle leaf of the tree that no hit can end at (its windows' pages gone)."""
        return (
            node.parent is not None
            and self.tree.nodes.get(node.page) is node
            and not node.children
            and not self.pool.refs[node.page]
            and not self.windows.valid_end(node)
        )

    def _prune(self, node: PageNode) -> None:
        """Evict ``node`` if it is a dead end: it could never be hit."""
        if self._dead_end(node):
            self._evict_leaf(node)

    def _evict_leaf(self, node: PageNode) -> None:
        """Evict an idle leaf with its window parts; its parent, left a dead end, goes too."""
        while True:
            parent = node.parent
            self.windows.left_tree(node.page)
            self.tree.evict_leaf(node, self.pool.refs)
            self.idle -= 1
            self.pool.free([node.page])
            if not self._dead_end(parent):
                return
            node = parent

    def _grow(self, table: PageTable, tokens: int) -> None:
        """Pages for positions [0, tokens) of ``table``; raises OutOfPages (table unchanged)."""
        need = self.pages_for(tokens) - len(table.pages)
        if need > 0:
            self._make_room(need)
            table.pages += self.pool.take(need, after=table.pages[-1] if table.pages else None)

    def _hold(self, table: PageTable, nodes: list[PageNode]) -> None:
        """Start an empty table on pages of the tree (a prefix match): they stop being idle. Pages still in
        flight are written by whoever published them; ``ready`` moves past them once they are."""
        assert not table.pages, "a table starts empty"
        pages = [n.page for n in nodes]
        self._retain(pages)
        self.tree.touch(pages)
        table.pages = pages
        table.published = table.own_from = len(pages)
        table.computed = 0
        if self.windows:
            self.windows.start(table.window_from, pages, len(pages) * self.page_size)
            table.anchor = self.windows.anchor(pages)
        self.ready(table)

    def reserve(self, pages: int) -> tuple[int, ...] | None:
        """``pages`` fresh pages held outside any table (a fork's copy target), or None when there are not
        enough even after evicting idle ones; ``fork`` hands them to a table, ``give_back`` returns them."""
        if pages > self.available:
            return None
        if pages <= 0:
            return ()
        self._make_room(pages)
        return tuple(self.pool.take(pages))

    def _retain(self, pages: list[int]) -> None:
        refs = self.pool.refs
        self.idle -= sum(1 for p in pages if not refs[p] and p in self.tree)
        self.pool.retain(pages)

    # ---- publishing and releasing --------------------------------------------------------------------
    def publish(self, table: PageTable, tokens: list[int], upto: int) -> None:
        """Put the table's full pages below position ``upto`` into the prefix tree, computed or not (their
        tokens must be known: ``tokens`` is the table's context). A computed page whose tokens are already
        cached and computed on the same path is swapped for the cached one (same KV), so each prefix is
        stored once; meeting a page still in flight, or another page whose hash collides with this one's,
        stops publishing (this table keeps its own copy, uncached)."""
        ps = self.page_size
        full = min(upto, len(tokens), len(table.pages) * ps) // ps
        if full <= table.published:
            return
        tree, hashes = self.tree, self._hashes(table, tokens, full)
        parent = tree.root if table.published == 0 else tree.nodes[table.pages[table.published - 1]]
        for i in range(table.published, full):
            mine = table.pages[i]
            computed = (i + 1) * ps <= table.computed
            key = tuple(tokens[i * ps : (i + 1) * ps])
            node = tree.add(parent, mine, hashes[i], key, computed)
            if node.page != mine:
                if node.tokens != key or not (computed and node.computed):
                    return
                if self.windows and not self._swap_parts(table, i, mine, node.page):
                    return
                self._retain([node.page])
                self._drop([mine])
                table.pages[i] = node.page
            table.published = i + 1
            parent = node

    def _swap_parts(self, table: PageTable, i: int, mine: int, cached: int) -> bool:
        """The table's window holds move from its page ``mine`` (index i) to the cached page of the same
        tokens; False (nothing changes) when a window still reads a part the cached page has lost."""
        windows = self.windows
        groups = [g for g in windows.windows if i >= table.window_from.get(g, 0)]
        if not windows.present(cached, groups):
            return False
        for g in groups:
            windows.retain(g, cached)
            windows.release(g, mine)
        return True

    def computed_to(self, table: PageTable, end: int, verified: int | None = None) -> None:
        """A forward wrote the table's KV up to position ``end``: its own published pages below it are now
        full of KV (whoever waits on them can go on).

        Its windows move past their first pages one step late, to where the previous forward ended (at most
        ``verified``, when positions past it are drafts that ``truncate`` may take back: a window that
        moved on cannot move back, its pages are gone). Late, because the pages a forward fills are
        published after it (``publish``): a page released before would go back to the pool, and its tree
        node could never end a hit; released after, it stays there as an idle part."""
        before, table.computed = table.computed, end
        nodes = self.tree.nodes
        for i in range(before // self.page_size, min(table.published, end // self.page_size)):
            nodes[table.pages[i]].computed = True
        if self.windows:
            self.windows.slide(
                table.window_from, table.pages, before if verified is None else min(before, verified)
            )

    def in_flight(self, table: PageTable) -> list[int]:
        """Pages ``table`` published to the tree before computing them: it is their only writer, and whoever
        matched them waits for it."""
        return table.pages[max(table.computed // self.page_size, table.own_from) : table.published]

    def dependents(self, table: PageTable, others: list[PageTable]) -> list[int]:
        """Indices of ``others`` waiting on a page ``table`` published but has not computed yet."""
        ps = self.page_size
        mine = set(self.in_flight(table))
        if not mine:
            return []
        return [
            j
            for j, o in enumerate(others)
            if o is not table and mine.intersection(o.pages[o.computed // ps : o.own_from])
        ]

    def truncate(self, table: PageTable, length: int) -> None:
        """Cut the table back to its first ``length`` positions (drafted tokens that were rejected): KV past
        them is forgotten and the pages wholly past them are released. Only what this table wrote and never
        published can go: cached pages hold verified context."""
        if length < table.published * self.page_size or length > table.computed:
            raise ValueError(
                f"cannot truncate to {length}: computed {table.computed}, published up to "
                f"{table.published * self.page_size}"
            )
        keep = self.pages_for(length)
        if self.windows:
            for g, w in self.windows.windows.items():
                if self.windows.first_page(length, w) < table.window_from.get(g, 0):
                    raise ValueError(
                        f"cannot truncate to {length}: the window's pages before it were released"
                    )
            self.windows.drop(table.window_from, table.pages, keep)
        self._drop(table.pages[keep:])
        del table.pages[keep:]
        del table.hashes[length // self.page_size :]
        table.computed = length

    def release(self, table: PageTable, tokens: list[int] | None) -> None:
        """Drop a table: its full computed pages go into the tree first when ``tokens`` is given (sharing
        on), so a later request can reuse them; the pages nobody else holds become idle or free. Pages it
        published but did not compute leave the tree (the caller first releases any table waiting on them)."""
        if tokens is not None:
            self.publish(table, tokens, table.computed)
        self._unpublish_uncomputed(table)
        self.tree.touch(table.pages[: table.published])
        if self.windows:
            self.windows.drop(table.window_from, table.pages)
            self.windows.drop_anchor(table.pages, table.anchor)
            table.window_from, table.anchor = {}, 0
        self._drop(table.pages)
        table.pages, table.computed, table.published, table.own_from = [], 0, 0, 0  # hashes stay: same tokens

    def _unpublish_uncomputed(self, table: PageTable) -> None:
        nodes, refs = self.tree.nodes, self.pool.refs
        while table.published > table.own_from and not nodes[table.pages[table.published - 1]].computed:
            node = nodes[table.pages[table.published - 1]]
            if node.children or refs[node.page] > 1:
                raise RuntimeError("a page in flight is released while another table waits on it")
            parent = node.parent
            self.windows.left_tree(node.page)
            self.tree.remove(node)
            table.published -= 1
            if parent.parent is not None and not parent.children and not refs[parent.page]:
                self.tree.went_idle(parent.page)

    # ---- KV events -------------------------------------------------------------------------------------
    def publish_events(self, sink: Callable[[list[PageEvent]], None]) -> None:
        """From now on the tree logs its changes; ``flush_events`` hands them to ``sink`` (the cached pages
        first, as stored)."""
        self.tree.record_events()
        self._event_sink = sink
        self.flush_events()

    def flush_events(self) -> None:
        """The tree's changes since the last flush to the sink (the engine calls this after each step,
        abort and cache reset)."""
        if self._event_sink is not None and (events := self.tree.drain_events()):
            self._event_sink(events)

    def evict_idle(self) -> int:
        """Evict every idle cached page (``reset_prefix_cache``), and every idle window page; returns how
        many table pages."""
        if self.windows:  # idle window pages first: idle leaves then have none left to account for
            while (part := self.windows.oldest_idle()) is not None:
                self.windows.evict(part[1], part[2])  # (the dead ends it reports go with the rest)
        gone = self.tree.clear_idle(self.pool.refs)
        self.idle -= len(gone)
        self.pool.free(gone)
        return len(gone)

    def give_back(self, pages: list[int]) -> None:
        """Release pages taken outside any table (a fork's ``reserve`` that was not used)."""
        if self.windows:
            self.windows.drop_all(pages)
        self._drop(pages)

    def _drop(self, pages: list[int]) -> None:
        dropped = self.pool.release(pages)
        cached = [p for p in dropped if p in self.tree]
        for p in cached:
            self.tree.went_idle(p)
        self.idle += len(cached)
        self.pool.free([p for p in dropped if p not in self.tree])
        if self.windows:  # a leaf nobody holds whose windows' pages are gone can never be hit: it goes
            for p in cached:
                if (node := self.tree.nodes.get(p)) is not None:
                    self._prune(node)

    # ---- forks and copies ----------------------------------------------------------------------------
    def fork(self, dst: PageTable, src: PageTable, upto: int, shared_pages: int, reserved: list[int]) -> None:
        """Make ``dst`` hold ``src``'s KV for positions [0, upto): its first ``shared_pages`` pages shared
        with ``src``, the rest copied into ``reserved`` (pages ``reserve`` gave the scheduler for it). What
        ``dst`` held before is released; it must not be writing pages in flight (their waiters would wait on
        a page nobody writes: the scheduler never forks such a table)."""
        ps = self.page_size
        if self.in_flight(dst):
            raise RuntimeError("a fork would drop pages in flight that its table still has to compute")
        end = self.pages_for(upto)
        if len(reserved) != end - shared_pages:
            raise RuntimeError(f"fork needs {end - shared_pages} reserved pages, got {len(reserved)}")
        shared = src.pages[:shared_pages]
        if shared_pages < end:
            dst_slots, src_slots = [], []
            for page, i in zip(reserved, range(shared_pages, end), strict=True):
                n = min(ps, upto - i * ps)
                dst_slots += range(page * ps, page * ps + n)
                src_slots += range(src.pages[i] * ps, src.pages[i] * ps + n)
            dev = self.pool.k.device
            self.pool.copy_slots(
                torch.tensor(dst_slots, device=dev, dtype=torch.long),
                torch.tensor(src_slots, device=dev, dtype=torch.long),
            )
        self._retain(shared)
        old, old_from, old_anchor = dst.pages, dst.window_from, dst.anchor
        dst.pages = shared + list(reserved)
        dst.computed = upto
        dst.published = min(shared_pages, src.published)
        dst.own_from = shared_pages
        if self.windows:
            dst.window_from = {}
            for g, w in self.windows.windows.items():
                lo = dst.window_from[g] = min(self.windows.first_page(upto, w), len(dst.pages))
                for i, p in enumerate(dst.pages):
                    if i < shared_pages and i >= lo:
                        self.windows.retain(g, p)  # a shared page its window reads
                    elif i >= shared_pages and i < lo:
                        self.windows.release(g, p)  # a fresh page wholly before its window
            self.windows.drop(old_from, old)
            self.windows.drop_anchor(old, old_anchor)
            dst.anchor = 0
        self._drop(old)

    # ---- checks -----------------------------------------------------------------------------------------
    def check(self, tables: list[PageTable]) -> None:
        """Assert every invariant (tests): each page is free, held or cached; its refcount equals the tables
        holding it; the idle count is right; tree nodes are full pages on their tables' paths."""
        pool, tree = self.pool, self.tree
        holders = [0] * len(pool.refs)
        for t in tables:
            for p in t.pages:
                holders[p] += 1
            assert t.computed <= len(t.pages) * self.page_size, "computed past the table's pages"
            for i in range(t.published):
                node = tree.nodes.get(t.pages[i])
                assert node is not None and node.depth == i, "a published page is not in the tree"
                assert node.parent.page == (t.pages[i - 1] if i else -1), "a page table is off its tree path"
        assert holders == pool.refs, "page refcounts differ from the page tables holding them"
        free = set()
        for start, length in zip(pool.allocator._starts, pool.allocator._lengths, strict=True):
            free.update(range(start, start + length))
        assert len(free) == pool.allocator.free
        beside = {}  # another group's page -> the table page it belongs to
        for group in pool.group_pages[1:]:
            for p, q in enumerate(group):
                if q >= 0:
                    assert q not in beside, f"page {q} belongs to two table pages"
                    beside[q] = p
        for p in range(len(pool.refs)):
            free_, held, cached = p in free, holders[p] > 0, p in tree
            if p in beside:  # taken and freed with its table page, which is in use
                lead = beside[p]
                assert not (free_ or held or cached) and (holders[lead] or lead in tree), f"page {p} is stray"
                continue
            assert free_ != (held or cached), f"page {p}: free={free_} held={held} cached={cached}"
        assert self.idle == sum(1 for p in tree.nodes if not holders[p]), "idle count is off"
        for node in tree.nodes.values():
            assert node.parent.children.get(node.hash) is node
        self._check_writers(tables)
        if self.windows:
            self.windows.check(tables, holders)

    def _check_writers(self, tables: list[PageTable]) -> None:
        """Every page in flight (in the tree, not computed) has exactly one live writer: the table that
        published it and computes it. Everyone else holding it waits for that writer, so a page in flight
        without one would keep its waiters waiting forever."""
        writers: dict[int, int] = {}
        for t in tables:
            for p in self.in_flight(t):
                writers[p] = writers.get(p, 0) + 1
        for page in writers:
            assert not self.tree.nodes[page].computed, f"page {page} is computed but its writer is not done"
        for page, node in self.tree.nodes.items():
            if not node.computed:
                assert writers.get(page, 0) == 1, (
                    f"page {page} (depth {node.depth}) is in flight with {writers.get(page, 0)} writers"
                )
