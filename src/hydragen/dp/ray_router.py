"""Ray Serve's request router on hydragen's ``Router``: each request goes to the replica whose prefix cache
holds the longest part of its prompt (``dp.router``, policy ``cache``), as the replicas' KV events say.

Ray Serve builds one of these per deployment handle, in the process that holds the handle (our ingress
replica), and asks ``choose_replicas`` for every request. Everything the router needs comes through Ray:

* The replicas' KV-event addresses: each replica returns them from ``record_replica_metadata`` (captured
  once when it is ready, sent to routers with the replica's info), and ``update_replicas`` subscribes to
  every new replica's events and drops those of replicas that left (its cache is forgotten).
* The request's prompt token ids: the ingress computes them (``dp.prompts``) and passes them as the
  ``route`` keyword of the handle call, which the router reads from ``PendingRequest.kwargs``; with them,
  the replicas that already refused the request (503: their engine failed or is stalled), which the
  router passes over unless no other is left.
* Load: a request counts as in flight from ``on_request_routed`` (the replica accepted it) to
  ``on_request_completed``. Both hooks run with Ray Serve's default strict ``max_ongoing_requests``;
  inside a Ray *client* context Ray skips the first one, and routing then goes on the cache alone.

``choose_replicas`` answers in ranks: the router's choice first, then the others by load, so a choice
whose queue is full (``max_ongoing_requests``) falls through to the next one instead of waiting.
Ray's replicas come and go (restarts, autoscaling); the ``Router`` has a fixed number of *slots*, one per
replica alive at a time (``max_replicas``). A replica beyond them is still routed to, by load only.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hydragen.dp.kv_events import KVEventSubscriber
from hydragen.dp.router import NoReplica, Route, Router, RouteRequest

log = logging.getLogger("hydragen.dp")
ROUTE_KWARG = "route"  # the handle call's keyword: {"token_ids": [...], "text": "...", REFUSED_KEY: [...]}
REFUSED_KEY = "refused"  # the unique ids of the replicas that refused the request
KV_EVENTS_KEY = "hydragen_kv_events"  # replica metadata: {"endpoint": ..., "replay_endpoint": ...}
CHOSEN_KEPT = 4096  # choices awaiting Ray's on_request_routed, oldest dropped beyond this

_live: weakref.WeakSet[HydragenRequestRouter] = weakref.WeakSet()  # for the ingress's /metrics


class HydragenRequestRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = "cache",
        balance_bound: int = 4,
        max_replicas: int = 1,
        page_size: int | None = None,
        **_: Any,
    ) -> None:
        """Called by Ray Serve with ``RequestRouterConfig.request_router_kwargs``."""
        self.router = Router(max(1, max_replicas), policy, balance_bound, page_size=page_size)
        self.slots: dict[ReplicaID, int] = {}
        self.subscribers: dict[ReplicaID, KVEventSubscriber] = {}
        self.chosen: dict[str, Route] = {}  # internal request id -> the router's choice (not yet sent)
        self.in_flight: dict[str, Route] = {}  # internal request id -> accepted by that replica
        for slot in range(len(self.router.replicas)):
            self.router.set_healthy(slot, False)
        # Ray pickles this module *by value* into the handle's process, so its globals there are copies:
        # register with the module as imported in that process, where the ingress looks.
        from hydragen.dp import ray_router

        ray_router._live.add(self)

    # ---- the replica set ---------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id: r for r in replicas}
        for gone in [rid for rid in self.slots if rid not in current]:
            self._release(gone)
        for rid, replica in current.items():
            if rid not in self.slots:
                self._admit(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._release(replica_id)

    def _admit(self, replica: RunningReplica) -> None:
        free = sorted(set(range(len(self.router.replicas))) - set(self.slots.values()))
        if not free:
            log.warning("%s: no router slot left (max_replicas); routed by load only", replica.replica_id)
            return
        slot = self.slots[replica.replica_id] = free[0]
        self.router.clear(slot)
        self.router.set_healthy(slot, True)
        events = replica.replica_metadata.get(KV_EVENTS_KEY)
        if not events:
            log.warning("%s publishes no KV events: routed without its cache", replica.replica_id)
            return
        self.subscribers[replica.replica_id] = KVEventSubscriber(
            events["endpoint"],
            lambda batch: self.router.apply(slot, batch),
            replay_endpoint=events.get("replay_endpoint"),
            on_reset=lambda: self.router.clear(slot),
        )

    def _release(self, replica_id: ReplicaID) -> None:
        slot = self.slots.pop(replica_id, None)
        subscriber = self.subscribers.pop(replica_id, None)
        if subscriber is not None:
            subscriber.close()
        if slot is not None:
            self.router.set_healthy(slot, False)
            self.router.clear(slot)

    # ---- choosing --------------------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Our ranks name every candidate: when all are full, wait before asking again (no busy loop).
            pending_request.routing_context.should_backoff = True
        refused = refused_by(pending_request)
        willing = [r for r in candidate_replicas if r.replica_id.unique_id not in refused]
        candidate_replicas = willing or candidate_replicas  # all refused: offered again, their 503 stands
        by_slot = {self.slots[r.replica_id]: r for r in candidate_replicas if r.replica_id in self.slots}
        if not by_slot:
            return [[r] for r in self._by_load(candidate_replicas)]
        passed_over = frozenset(
            slot for rid, slot in self.slots.items() if rid.unique_id in refused and slot not in by_slot
        )
        try:
            route = self.router.choose(route_request(pending_request), passed_over)
        except NoReplica:
            return [[r] for r in self._by_load(candidate_replicas)]
        if pending_request is not None:
            self.chosen[pending_request.metadata.internal_request_id] = route
            while len(self.chosen) > CHOSEN_KEPT:  # requests cancelled before Ray sent them are never routed
                self.chosen.pop(next(iter(self.chosen)))
        first = by_slot.get(route.replica)
        rest = [r for r in candidate_replicas if r is not first]
        return ([[first]] if first is not None else []) + [[r] for r in self._by_load(rest)]

    def _by_load(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """Fewest requests in flight first (the router's count; Ray's queue-length cache otherwise)."""
        loads = {slot: state.in_flight for slot, state in enumerate(self.router.replicas)}

        def load(r: RunningReplica) -> int:
            slot = self.slots.get(r.replica_id)
            if slot is not None:
                return loads[slot]
            return self.replica_queue_len_cache.get(r.replica_id) or 0

        return sorted(replicas, key=load)

    # ---- requests in flight --------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        route = self.chosen.pop(request_id, None)
        slot = self.slots.get(replica_id)
        if slot is None:
            return
        if route is None or route.replica != slot:  # a fallback rank took it: it will store the same pages
            route = Route(slot, 0, "full", route.pending if route is not None else [])
        self.router.started(route)
        self.in_flight[request_id] = route

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.chosen.pop(internal_request_id, None)
        route = self.in_flight.pop(internal_request_id, None)
        if route is not None:
            self.router.finished(route)

    def snapshot(self) -> list[dict]:
        """The router's per-slot figures, each with the id of the replica holding the slot (or None)."""
        holders = {slot: rid.unique_id for rid, slot in self.slots.items()}
        return [{**row, "replica_id": holders.get(row["replica"])} for row in self.router.snapshot()]


def route_request(pending: PendingRequest | None) -> RouteRequest:
    """The prompt the ingress attached to the call; an empty one (routed by load) when there is none."""
    route = pending.kwargs.get(ROUTE_KWARG) if pending is not None else None
    if not route:
        return RouteRequest(token_ids=[])
    return RouteRequest(token_ids=list(route.get("token_ids") or []), text=route.get("text") or "")


def refused_by(pending: PendingRequest | None) -> set[str]:
    """The unique ids of the replicas that refused this request already (the ingress says)."""
    route = pending.kwargs.get(ROUTE_KWARG) if pending is not None else None
    return set((route or {}).get(REFUSED_KEY) or ())


def live_routers() -> list[HydragenRequestRouter]:
    """The routers of this process (the ingress renders their figures on /metrics)."""
    return list(_live)
