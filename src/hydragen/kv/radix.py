"""The prefix index: a radix tree whose edges are whole KV pages, keyed by the pages' chained hashes.

Each node is one full page: its ``page_size`` token ids, its chained hash (``kv.page_hash``: the tokens
hashed with the hash of the page before them, so a hash names a whole prefix), where its KV lives and its
parent, the page before it in every context through it. A path from the root is a cached prefix of whole
pages; two contexts that agree on their first k pages meet the same k nodes. Nothing is ever split inside
a page: a page is immutable once full.

Children are found by hash, and a hit is checked against the node's tokens: two different pages whose
63-bit hashes collide never share KV (the second is simply not cached). The same hashes name the pages in
KV events, the data-parallel router and the disk tier, so they all share one identity. A request's cache
salt seeds its chain (``page_hash.chain_root``): requests with different salts never meet in the tree.

A node has a *location*: today every node's KV is in the page pool (``Location.POOL``, ``page`` is its pool
page). A tier that keeps KV elsewhere adds its own location; matching then finds such nodes too, and the
KV manager decides what it can use of them.

A node is *computed* once its KV is written. A node can be in the tree before that (prompt pages are
known when a request is admitted, and another request with the same prefix can then wait for them
instead of computing them again); such a node is only ever written by the sequence that published it.

Eviction is least recently used, leaves first: the tree keeps no hold on pages, so a cached page nobody
holds is *idle*, and every descendant of an idle page is idle too (a context that holds a page holds every
page before it). The tree evicts idle leaves until enough pages are freed.

When ``record_events()`` was called, the tree also keeps a log of what entered and left it (``PageEvent``,
drained by the engine after each step), so that a router in another process can match token ids against
this cache exactly.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum

_clock = itertools.count(1)


def tick() -> int:
    """The next time on the tree's LRU clock (window pages' idle parts share it: kv/window_pages.py)."""
    return next(_clock)


class Location(Enum):
    """Where a cached page's KV is."""

    POOL = "pool"  # in the page pool, at ``PageNode.page``


@dataclass(eq=False)
class PageNode:
    hash: int  # chained page hash: names the whole prefix up to and including this page (-1: the root)
    tokens: tuple[int, ...]  # the page's token ids (a hit is checked against them)
    page: int  # pool page when ``location`` is POOL (-1 for the root)
    parent: PageNode | None
    depth: int  # the page's index in every page table through it
    location: Location = Location.POOL
    children: dict[int, PageNode] = field(default_factory=dict)  # by hash
    computed: bool = False
    last_used: int = 0


@dataclass(frozen=True)
class PageEvent:
    """A page entered the tree (``stored``: its tokens and its parent's hash) or left it (``removed``)."""

    stored: bool
    hash: int
    parent_hash: int | None = None
    tokens: tuple[int, ...] = ()


class PrefixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = PageNode(-1, (), -1, None, -1, computed=True)
        self.nodes: dict[int, PageNode] = {}  # pool page -> node
        self._idle: list[tuple[int, int, int, PageNode]] = []  # (last_used, -depth, tie, node) heap
        self.events: list[PageEvent] | None = None  # None: not recording
        self.outside_pool = 0  # nodes whose KV is elsewhere (none until a tier puts some there)

    def record_events(self) -> None:
        """Start logging pages stored and removed; a page already cached is reported as stored first."""
        self.events = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self._stored(node)
            stack += node.children.values()

    def drain_events(self) -> list[PageEvent]:
        """The events since the last drain, oldest first (a parent's ``stored`` before its children's)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def _stored(self, node: PageNode) -> None:
        parent = node.parent.hash if node.parent is not self.root else None
        self.events.append(PageEvent(True, node.hash, parent, node.tokens))

    def __contains__(self, page: int) -> bool:
        return page in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def match(self, tokens: list[int], hashes: list[int]) -> list[PageNode]:
        """Nodes of the longest cached prefix of ``tokens`` whose chained page hashes are ``hashes`` (one per
        page to look for), computed or in flight; a node whose tokens differ (a hash collision) ends it."""
        ps, out, node, lo = self.page_size, [], self.root, 0
        for h in hashes:
            node = node.children.get(h)
            if node is None or node.tokens != tuple(tokens[lo : lo + ps]):
                break
            out.append(node)
            lo += ps
        return out

    def add(
        self, parent: PageNode, page: int, hash_: int, tokens: tuple[int, ...], computed: bool
    ) -> PageNode:
        """The child of ``parent`` with ``hash_``: the existing one (a page already holding those tokens,
        which the caller may switch to, or another page whose hash collides: the caller checks its
        tokens), or a new node for ``page``."""
        node = parent.children.get(hash_)
        if node is not None:
            return node
        if page in self.nodes:
            raise RuntimeError(f"KV page {page} is already in the prefix tree")
        node = PageNode(
            hash_, tokens, page, parent, parent.depth + 1, computed=computed, last_used=next(_clock)
        )
        parent.children[hash_] = node
        self.nodes[page] = node
        if self.events is not None:
            self._stored(node)
        return node

    def relocate(self, node: PageNode, location: Location) -> None:
        """Record that a node's KV moved (a tier that keeps KV outside the pool calls this)."""
        self.outside_pool += (location is not Location.POOL) - (node.location is not Location.POOL)
        node.location = location

    def remove(self, node: PageNode) -> None:
        """Drop a leaf (evicted, or never computed by its writer)."""
        if node.children:
            raise RuntimeError("only a leaf of the prefix tree can be removed")
        del node.parent.children[node.hash]
        del self.nodes[node.page]
        self.outside_pool -= node.location is not Location.POOL
        if self.events is not None:
            self.events.append(PageEvent(False, node.hash))

    def touch(self, pages: list[int]) -> None:
        """Mark pages as just used (LRU); deeper pages get older times so a path is evicted from its end."""
        now = next(_clock)
        for p in pages:
            node = self.nodes.get(p)
            if node is not None:
                node.last_used = now

    def went_idle(self, page: int) -> None:
        """A cached page nobody holds: a candidate for eviction."""
        node = self.nodes[page]
        heapq.heappush(self._idle, (node.last_used, -node.depth, next(_clock), node))

    def oldest_idle_leaf(self, refs: list[int]) -> PageNode | None:
        """The least recently used idle leaf (left in the tree), or None when there is none."""
        while self._idle:
            last_used, _, _, node = self._idle[0]
            if (
                self.nodes.get(node.page) is not node
                or refs[node.page]
                or node.children
                or last_used != node.last_used
            ):
                heapq.heappop(self._idle)  # held again, already gone, not a leaf yet, or a stale entry
                continue
            return node
        return None

    def evict_leaf(self, node: PageNode, refs: list[int]) -> None:
        """Remove an idle leaf; its parent, now an idle leaf, becomes a candidate."""
        parent = node.parent
        self.remove(node)
        if parent.parent is not None and not parent.children and not refs[parent.page]:
            self.went_idle(parent.page)

    def evict(self, wanted: int, refs: list[int]) -> list[int]:
        """Remove up to ``wanted`` idle pages, least recently used leaves first; returns their pages."""
        out: list[int] = []
        while len(out) < wanted and (node := self.oldest_idle_leaf(refs)) is not None:
            self.evict_leaf(node, refs)
            out.append(node.page)
        return out

    def clear_idle(self, refs: list[int]) -> list[int]:
        """Evict every idle page (``reset_prefix_cache``)."""
        for page, node in list(self.nodes.items()):
            if not refs[page] and not node.children:
                self.went_idle(page)
        return self.evict(len(self.nodes), refs)
