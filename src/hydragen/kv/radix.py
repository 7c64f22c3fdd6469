"""The prefix index: a radix tree whose edges are whole KV pages, so sharing is found from token ids.

Each node is one full page: its ``page_size`` token ids (the edge label), the pool page holding their KV,
and its parent, the page before it in every context through it. A path from the root is a cached prefix
of whole pages; two contexts that agree on their first k pages meet the same k nodes, and their page
tables hold the same k pages. Nothing is ever split inside a page: a page is immutable once full.

A node is *computed* once its KV is written. A node can be in the tree before that (prompt pages are
known when a request is admitted, and another request with the same prefix can then wait for them
instead of computing them again); such a node is only ever written by the sequence that published it.

Eviction is least recently used, leaves first: the tree keeps no hold on pages, so a cached page nobody
holds is *idle*, and every descendant of an idle page is idle too (a context that holds a page holds every
page before it). The tree evicts idle leaves until enough pages are freed.

When ``record_events()`` was called, the tree also keeps a log of what entered and left it (``PageEvent``,
drained by the engine after each step), naming pages by their chained hash (``kv.page_hash``) so that a
router in another process can match token ids against this cache exactly.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from hydragen.kv.page_hash import page_hash

_clock = itertools.count(1)


@dataclass(eq=False)
class PageNode:
    page: int  # pool page (-1 for the root)
    key: tuple[int, ...]  # the page's token ids
    parent: PageNode | None
    depth: int  # the page's index in every page table through it
    children: dict[tuple[int, ...], PageNode] = field(default_factory=dict)
    computed: bool = False
    last_used: int = 0
    hash: int | None = None  # chained page hash, set while the tree records events


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
        self.root = PageNode(-1, (), None, -1, computed=True)
        self.nodes: dict[int, PageNode] = {}  # page -> node
        self._idle: list[tuple[int, int, int, PageNode]] = []  # (last_used, -depth, tie, node) heap
        self.events: list[PageEvent] | None = None  # None: not recording

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
        node.hash = page_hash(parent, node.key)
        self.events.append(PageEvent(True, node.hash, parent, node.key))

    def __contains__(self, page: int) -> bool:
        return page in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def key(self, tokens: list[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.page_size : (index + 1) * self.page_size])

    def match(self, tokens: list[int], max_pages: int | None = None) -> list[PageNode]:
        """Nodes of the longest cached prefix of ``tokens`` in whole pages (computed or in flight)."""
        limit = len(tokens) // self.page_size
        if max_pages is not None:
            limit = min(limit, max_pages)
        out, node = [], self.root
        for i in range(limit):
            node = node.children.get(self.key(tokens, i))
            if node is None:
                break
            out.append(node)
        return out

    def add(self, parent: PageNode, page: int, key: tuple[int, ...], computed: bool) -> PageNode:
        """The child of ``parent`` with ``key``: the existing one (a page already holding those tokens, which
        the caller may switch to), or a new node for ``page``."""
        node = parent.children.get(key)
        if node is not None:
            return node
        if page in self.nodes:
            raise RuntimeError(f"KV page {page} is already in the prefix tree")
        node = PageNode(page, key, parent, parent.depth + 1, computed=computed, last_used=next(_clock))
        parent.children[key] = node
        self.nodes[page] = node
        if self.events is not None:
            self._stored(node)
        return node

    def remove(self, node: PageNode) -> None:
        """Drop a leaf (evicted, or never computed by its writer)."""
        if node.children:
            raise RuntimeError("only a leaf of the prefix tree can be removed")
        del node.parent.children[node.key]
        del self.nodes[node.page]
        if self.events is not None and node.hash is not None:
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

    def evict(self, wanted: int, refs: list[int]) -> list[int]:
        """Remove up to ``wanted`` idle pages, least recently used leaves first; returns their pages."""
        out: list[int] = []
        while self._idle and len(out) < wanted:
            last_used, _, _, node = heapq.heappop(self._idle)
            if (
                self.nodes.get(node.page) is not node
                or refs[node.page]
                or node.children
                or last_used != node.last_used
            ):
                continue  # held again, already gone, not a leaf yet, or a stale entry
            parent = node.parent
            self.remove(node)
            out.append(node.page)
            if parent.parent is not None and not parent.children and not refs[parent.page]:
                self.went_idle(parent.page)
        return out

    def clear_idle(self, refs: list[int]) -> list[int]:
        """Evict every idle page (``reset_prefix_cache``)."""
        for page, node in list(self.nodes.items()):
            if not refs[page] and not node.children:
                self.went_idle(page)
        return self.evict(len(self.nodes), refs)
