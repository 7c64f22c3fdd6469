"""The data-parallel router's choices, from KV events and its own count of requests in flight."""

from __future__ import annotations

import pytest

from hydragen.dp.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from hydragen.dp.router import NoReplica, Router, RouteRequest
from hydragen.kv.page_hash import page_hashes

P = 4  # page size


def stored(tokens: list[int]) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(page_hashes(tokens, P), None, tokens[: len(tokens) // P * P], P)])


def request(tokens, text: str = "") -> RouteRequest:
    return RouteRequest(list(tokens), text)


SYSTEM_A = list(range(100, 132))  # 8 pages
SYSTEM_B = list(range(200, 232))


def test_cache_policy_follows_the_replica_holding_the_longest_prefix():
    router = Router(3)
    router.apply(1, stored(SYSTEM_A))
    router.apply(2, stored(SYSTEM_B + [1, 2, 3, 4]))
    route = router.choose(request(SYSTEM_A + [7, 8, 9]))
    assert (route.replica, route.matched_tokens, route.reason) == (1, 32, "cache")
    route = router.choose(request(SYSTEM_B + [1, 2, 3, 4, 5]))
    assert (route.replica, route.matched_tokens) == (2, 36)
    # Replica 0 holds only the first half of A's system prompt: still the longest match for its own text.
    router.apply(0, stored(SYSTEM_A[:16] + [9] * 8))
    assert router.choose(request(SYSTEM_A[:16] + [9] * 9)).replica == 0


def test_removed_pages_are_no_longer_matched():
    router = Router(2)
    router.apply(1, stored(SYSTEM_A))
    hashes = page_hashes(SYSTEM_A, P)
    router.apply(1, KVEventBatch(0.0, [BlockRemoved(hashes[4:])]))
    assert router.choose(request(SYSTEM_A)).matched_tokens == 16
    router.apply(1, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert router.choose(request(SYSTEM_A)).reason == "no-match"


def test_pending_prefix_keeps_a_burst_on_one_replica_before_any_event():
    """Requests with one system prompt arriving before the first is admitted anywhere go together."""
    router = Router(2, balance_bound=8, page_size=P)
    first = router.choose(request(SYSTEM_A + [1]))
    router.started(first)
    second = router.choose(request(SYSTEM_A + [2]))
    assert second.replica == first.replica and second.reason == "cache"
    router.finished(first)
    assert router.choose(request(SYSTEM_A + [3])).reason == "no-match"  # nothing cached, nothing pending


def test_an_overloaded_replica_yields_to_the_least_loaded():
    router = Router(2, balance_bound=2)
    router.apply(0, stored(SYSTEM_A))
    routes = []
    for i in range(3):
        route = router.choose(request(SYSTEM_A + [i]))
        router.started(route)
        routes.append(route.replica)
    assert routes == [0, 0, 0]  # loads 1, 2 vs 0: within the bound of 2
    route = router.choose(request(SYSTEM_A + [9]))
    assert (route.replica, route.reason) == (1, "balance")  # 3 in flight > 0 + 2


def test_a_dead_replica_is_never_chosen_and_its_cache_is_forgotten():
    router = Router(2)
    router.apply(0, stored(SYSTEM_A))
    router.set_healthy(0, False)
    assert router.choose(request(SYSTEM_A)).replica == 1
    router.clear(0)
    router.set_healthy(0, True)
    assert router.choose(request(SYSTEM_A)).reason == "no-match"
    router.set_healthy(0, False)
    router.set_healthy(1, False)
    with pytest.raises(NoReplica):
        router.choose(request(SYSTEM_A))


def test_baseline_policies():
    rr = Router(3, "round-robin")
    rr.apply(2, stored(SYSTEM_A))
    assert [rr.choose(request(SYSTEM_A)).replica for _ in range(4)] == [0, 1, 2, 0]
    ll = Router(2, "least-loaded")
    first = ll.choose(request(SYSTEM_A))
    ll.started(first)
    assert ll.choose(request(SYSTEM_A)).replica != first.replica


def test_approx_policy_learns_only_from_what_it_routed():
    text_a, text_b = "a" * 64 * 4 + "question 1", "b" * 64 * 4 + "question 2"
    router = Router(2, "approx")
    first = router.choose(request([], text_a))
    other = router.choose(request([], text_b))
    assert first.replica != other.replica  # no match: least loaded, spread by rotation
    again = router.choose(request([], text_a[:256] + "another question"))
    assert (again.replica, again.reason) == (first.replica, "approx")
    # It never hears of evictions: the real cache can say otherwise.
    router.apply(other.replica, stored(SYSTEM_A))
    assert router.choose(request(SYSTEM_A, text_a[:256] + "x")).replica == first.replica


def test_snapshot_counts_routes_and_bad_arguments_are_refused():
    router = Router(2)
    router.apply(1, stored(SYSTEM_A))
    router.started(router.choose(request(SYSTEM_A)))
    snap = router.snapshot()
    assert snap[1]["routed"] == {"cache": 1} and snap[1]["in_flight"] == 1 and snap[1]["cached_pages"] == 8
    assert snap[1]["matched_tokens"] == 32
    with pytest.raises(ValueError, match="policy"):
        Router(2, "random")
    with pytest.raises(ValueError, match="at least one"):
        Router(0)


def test_a_match_of_a_few_pages_of_a_long_prompt_counts_as_none():
    """Prompts that share only their first page (a chat template's opening) are balanced, not piled up."""
    router = Router(2, balance_bound=8, page_size=P)
    template = [1, 2, 3, 4]
    routes = []
    for tenant in range(4):
        route = router.choose(request(template + [50 + tenant] * 40))
        router.started(route)
        routes.append(route)
    assert sorted(r.replica for r in routes) == [0, 0, 1, 1]
    assert {r.reason for r in routes} == {"no-match"}
    assert Router(2, page_size=P, min_match=0).min_match == 0
    with pytest.raises(ValueError, match="min_match"):
        Router(2, min_match=1.5)


def test_requests_from_before_a_restart_leave_the_new_runs_pending_pages_alone():
    """A replica restarted (its cache forgotten) while a request routed before the restart is still
    unwinding: that request's end must not take its pages off the pending count of requests routed to the
    new run (issue 39: they were subtracted, and the new run's pending prefix stopped matching)."""
    router = Router(1, page_size=P)
    before = router.choose(request(SYSTEM_A + [1]))
    router.started(before)
    router.clear(0)  # the replica restarted: the front forgets what it held and was computing
    after = router.choose(request(SYSTEM_A + [2]))
    assert after.reason == "no-match"  # the old run's pending pages are forgotten
    router.started(after)
    assert router.choose(request(SYSTEM_A + [3])).reason == "cache"  # pending on the new run
    router.finished(before)  # the old run's request ends only now
    follower = router.choose(request(SYSTEM_A + [3]))
    assert (follower.reason, follower.matched_tokens) == ("cache", len(SYSTEM_A)), follower
    assert router.snapshot()[0]["in_flight"] == 1
    router.finished(after)
    assert router.choose(request(SYSTEM_A + [4])).reason == "no-match"  # nothing pending now
