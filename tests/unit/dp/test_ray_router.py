"""Ray Serve's request router on hydragen's Router (``dp.ray_router``), without a Ray cluster: Ray's router
class driven as Ray Serve drives it (replica updates, choices, routed/completed hooks), fake replicas that
publish real KV events over loopback ZMQ."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray", reason="Ray Serve is an optional dependency (pip install hydragen[ray])")
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest  # noqa: E402

from hydragen.dp.kv_events import BlockStored, KVEventPublisher  # noqa: E402
from hydragen.dp.ray_router import KV_EVENTS_KEY, HydragenRequestRouter, live_routers  # noqa: E402
from hydragen.kv.page_hash import page_hashes  # noqa: E402

P = 4  # page size
DEPLOYMENT = DeploymentID(name="HydragenReplica", app_name="hydragen")
PREFIX = list(range(100, 132))  # 8 pages


class FakeReplica:
    """What the router reads of a RunningReplica, plus a KV-event publisher of its own."""

    def __init__(self, name: str, publish: bool = True):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 8
        self.events = KVEventPublisher("tcp://127.0.0.1:0", P, replay_endpoint="tcp://127.0.0.1:0")
        self.replica_metadata = (
            {
                KV_EVENTS_KEY: {
                    "endpoint": self.events.endpoint,
                    "replay_endpoint": self.events.replay_endpoint,
                }
            }
            if publish
            else {}
        )

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0

    def store(self, tokens: list[int]) -> None:
        self.events.publish([BlockStored(page_hashes(tokens, P), None, tokens, P)])


def pending(tokens: list[int] | None, request_id: str, refused: list[str] | None = None) -> PendingRequest:
    kwargs = (
        {"route": {"token_ids": tokens, "text": "", "refused": refused or []}} if tokens is not None else {}
    )
    return PendingRequest(
        args=[],
        kwargs=kwargs,
        metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id),
    )


def stored_and_seen(r: HydragenRequestRouter, replica: FakeReplica, tokens: list[int]) -> None:
    """``replica`` stores ``tokens`` until the router has the pages. A SUB socket only gets what is
    published after its subscription is in place (ZMQ's "slow joiner"); a live replica publishes every
    step, and the next batch after a loss makes the subscriber fetch the missed ones from the replay
    socket. Publishing again (the same pages) plays that next step."""
    slot = r.slots[replica.replica_id]
    deadline = time.monotonic() + 30  # a hang guard, not a speed assumption
    while r.snapshot()[slot]["cached_pages"] != len(tokens) // P:
        assert time.monotonic() < deadline, f"{replica.replica_id}'s events never arrived"
        replica.store(tokens)
        time.sleep(0.05)


def router(max_replicas: int = 2, **kwargs) -> HydragenRequestRouter:
    r = HydragenRequestRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    r.initialize_state(max_replicas=max_replicas, **kwargs)
    return r


def ids(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_requests_go_where_the_events_say_their_prefix_is_and_fall_back_by_load():
    async def run():
        r = router()
        a, b = FakeReplica("a"), FakeReplica("b")
        r.update_replicas([a, b])
        assert r in live_routers()
        stored_and_seen(r, b, PREFIX)
        first = pending(PREFIX + [1, 2], "1")
        assert ids(await r.choose_replicas([a, b], first)) == [["b"], ["a"]]  # a: if b's queue is full
        assert first.routing_context.should_backoff  # every candidate ranked: back off when all are full
        r.on_request_routed(first, b.replica_id, None)
        row = r.snapshot()[r.slots[b.replica_id]]
        assert (row["in_flight"], row["matched_tokens"], row["replica_id"]) == (1, 32, "b")
        # No prompt (GET /v1/models): by load, the idle replica first.
        assert ids(await r.choose_replicas([a, b], pending(None, "2"))) == [["a"], ["b"]]
        r.on_request_completed(b.replica_id, "1")
        assert sum(row["in_flight"] for row in r.snapshot()) == 0
        for x in (a, b):
            x.events.close()

    asyncio.run(run())


def test_a_fallback_rank_counts_the_request_on_the_replica_that_took_it():
    async def run():
        r = router()
        a, b = FakeReplica("a"), FakeReplica("b")
        r.update_replicas([a, b])
        stored_and_seen(r, b, PREFIX)
        request = pending(PREFIX, "1")
        assert ids(await r.choose_replicas([a, b], request))[0] == ["b"]
        r.on_request_routed(request, a.replica_id, None)  # b was full: a took it
        # a is computing the prefix now (pending there, 1 in flight), b holds it idle: b.
        assert ids(await r.choose_replicas([a, b], pending(PREFIX + [5], "2")))[0] == ["b"]
        assert r.snapshot()[r.slots[a.replica_id]]["in_flight"] == 1
        r.on_request_completed(a.replica_id, "1")
        assert r.snapshot()[r.slots[a.replica_id]]["in_flight"] == 0
        for x in (a, b):
            x.events.close()

    asyncio.run(run())


def test_a_replaced_replica_takes_the_free_slot_with_its_cache_forgotten():
    async def run():
        r = router()
        a, b = FakeReplica("a"), FakeReplica("b")
        r.update_replicas([a, b])
        slot_b = r.slots[b.replica_id]
        stored_and_seen(r, b, PREFIX)
        b.events.close()
        r.on_replica_actor_died(b.replica_id)  # Ray saw it die, then its replacement arrives
        assert r.snapshot()[slot_b]["cached_pages"] == 0 and not r.snapshot()[slot_b]["healthy"]
        c = FakeReplica("c")
        r.update_replicas([a, c])
        assert r.slots == {a.replica_id: 1 - slot_b, c.replica_id: slot_b}
        assert r.snapshot()[slot_b]["healthy"] and r.snapshot()[slot_b]["replica_id"] == "c"
        assert b.replica_id not in r.subscribers
        stored_and_seen(r, c, PREFIX)
        assert ids(await r.choose_replicas([a, c], pending(PREFIX, "1")))[0] == ["c"]
        for x in (a, c):
            x.events.close()

    asyncio.run(run())


def test_replicas_beyond_the_slots_or_without_events_are_still_routed_to():
    async def run():
        r = router(max_replicas=1)
        a, b = FakeReplica("a", publish=False), FakeReplica("b")
        r.update_replicas([a, b])
        assert list(r.slots) == [a.replica_id] and not r.subscribers  # a publishes nothing, b has no slot
        assert ids(await r.choose_replicas([a, b], pending(PREFIX, "1"))) == [["a"], ["b"]]
        for x in (a, b):
            x.events.close()

    asyncio.run(run())


def test_a_replica_that_refused_the_request_is_passed_over_when_it_is_routed_again():
    """The ingress routes a request again when a replica refused it (503: its engine failed or is stalled,
    until Ray's health check replaces it): the router passes that replica over, even where the request's
    prefix is cached, unless no other is left."""

    async def run():
        r = router()
        a, b = FakeReplica("a"), FakeReplica("b")
        r.update_replicas([a, b])
        stored_and_seen(r, b, PREFIX)
        assert ids(await r.choose_replicas([a, b], pending(PREFIX, "1")))[0] == ["b"]  # the cache says b
        assert ids(await r.choose_replicas([a, b], pending(PREFIX, "2", refused=["b"]))) == [["a"]]
        everyone = pending(PREFIX, "3", refused=["a", "b"])
        assert ids(await r.choose_replicas([a, b], everyone)) == [["b"], ["a"]]  # their 503 then stands
        for x in (a, b):
            x.events.close()

    asyncio.run(run())
