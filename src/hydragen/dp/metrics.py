"""/metrics of the data-parallel front: each replica's own figures labeled ``replica="i"``, their totals
over the replicas (the same names without a ``replica`` label), and the router's and supervisor's figures.

Totals are sums (counters, histograms bucket by bucket, gauges such as pages in use), except the prefix
cache hit rate (the replicas' rates weighted by their prompt tokens) and the page size (the replicas'
common value). A replica that is down or does not answer in time is left out of that scrape (and of the
totals); a restarted replica's counters start again from zero, as any restarted process's do.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

SCRAPE_TIMEOUT_S = 5.0
HIT_RATE = "hydragen_prefix_cache_hit_rate"
PROMPT_TOKENS = "hydragen_prompt_tokens"  # counter family name (its sample is ..._total)
SAME_ON_EVERY_REPLICA = {"hydragen_kv_page_size"}


async def scrape(client: httpx.AsyncClient, urls: list[str | None]) -> list[str | None]:
    """Each replica's /metrics text (None for a replica that is down or did not answer)."""

    async def one(url: str | None) -> str | None:
        if url is None:
            return None
        try:
            response = await client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    return list(await asyncio.gather(*(one(u) for u in urls)))


def render(texts: list[str | None], own: list[Metric]) -> str:
    """Prometheus text: the replicas' families (totals, then per replica), then the front's ``own``."""
    families: dict[str, Metric] = {}
    per_replica: list[tuple[str, dict]] = []  # (replica, {family name: parsed family})
    for i, text in enumerate(texts):
        if text is None:
            continue
        parsed = {f.name: f for f in text_string_to_metric_families(text)}
        per_replica.append((str(i), parsed))
        for name, f in parsed.items():
            families.setdefault(name, Metric(f.name, f.documentation, f.type))
    for name, out in families.items():
        parts = [(replica, parsed[name]) for replica, parsed in per_replica if name in parsed]
        for sample_name, labels, value in _totals(name, parts, per_replica):
            out.add_sample(sample_name, labels, value)
        for replica, f in parts:
            for s in f.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), *own]))
    return generate_latest(registry).decode()


def _totals(name: str, parts, per_replica) -> list[tuple[str, dict, float]]:
    """One family's samples summed over the replicas (see the module's note for the exceptions)."""
    groups: dict[tuple[str, tuple], list[tuple[str, float]]] = defaultdict(list)
    for replica, f in parts:
        for s in f.samples:
            groups[(s.name, tuple(sorted(s.labels.items())))].append((replica, s.value))
    weights = {}
    if name == HIT_RATE:
        for replica, parsed in per_replica:
            prompt = parsed.get(PROMPT_TOKENS)
            weights[replica] = sum(s.value for s in prompt.samples) if prompt is not None else 0.0
    out = []
    for (sample_name, labels), values in groups.items():
        if name in SAME_ON_EVERY_REPLICA:
            total = max(v for _, v in values)
        elif name == HIT_RATE:
            weight = sum(weights.get(r, 0.0) for r, _ in values)
            total = sum(v * weights.get(r, 0.0) for r, v in values) / weight if weight else 0.0
        else:
            total = sum(v for _, v in values)
        out.append((sample_name, dict(labels), total))
    return out


def router_families(
    snapshot: list[dict], replicas, failed: list[int], unreachable: list[int], health
) -> list[Metric]:
    """The front's own figures: ``snapshot`` is ``Router.snapshot()``, ``replicas`` the ReplicaSet's
    replicas, ``failed[i]`` the requests ended by replica i's failure, ``unreachable[i]`` the requests it
    could not be connected for (each routed again), ``health`` the front's ``dp.health.HealthWatch``."""
    healthy = GaugeMetricFamily("hydragen_dp_replicas_healthy", "replicas taking requests")
    healthy.add_metric([], sum(1 for r in snapshot if r["healthy"]))
    up = GaugeMetricFamily(
        "hydragen_dp_replica_healthy", "1 while the replica takes requests", labels=["replica"]
    )
    routed = CounterMetricFamily(
        "hydragen_router_requests",
        "requests routed to the replica, by why it was chosen (cache: longest cached match; balance: the "
        "best match was overloaded; no-match: nothing cached anywhere; or the policy's name)",
        labels=["replica", "reason"],
    )
    matched = CounterMetricFamily(
        "hydragen_router_matched_tokens",
        "prompt tokens the router knew the chosen replica to hold (cache policy)",
        labels=["replica"],
    )
    in_flight = GaugeMetricFamily(
        "hydragen_router_in_flight", "requests the front has in flight at the replica", labels=["replica"]
    )
    cached = GaugeMetricFamily(
        "hydragen_router_cached_pages", "KV pages the replica's events say it caches", labels=["replica"]
    )
    exits = CounterMetricFamily(
        "hydragen_dp_replica_exits", "times the replica's process ended unasked", labels=["replica"]
    )
    restarts = CounterMetricFamily(
        "hydragen_dp_replica_restarts", "times the replica was started again", labels=["replica"]
    )
    lost = CounterMetricFamily(
        "hydragen_dp_replica_failed_requests",
        "requests that ended in an error because the replica failed while serving them",
        labels=["replica"],
    )
    refused = CounterMetricFamily(
        "hydragen_dp_replica_unreachable_requests",
        "requests the replica could not be connected for; each was routed again to another replica",
        labels=["replica"],
    )
    out_of_rotation = CounterMetricFamily(
        "hydragen_dp_replica_unhealthy",
        "times the replica was taken out of rotation while its process ran, by what its server said: "
        "engine_failed, engine_stalled (a step past --step-timeout), no_answer (/health unanswered)",
        labels=["replica", "reason"],
    )
    replaced = CounterMetricFamily(
        "hydragen_dp_replica_replaced",
        "times the front stopped the replica and started it again for what its server said (its engine "
        "failed, or it stayed stalled or silent past --step-timeout)",
        labels=["replica", "reason"],
    )
    for r, replica, n_failed, n_refused in zip(snapshot, replicas, failed, unreachable, strict=True):
        i = str(r["replica"])
        up.add_metric([i], 1.0 if r["healthy"] else 0.0)
        for reason, count in sorted(r["routed"].items()):
            routed.add_metric([i, reason], count)
        matched.add_metric([i], r["matched_tokens"])
        in_flight.add_metric([i], r["in_flight"])
        cached.add_metric([i], r["cached_pages"])
        exits.add_metric([i], replica.exits)
        restarts.add_metric([i], replica.restarts)
        lost.add_metric([i], n_failed)
        refused.add_metric([i], n_refused)
        for reason, count in sorted(health.unhealthy[r["replica"]].items()):
            out_of_rotation.add_metric([i, reason], count)
        for reason, count in sorted(health.replaced[r["replica"]].items()):
            replaced.add_metric([i, reason], count)
    families = [healthy, up, routed, matched, in_flight, cached, exits, restarts, lost, refused]
    return [*families, out_of_rotation, replaced]


class _Fixed:
    """A collector that yields the families it was given."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
