"""Token radix tree over cached KV: discovers shared prefixes, stores each once, evicts LRU leaves.

Each node holds a run of tokens and, once prefill starts, the slot runs that store their KV (pages of
the pool, ideally consecutive). Splitting a node at token k splits its slot runs at k, so no KV moves;
a page cut in two is then held by both halves. Running sequences pin the nodes on their path with
reference counts; only unpinned leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from hydragen.kv.pool import PagePool, Runs, split_runs

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]
    parent: Node | None
    start_pos: int  # absolute position of tokens[0] in every sequence through this node
    runs: Runs = field(default_factory=list)  # slot runs covering len(tokens) slots; [] until allocated
    filled: int = 0  # tokens whose KV is computed (prefill may take several chunks)
    children: dict[int, Node] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)

    @property
    def allocated(self) -> bool:
        return bool(self.runs)

    @property
    def has_kv(self) -> bool:
        return self.allocated and self.filled == len(self.tokens)

    def path(self) -> list[Node]:
        """Ancestors from the root's first child down to self (the root itself excluded)."""
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        return nodes[::-1]


class RadixTree:
    def __init__(self, pool: PagePool | None = None):
        self.root = Node(tokens=[], parent=None, start_pos=0)
        self.pool = pool
        self.cached_tokens = 0  # tokens whose KV slots the tree holds

    def insert(self, tokens: list[int]) -> Node:
        """Make ``tokens`` a path of the tree (splitting where needed) and return its last node.

        New nodes have no KV yet; the caller allocates and prefills them parent-first.
        """
        node, n = self.root, 0
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                new = Node(tokens=list(tokens[n:]), parent=node, start_pos=n)
                node.children[tokens[n]] = new
                return new
            k = _common(child.tokens, tokens, n)
            if k < len(child.tokens):
                child = self._split(child, k)
            node, n = child, n + k
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after k tokens; returns the new upper half, which takes node's place."""
        upper_runs, lower_runs = split_runs(node.runs, k) if node.runs else ([], [])
        upper = Node(
            tokens=node.tokens[:k],
            parent=node.parent,
            start_pos=node.start_pos,
            runs=upper_runs,
            filled=min(node.filled, k),
            refs=node.refs,
            last_used=node.last_used,
        )
        if self.pool is not None and node.runs:
            # A page cut in two is held by both halves.
            self.pool.retain(self.pool.pages(upper_runs) & self.pool.pages(lower_runs))
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[k:]
        node.start_pos += k
        node.filled = max(0, node.filled - k)
        node.runs = lower_runs
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def split_at(self, node: Node, position: int) -> None:
        """Make a node boundary fall at absolute ``position`` inside ``node`` (its KV does not move)."""
        if node.start_pos < position < node.end_pos:
            self._split(node, position - node.start_pos)

    def assign_kv(self, node: Node, runs: Runs, filled: int | None = None) -> None:
        """Give ``node`` the slot runs (already held for it); ``filled`` tokens already hold KV."""
        node.runs = runs
        node.filled = len(node.tokens) if filled is None else filled
        self.cached_tokens += len(node.tokens)

    def match_len(self, tokens: list[int]) -> int:
        """Length of the longest cached prefix of ``tokens``, without modifying the tree."""
        node, n = self.root, 0
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = _common(child.tokens, tokens, n)
            n += min(k, child.filled if child.allocated else 0)
            if k < len(child.tokens) or not child.has_kv:
                break
            node = child
        return n

    def pin(self, node: Node, delta: int) -> None:
        """Add ``delta`` references along the path to ``node`` and refresh its LRU time."""
        now = next(_clock)
        while node is not None and node.parent is not None:
            node.refs += delta
            node.last_used = now
            node = node.parent

    def remove(self, node: Node) -> None:
        """Detach a leaf and release its pages."""
        assert not node.children, "only leaves can be removed"
        del node.parent.children[node.tokens[0]]
        if node.runs:
            self.cached_tokens -= len(node.tokens)
            if self.pool is not None:
                self.pool.release(self.pool.pages(node.runs))
        node.runs, node.filled = [], 0

    def evict(self, free_pages_wanted: int) -> int:
        """Remove unpinned leaves, LRU first, until the pool has ``free_pages_wanted`` free pages (or
        nothing is left to evict). Returns the tokens removed."""
        heap = [(n.last_used, id(n), n) for n in self.leaves() if n.refs == 0]
        heapq.heapify(heap)
        removed = 0
        while heap and (self.pool is None or self.pool.allocator.free < free_pages_wanted):
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            removed += len(leaf.tokens) if leaf.runs else 0
            self.remove(leaf)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return removed

    def evict_all(self) -> int:
        """Remove every unpinned prefix (reset_prefix_cache). Returns the tokens removed."""
        return self.evict(self.pool.num_pages + 1 if self.pool is not None else 0)

    def evictable_pages(self) -> int:
        """Pages that evicting every unpinned node would free (pins cover whole paths)."""
        if self.pool is None:
            return 0
        free, kept, stack = set(), set(), [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None and n.runs:
                (free if n.refs == 0 else kept).update(self.pool.pages(n.runs))
        return len(free - kept)

    def leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.parent is not None:
                out.append(n)
        return out

    def clear(self) -> None:
        while self.root.children:
            for leaf in self.leaves():
                self.remove(leaf)


def _common(node_tokens: list[int], tokens: list[int], offset: int) -> int:
    n = min(len(node_tokens), len(tokens) - offset)
    i = 0
    while i < n and node_tokens[i] == tokens[offset + i]:
        i += 1
    return i
