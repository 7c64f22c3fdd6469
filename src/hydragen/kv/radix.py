"""Token radix tree over cached KV: discovers shared prefixes, stores each once, evicts LRU leaves.

Each node holds a run of tokens and (once prefilled) the contiguous run of KV slots that stores them.
Splitting a node at token k splits its slot run at k, so no KV moves. Running sequences pin the nodes
on their path with reference counts; only unpinned leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]
    parent: Node | None
    start_pos: int  # absolute position of tokens[0] in every sequence through this node
    slot: int = -1  # first KV slot, -1 until prefill starts
    filled: int = 0  # tokens whose KV is computed (prefill may take several chunks)
    children: dict[int, Node] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)

    @property
    def has_kv(self) -> bool:
        return self.slot >= 0 and self.filled == len(self.tokens)

    def path(self) -> list[Node]:
        """Ancestors from the root's first child down to self (the root itself excluded)."""
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        return nodes[::-1]


class RadixTree:
    def __init__(self, pool=None):
        self.root = Node(tokens=[], parent=None, start_pos=0)
        self.pool = pool
        self.cached_tokens = 0  # tokens whose KV the tree holds

    def insert(self, tokens: list[int]) -> Node:
        """Make ``tokens`` a path of the tree (splitting where needed) and return its last node.

        New nodes have no KV yet (slot -1); the caller prefills them parent-first.
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
        upper = Node(
            tokens=node.tokens[:k],
            parent=node.parent,
            start_pos=node.start_pos,
            slot=node.slot,
            filled=min(node.filled, k),
            refs=node.refs,
            last_used=node.last_used,
        )
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[k:]
        node.start_pos += k
        node.filled = max(0, node.filled - k)
        if node.slot >= 0:
            node.slot += k
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def split_at(self, node: Node, position: int) -> None:
        """Make a node boundary fall at absolute ``position`` inside ``node`` (its KV does not move)."""
        if node.start_pos < position < node.end_pos:
            self._split(node, position - node.start_pos)

    def assign_kv(self, node: Node, slot: int, filled: int | None = None) -> None:
        """Give ``node`` the slot run starting at ``slot``; ``filled`` tokens of it already hold KV."""
        node.slot = slot
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
            n += min(k, child.filled if child.slot >= 0 else 0)
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
        """Detach a leaf and free its KV."""
        assert not node.children, "only leaves can be removed"
        del node.parent.children[node.tokens[0]]
        if node.slot >= 0:
            self.cached_tokens -= len(node.tokens)
            if self.pool is not None:
                self.pool.release(node.slot, len(node.tokens))
        node.slot, node.filled = -1, 0

    def evict(self, n_tokens: int) -> int:
        """Free at least ``n_tokens`` of cached KV from unpinned leaves, LRU first. Returns tokens freed."""
        heap = [(n.last_used, id(n), n) for n in self.leaves() if n.refs == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.tokens) if leaf.slot >= 0 else 0
            self.remove(leaf)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def evictable_tokens(self) -> int:
        """Cached tokens no running sequence pins (pins cover whole paths, so these are all reachable)."""
        total, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None and n.refs == 0 and n.slot >= 0:
                total += len(n.tokens)
        return total

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
