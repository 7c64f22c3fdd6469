"""Choosing a replica for each request: on what the replicas' caches really hold, or by a simpler policy.

``cache`` (the default) follows every replica's prefix cache through its KV events (``dp.kv_events``): a
set of page hashes per replica. A request's prompt is hashed page by page the same way, and each replica's
match is the number of leading pages it holds, or will hold because a request the router sent it is
computing them now (*pending*: a replica publishes a prompt's pages at admission, which can be after the
next request with the same prefix arrives). A match under ``min_match`` of the prompt's pages counts as
none (a chat template's first page in common is no reason to pile requests up). The longest match wins,
unless that replica has more than ``balance_bound`` requests in flight beyond the least-loaded one: then
the least-loaded one takes it.
A chat's next turn carries the previous turns as its prefix, so a session stays on the replica holding
its history for as long as that replica holds it.

The baselines: ``round-robin``; ``least-loaded`` (fewest in flight); ``approx``, the approximate policy of
SGLang's router: a per-replica tree of the *text* of requests routed there (in 64-character blocks, a
bounded LRU), which never learns of evictions.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from hydragen.dp.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from hydragen.kv.page_hash import page_hashes

POLICIES = ("cache", "approx", "round-robin", "least-loaded")
TEXT_BLOCK = 64  # characters per block of the approximate policy's text tree


class NoReplica(RuntimeError):
    """No healthy replica to take the request."""


@dataclass
class RouteRequest:
    token_ids: list[int]  # the exact prompt token ids the replica will see
    text: str = ""  # the prompt text (for the approximate policy)
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def hashes(self, page_size: int) -> list[int]:
        if page_size not in self._hashes:
            self._hashes[page_size] = page_hashes(self.token_ids, page_size)
        return self._hashes[page_size]


@dataclass
class Route:
    replica: int
    matched_tokens: int  # prompt tokens the chosen replica is known to hold (0 for policies without a cache)
    reason: str  # cache, balance, no-match, round-robin, least-loaded, approx
    pending: list[int] = field(default_factory=list, repr=False)  # page hashes added to the replica's pending
    run: int | None = field(default=None, repr=False)  # the replica's run it was counted on (``started``)


class ReplicaState:
    def __init__(self, approx_capacity: int):
        self.healthy = True
        self.in_flight = 0
        self.routed: Counter[str] = Counter()
        self.matched_tokens = 0
        self.cached: set[int] = set()  # page hashes its events say it holds
        self.pending: Counter[int] = Counter()  # page hashes requests in flight there will store
        self.page_size: int | None = None
        self.text: OrderedDict[int, None] = OrderedDict()  # approx: text-block hashes, LRU order
        self.text_capacity = approx_capacity
        # Bumped whenever the cache is forgotten (a restart): a request counted on an earlier run takes
        # its pages off nothing when it ends, as the pending count it added to is gone.
        self.run = 0

    def apply(self, event) -> None:
        if isinstance(event, BlockStored):
            self.page_size = event.block_size
            self.cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.cached.clear()

    def match_pages(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached and not self.pending[h]:
                break
            n += 1
        return n

    def match_text(self, blocks: list[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.text:
                break
            n += 1
        return n

    def insert_text(self, blocks: list[int]) -> None:
        for h in blocks:
            self.text[h] = None
            self.text.move_to_end(h)
        while len(self.text) > self.text_capacity:
            self.text.popitem(last=False)


class Router:
    """Thread-safe: KV events arrive on subscriber threads, choices are made on the server's loop."""

    def __init__(
        self,
        replicas: int,
        policy: str = "cache",
        balance_bound: int = 4,
        page_size: int | None = None,
        min_match: float = 0.1,
        approx_capacity: int = 1 << 16,
    ):
        """``page_size``: the replicas' KV page size, if known before their first event (their events say).
        ``min_match``: a match below this fraction of the prompt's pages (or text blocks) counts as none, so
        prompts that share only a template's first page are balanced, not piled onto one replica."""
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {replicas}")
        if balance_bound < 0:
            raise ValueError(f"balance_bound must be >= 0, got {balance_bound}")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        self.policy, self.balance_bound, self.page_size = policy, balance_bound, page_size
        self.min_match = min_match
        self.replicas = [ReplicaState(approx_capacity) for _ in range(replicas)]
        self._lock = threading.Lock()
        self._next = 0  # round-robin position

    # ---- what the replicas say -------------------------------------------------------------------------
    def apply(self, replica: int, batch: KVEventBatch) -> None:
        with self._lock:
            state = self.replicas[replica]
            for event in batch.events:
                state.apply(event)

    def clear(self, replica: int) -> None:
        """Forget a replica's cache (it restarted, or its event stream started again)."""
        with self._lock:
            state = self.replicas[replica]
            state.cached.clear()
            state.pending.clear()
            state.text.clear()
            state.run += 1

    def set_healthy(self, replica: int, healthy: bool) -> None:
        with self._lock:
            self.replicas[replica].healthy = healthy

    # ---- choosing ----------------------------------------------------------------------------------------
    def choose(self, request: RouteRequest, exclude: frozenset[int] = frozenset()) -> Route:
        """The replica for ``request`` among the healthy ones not in ``exclude`` (NoReplica: none)."""
        with self._lock:
            live = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
            if not live:
                raise NoReplica("no replica is healthy")
            if self.policy == "round-robin":
                route = Route(self._rotate(live), 0, "round-robin")
            elif self.policy == "least-loaded":
                route = Route(self._least_loaded(live, {}), 0, "least-loaded")
            elif self.policy == "approx":
                route = self._choose_approx(live, request)
            else:
                route = self._choose_cached(live, request)
            state = self.replicas[route.replica]
            state.routed[route.reason] += 1
            state.matched_tokens += route.matched_tokens
            return route

    def _rotate(self, live: list[int]) -> int:
        for k in range(len(self.replicas)):
            i = (self._next + k) % len(self.replicas)
            if i in live:
                self._next = i + 1
                return i
        raise AssertionError("unreachable: live is not empty")

    def _least_loaded(self, live: list[int], match: dict[int, int]) -> int:
        """Fewest in flight; ties: longest match, then round-robin order (spreads an idle start)."""
        low = min(self.replicas[i].in_flight for i in live)
        tied = [i for i in live if self.replicas[i].in_flight == low]
        best = max(match.get(i, 0) for i in tied)
        tied = [i for i in tied if match.get(i, 0) == best]
        return tied[0] if len(tied) == 1 else self._rotate(tied)

    def _pick(self, live: list[int], match: dict[int, int], total: int, reason: str) -> tuple[int, str]:
        """The longest match unless it is overloaded beyond the bound (then the least loaded)."""
        match = {i: m if m and m >= self.min_match * total else 0 for i, m in match.items()}
        least = self._least_loaded(live, match)
        top = max(match.values())
        if top == 0:
            return least, "no-match"
        loads = {i: self.replicas[i].in_flight for i in live}
        best = min((i for i in live if match[i] == top), key=lambda i: (loads[i], i))
        if loads[best] > loads[least] + self.balance_bound:
            return least, "balance"
        return best, reason

    def _choose_cached(self, live: list[int], request: RouteRequest) -> Route:
        sizes = {self.replicas[i].page_size for i in live} - {None}
        size = sizes.pop() if len(sizes) == 1 else self.page_size  # one deployment: one page size
        hashes = request.hashes(size) if size else []
        match = {i: self.replicas[i].match_pages(hashes) for i in live}
        replica, reason = self._pick(live, match, len(hashes), "cache")
        return Route(replica, match[replica] * (size or 0), reason, hashes)

    def _choose_approx(self, live: list[int], request: RouteRequest) -> Route:
        blocks = text_blocks(request.text)
        match = {i: self.replicas[i].match_text(blocks) for i in live}
        replica, reason = self._pick(live, match, len(blocks), "approx")
        self.replicas[replica].insert_text(blocks)
        return Route(replica, 0, reason)

    # ---- requests in flight ------------------------------------------------------------------------------
    def started(self, route: Route) -> None:
        with self._lock:
            state = self.replicas[route.replica]
            state.in_flight += 1
            state.pending.update(route.pending)
            route.run = state.run

    def finished(self, route: Route) -> None:
        with self._lock:
            state = self.replicas[route.replica]
            state.in_flight = max(0, state.in_flight - 1)
            if route.run == state.run:
                state.pending.subtract(route.pending)
                state.pending = +state.pending  # drop zero counts

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "replica": i,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "routed": dict(r.routed),
                    "cached_pages": len(r.cached),
                    "matched_tokens": r.matched_tokens,
                }
                for i, r in enumerate(self.replicas)
            ]


def text_blocks(text: str) -> list[int]:
    """Chained hashes of the text's whole 64-character blocks (the approximate policy's tree path)."""
    out: list[int] = []
    h = hashlib.blake2b(digest_size=8)
    for start in range(0, len(text) - TEXT_BLOCK + 1, TEXT_BLOCK):
        h.update(text[start : start + TEXT_BLOCK].encode())
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out
