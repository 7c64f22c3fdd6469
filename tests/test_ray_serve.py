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

from hydragen.dp.ray_serve import APP_NAME, REPLICA_HEADER, build_app  # noqa: E402

MODEL = "tiny"
# Four tenants' system prompts (~250 bytes = tokens): they differ from their first page on, as the chat
# template's own header ("<system>", 8 bytes) is shorter than a page.
TENANTS = [
    f"{name} is the assistant of tenant {name}; answer in one line. " * 4
    for name in ("Alpha", "Bravo", "Charlie", "Delta")
]


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory) -> str:
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("ray") / "tiny")


def test_ray_flags_are_one_line_errors_before_anything_starts(capsys, model):
    from hydragen.cli import main

    cases = [
        (["--ray-address", "auto"], "--ray-address needs --ray"),
        (["--router-policy", "ray-prefix"], "--router-policy ray-prefix (Ray Serve LLM's router) needs"),
        (["--ray", "--tensor-parallel-size", "2"], "--ray and --tensor-parallel-size cannot be combined"),
        (["--ray", "--kv-events-endpoint", "tcp://127.0.0.1:5557"], "with --ray each replica publishes"),
        (["--ray", "--router-balance-bound", "-1"], "--router-balance-bound must be >= 0"),
    ]
    for argv, message in cases:
        assert main(["serve", "--model", model, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, (argv, err)


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster of this machine's processes (GCS, raylet, workers: Ray addresses them by the machine's
    own IP, so nothing leaves the host), Serve's HTTP proxy on a free loopback port."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # log_to_driver=False: the workers' logs stay in Ray's session folder instead of arriving, at any
    # moment, on this process's stderr (where other tests read the CLI's own errors).
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(model: str, policy: str) -> None:
    """Two replicas of the tiny model behind the ingress (replacing the app deployed before)."""
    llm_options = {"kv_cache_tokens": 4096, "threads": 1}
    app = build_app(model, 2, policy, replica_cpus=0.5, served_model_name=MODEL, llm_options=llm_options)
    serve.run(app, name=APP_NAME, route_prefix="/")


@pytest.fixture(scope="module")
def cluster(ray_cluster, model):
    deploy(model, "cache")
    return ray_cluster


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


def first_turns(client: httpx.Client) -> dict[int, str]:
    """Each tenant's first chat turn; the replica that served it."""
    served = {}
    for i, system in enumerate(TENANTS):
        r = chat(client, system, f"first question {i}")
        assert r.status_code == 200, r.text
        served[i] = r.headers[REPLICA_HEADER]
    # Nothing was cached anywhere, so the first turns were spread by load: both replicas took some.
    assert len(set(served.values())) == 2, served
    return served


def assert_follow_ups_stick(client: httpx.Client, first: dict[int, str]) -> None:
    """The second turns come in another order: round-robin or least-loaded would send half elsewhere."""
    for i in (1, 0, 3, 2):
        r = chat(client, TENANTS[i], f"second question {i}")
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] == first[i], (i, first)


def test_a_request_goes_to_the_replica_that_caches_its_prefix(cluster):
    first = first_turns(cluster)
    # Wait (a hang guard, not a speed assumption) until the router has heard both replicas' KV events.
    deadline = time.monotonic() + 60
    while min(router_figures(cluster).get("hydragen_router_cached_pages", {"": 0}).values()) == 0:
        assert time.monotonic() < deadline, router_figures(cluster)
        time.sleep(0.1)
    assert_follow_ups_stick(cluster, first)
    figures = router_figures(cluster)
    assert sum(figures["hydragen_router_matched_tokens_total"].values()) >= 4 * 200  # the system prompts
    assert sum(figures["hydragen_router_in_flight"].values()) == 0  # every request counted out again


def test_ray_serve_llms_own_prefix_router_drives_hydragen_replicas(ray_cluster, model):
    """policy ray-prefix: Ray Serve LLM's PrefixCacheAffinityRouter (an approximate tree of the text it
    routed), with ray[serve] alone (no vLLM): the same stickiness for these chats."""
    deploy(model, "ray-prefix")
    assert_follow_ups_stick(ray_cluster, first_turns(ray_cluster))
    assert "hydragen_router_cached_pages{" not in ray_cluster.get("/metrics").text  # not our router
