"""hydragen on Ray Serve (``dp.ray_serve``): a local multi-process Ray cluster on loopback, two replicas of a
tiny model behind the ingress and the cache-aware request router (``dp.ray_router``)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is an optional dependency (pip install hydragen[ray])")
from ray import serve  # noqa: E402
from server_helpers import free_port, tiny_chat_model  # noqa: E402

from hydragen.dp.ray_serve import REPLICA_HEADER, build_app  # noqa: E402

MODEL = "tiny"
# Four tenants' system prompts (~250 bytes = tokens): they differ from their first page on, as the chat
# template's own header ("<system>", 8 bytes) is shorter than a page.
TENANTS = [
    f"{name} is the assistant of tenant {name}; answer in one line. " * 4
    for name in ("Alpha", "Bravo", "Charlie", "Delta")
]


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    """A Ray cluster of this machine's processes (GCS, raylet, workers: Ray addresses them by the machine's
    own IP, so nothing leaves the host), Serve's HTTP proxy on a free loopback port."""
    model = tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("ray") / "tiny")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            model,
            data_parallel_size=2,
            replica_cpus=0.5,
            served_model_name=MODEL,
            llm_options={"kv_cache_tokens": 4096, "threads": 1},
        )
        serve.run(app, name="hydragen", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: httpx.Client, system: str, user: str, **extra) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
    return client.post("/v1/chat/completions", json=body)


def router_figures(client: httpx.Client) -> dict[str, dict[str, float]]:
    """The ingress's /metrics: {metric name: {replica slot: value}}."""
    out: dict[str, dict[str, float]] = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("hydragen_router_"):
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            out.setdefault(name, {})[labels.split('"')[1]] = float(value)
    return out


def test_replicas_answer_completions_streams_and_errors_through_ray(cluster):
    models = cluster.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL

    r = chat(cluster, "Be brief.", "hello")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 4
    assert r.headers[REPLICA_HEADER]

    with cluster.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    ) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")

    bad = cluster.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2})  # no messages
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    wrong = chat(cluster, "Be brief.", "hi", model="nope")
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_a_request_goes_to_the_replica_that_caches_its_prefix(cluster):
    first = {}
    for i, system in enumerate(TENANTS):
        r = chat(cluster, system, f"first question {i}")
        assert r.status_code == 200, r.text
        first[i] = r.headers[REPLICA_HEADER]
    # Nothing was cached anywhere, so the first turns were spread by load: both replicas took some.
    assert len(set(first.values())) == 2, first

    # Wait (a hang guard, not a speed assumption) until the router has heard both replicas' KV events.
    deadline = time.monotonic() + 60
    while min(router_figures(cluster).get("hydragen_router_cached_pages", {"": 0}).values()) == 0:
        assert time.monotonic() < deadline, router_figures(cluster)
        time.sleep(0.1)

    # The follow-ups come in another order: round-robin or least-loaded would send half of them elsewhere.
    for i in (1, 0, 3, 2):
        r = chat(cluster, TENANTS[i], f"second question {i}")
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] == first[i], (i, first)
    figures = router_figures(cluster)
    assert sum(figures["hydragen_router_matched_tokens_total"].values()) >= 4 * 200  # the system prompts
    assert sum(figures["hydragen_router_in_flight"].values()) == 0  # every request counted out again
