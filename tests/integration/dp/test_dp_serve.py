"""``hydragen serve --data-parallel-size N``: the front computes the replicas' exact prompt ids, routes on
their real caches (a shared prefix and a chat's next turn go where they are cached), proxies answers and
SSE streams, passes the replicas' own 4xx through, aggregates /metrics, and survives a replica killed
mid-request (errors, not hangs; it comes back).

One cluster of 2 replicas (tiny random model, every engine step delayed by ``STEP_DELAY`` so a long
request stays in flight as long as a test needs) is shared by the module; its front runs in this
process, so tests can read the router and the replicas' pids.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hydragen.cli.common import engine_config_of
from hydragen.cli.parser import build_parser
from hydragen.dp.launch import build_front, ready_line, serve_front
from hydragen.server.launch import bind_socket, make_server
from hydragen.server.options import ServerOptions
from tests.helpers.paths import SLOWED
from tests.helpers.server_helpers import Lines, LiveServer, all_gone, spawn, tiny_chat_model, wait_for_log
from tests.helpers.tool_helpers import tiny_tool_model, tool_json

STEP_DELAY = 0.02  # a 400-token request then runs >= 8 s on any machine
PAGE = 16
SHUTDOWN_GRACE = 1.0  # seconds in-flight requests get after a stop; 2 x it < 400 x STEP_DELAY
STEP_TIMEOUT = 3.0  # the replicas' --step-timeout: 150 x STEP_DELAY, for the tiny model's steps


class LiveFront:
    """The data-parallel front of ``hydragen serve`` flags ``argv``, served from a thread of this process."""

    def __init__(self, argv: list[str], step_delay: float, env: dict[str, str] | None = None):
        self.args = args = build_parser().parse_args(["serve", *argv])
        command = [sys.executable, SLOWED, str(step_delay)]
        self.front, path = build_front(args, engine_config_of(args), None, "warning", command=command)
        self.front.replicas.env.update(env or {})
        from hydragen.dp.front import create_front_app

        self.options = ServerOptions(shutdown_timeout=SHUTDOWN_GRACE)
        self.server = make_server(create_front_app(self.front, self.options), self.options, "warning")
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.result: list[int] = []

        def run() -> None:
            ready = lambda: ready_line(args, path, None, self.front)  # noqa: E731
            self.result.append(asyncio.run(serve_front(self.front, self.server, sock, self.options, ready)))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, (
                f"front did not start: {self.result}"
            )
            time.sleep(0.05)

    @property
    def replicas(self):
        return self.front.replicas.replicas

    def snapshot(self) -> list[dict]:
        return self.front.router.snapshot()

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.snapshot()}"
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop as a signal does (drain, grace period, replicas stopped after the front)."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "front did not stop"


def metrics(url: str) -> dict[str, float]:
    """Every sample line of /metrics: ``name{labels}`` -> value."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def routed(m: dict, replica: int, reason: str) -> float:
    return m.get(f'hydragen_router_requests_total{{reason="{reason}",replica="{replica}"}}', 0.0)


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("dp") / "tiny")


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    """The replicas' fault folder (``slowed_hydragen``): ``<pid>.fail`` fails a replica's engine,
    ``<pid>.stall`` holds its next step for as long as the file is there."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cluster(model_dir, faults):
    argv = ["--model", model_dir, "--data-parallel-size", "2", "--threads", "1", "--kv-cache-tokens", "4096"]
    argv += ["--step-timeout", str(STEP_TIMEOUT)]
    live = LiveFront(argv, STEP_DELAY, env={"HYDRAGEN_TEST_STALLS": str(faults)})
    # A stalled replica stays out of rotation, unrestarted, until the test that stalls it says otherwise.
    live.front.health.restart_after = 0
    yield live
    if live.thread.is_alive():  # the last test stops it itself
        live.stop()
    assert all_gone([r.pid for r in live.replicas if r.pid is not None])


def complete(url: str, prompt, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, messages, **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_by(before: dict, after: dict) -> int:
    """The one replica whose finished-request count went up between two /metrics readings."""
    key = 'hydragen_requests_finished_total{{replica="{}"}}'
    grew = [i for i in (0, 1) if after.get(key.format(i), 0) > before.get(key.format(i), 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def cached_pages(live: LiveFront, replica: int) -> int:
    return live.snapshot()[replica]["cached_pages"]


# ---- the replicas' prompt ids -------------------------------------------------------------------------
TOOLS = [tool_json("get_weather", {"city": {"type": "string"}}), tool_json("add", {"a": {"type": "integer"}})]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
BODIES = [
    ("completions", {"prompt": "Once upon a time, in a land of shared prefixes"}),
    ("completions", {"prompt": [5, 6, 7, 8, 9]}),
    ("chat", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}),
    ("chat", {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS}),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
            ],
            "tools": TOOLS,
            "tool_choice": "none",
        },
    ),
]


@pytest.mark.parametrize("kind", ["qwen2", "llama_sp"])
def test_front_routes_on_the_exact_ids_the_replica_computes(kind, tmp_path):
    """For completions and chats (with tools and tool history), the ids the front routes on are the ids
    the server submits to its engine."""
    from hydragen import LLM
    from hydragen.dp.prompts import RequestPrompts
    from hydragen.tp.checkpoint import read_config

    path = tiny_tool_model(
        kind, tmp_path / "model"
    )  # hermes tool calls; generic ones (template without tools)
    srv = LiveServer(LLM(path, kv_cache_tokens=4096))
    config, resolved, _ = read_config(path)
    prompts = RequestPrompts.from_files(config, resolved, None)
    with_text = RequestPrompts.from_files(config, resolved, None, want_text=True)
    submitted: list[list[int]] = []
    engine = srv.app.state.engine_client
    real_submit = engine.submit

    async def recording_submit(ids, params, text, label=""):
        submitted.append(list(ids))
        return await real_submit(ids, params, text, label)

    engine.submit = recording_submit
    try:
        for endpoint, body in BODIES:
            body = {"model": "tiny", "max_tokens": 1, **body}
            r = httpx.post(
                f"{srv.url}/v1/{endpoint.replace('chat', 'chat/completions')}", json=body, timeout=60
            )
            assert r.status_code == 200, r.text
            raw = json.dumps(body).encode()
            ours = asyncio.run(prompts.route_request(raw, chat=endpoint == "chat"))
            assert ours.token_ids == submitted[-1], (endpoint, body)
            # The approximate policy routes on text: the prompt as sent, or the rendered chat.
            text = asyncio.run(with_text.route_request(raw, chat=endpoint == "chat")).text
            expected = body["prompt"] if isinstance(body.get("prompt"), str) else None
            assert text == (expected or with_text.tok.decode(ours.token_ids, skip_special_tokens=False))
    finally:
        srv.stop()
    assert len(submitted) == len(BODIES)


# ---- routing --------------------------------------------------------------------------------------------
def expected_cores(replica: int) -> set[int]:
    """Replica ``replica`` of 2: half of this process's cores (all of them on a 1-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores)
    return set(cores[replica * len(cores) // 2 : (replica + 1) * len(cores) // 2])


def test_ready_replicas_are_pinned_to_their_own_cores(cluster):
    for r in cluster.replicas:
        assert os.sched_getaffinity(r.pid) == expected_cores(r.index)
        assert r.ready.events is not None and r.ready.replay is not None
    line = ready_line(cluster.args, Path("tiny"), None, cluster.front)
    assert "2 data-parallel replicas (router policy cache)" in line and "1 thread" in line


def test_a_shared_long_prefix_goes_to_the_replica_caching_it(cluster):
    prefix = "A long shared system prompt about routing on real caches. " * 4  # > 200 tokens (byte-level)
    m0 = metrics(cluster.url)
    complete(cluster.url, prefix + "First question?")
    m1 = metrics(cluster.url)
    first = served_by(m0, m1)
    full_pages = len(prefix.encode()) // PAGE
    cluster.wait_for(lambda: cached_pages(cluster, first) >= full_pages, "the prefix's KV events")
    complete(cluster.url, prefix + "Second question?")
    m2 = metrics(cluster.url)
    assert served_by(m1, m2) == first
    assert routed(m2, first, "cache") == routed(m1, first, "cache") + 1
    matched = f'hydragen_router_matched_tokens_total{{replica="{first}"}}'
    assert m2[matched] - m1[matched] >= full_pages * PAGE
    # The replica really reused it: only the part after the cached pages was computed.
    prefill = f'hydragen_prefill_tokens_total{{replica="{first}"}}'
    assert m2[prefill] - m1[prefill] < len((prefix + "Second question?").encode()) - full_pages * PAGE + PAGE


def test_a_two_turn_chat_sticks_to_its_replica(cluster):
    system = {"role": "system", "content": "You are the routing test's assistant. " * 5}
    turn1 = [system, {"role": "user", "content": "Tell me about prefix trees."}]
    m0 = metrics(cluster.url)
    reply = chat(cluster.url, turn1)["choices"][0]["message"]["content"]
    m1 = metrics(cluster.url)
    home = served_by(m0, m1)
    history_pages = len(turn1[0]["content"].encode()) // PAGE
    cluster.wait_for(lambda: cached_pages(cluster, home) >= history_pages, "turn 1's KV events")
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And radix trees?"}]
    chat(cluster.url, turn2)
    m2 = metrics(cluster.url)
    assert served_by(m1, m2) == home
    assert routed(m2, home, "cache") == routed(m1, home, "cache") + 1


# ---- proxying -------------------------------------------------------------------------------------------
def test_streaming_through_the_front_matches_the_plain_answer(cluster):
    messages = [{"role": "user", "content": "Stream me something."}]
    plain = chat(cluster.url, messages, max_tokens=8)["choices"][0]["message"]["content"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = []
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain
    assert chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": '),  # not JSON
        ("/v1/completions", b'{"model": "nope", "prompt": "hi"}'),  # unknown model
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [], "temperature": -1}'),
        ("/v1/completions", b'{"model": "tiny", "prompt": [99999]}'),  # out of the vocabulary
    ],
)
def test_bad_input_gets_the_replicas_own_4xx(cluster, path, body):
    through_front = httpx.post(cluster.url + path, content=body, timeout=60)
    direct = httpx.post(cluster.replicas[0].url + path, content=body, timeout=60)
    assert 400 <= through_front.status_code < 500
    assert (through_front.status_code, through_front.json()) == (direct.status_code, direct.json())


def test_models_health_and_the_api_shape_of_unknown_paths(cluster):
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok", "replicas": {"0": "ok", "1": "ok"}}
    assert httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    r = httpx.get(cluster.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


def test_metrics_have_per_replica_lines_and_their_totals(cluster):
    complete(cluster.url, "metrics, please")
    m = metrics(cluster.url)
    for name in (
        "hydragen_requests_finished_total",
        "hydragen_prompt_tokens_total",
        "hydragen_kv_pages_used",
    ):
        per_replica = [m[f'{name}{{replica="{i}"}}'] for i in (0, 1)]
        assert m[name] == sum(per_replica), name
    buckets = 'hydragen_e2e_request_latency_seconds_bucket{le="+Inf"'
    assert m[buckets + "}"] == m[buckets + ',replica="0"}'] + m[buckets + ',replica="1"}']
    assert m["hydragen_kv_page_size"] == PAGE
    assert m["hydragen_dp_replicas_healthy"] == 2
    for i in (0, 1):
        for name in ("router_in_flight", "router_cached_pages", "dp_replica_exits_total"):
            assert f'hydragen_{name}{{replica="{i}"}}' in m
    assert sum(v for k, v in m.items() if k.startswith("hydragen_router_requests_total")) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request_at_the_replica(cluster, stream):
    body = {"model": "tiny", "prompt": "a request nobody waits for", "max_tokens": 400, "ignore_eos": True}
    payload = json.dumps({**body, "stream": stream}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    before = metrics(cluster.url)["hydragen_generation_tokens_total"]
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(head.encode() + payload)
        cluster.wait_for(
            lambda: sum(r["in_flight"] for r in cluster.snapshot()) == 1, "the request in flight"
        )
        running = lambda: metrics(cluster.url)["hydragen_requests_running"]  # noqa: E731
        cluster.wait_for(lambda: running() == 1, "the replica to run it")
    cluster.wait_for(lambda: sum(r["in_flight"] for r in cluster.snapshot()) == 0, "the front to let go")
    cluster.wait_for(lambda: running() == 0, "the replica to drop it")
    # Aborted: had the replica not heard of the disconnect, it would have generated all 400 tokens.
    assert metrics(cluster.url)["hydragen_generation_tokens_total"] - before < 400


# ---- a replica dies -------------------------------------------------------------------------------------
def start_stream(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """A streamed completion on a thread, its SSE data lines collected; returns once the first has come."""
    events: list[str] = []
    first = threading.Event()

    def read() -> None:
        try:
            streamed = {**body, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=streamed, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        first.set()
        finally:
            first.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first.wait(120) and events, "the stream never started"
    return thread, events


def hold_restarts(cluster: LiveFront, request) -> threading.Event:
    """Replicas started again wait until the returned event is set (by the test, or at its end), so the
    test sees the cluster while a replica is down."""
    restart = threading.Event()
    replica_set = cluster.front.replicas
    real_launch = replica_set._launch

    async def held_launch(replica):
        await asyncio.to_thread(restart.wait, 300)
        return await real_launch(replica)

    replica_set._launch = held_launch
    request.addfinalizer(lambda: (restart.set(), vars(replica_set).pop("_launch", None)))
    return restart


def test_a_killed_replica_fails_its_requests_the_other_serves_and_it_comes_back(cluster, request):
    prompt = "This request is held in flight until its replica is killed. "  # 62 tokens + 400 < 512
    long = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "ignore_eos": True}
    results: dict = {}

    def plain() -> None:
        results["plain"] = httpx.post(cluster.url + "/v1/completions", json=long, timeout=120)

    t_stream, stream_events = start_stream(cluster.url, long)
    victim = next(i for i, r in enumerate(cluster.snapshot()) if r["in_flight"] == 1)
    restart = hold_restarts(cluster, request)
    t_plain = threading.Thread(target=plain)
    t_plain.start()  # same prompt: routed to the same replica (its pages are pending or cached there)
    cluster.wait_for(lambda: cluster.snapshot()[victim]["in_flight"] == 2, "both requests in flight")
    pid = cluster.replicas[victim].pid
    os.kill(pid, signal.SIGKILL)
    t_plain.join(timeout=120)
    t_stream.join(timeout=120)
    assert not t_plain.is_alive() and not t_stream.is_alive(), "a request hung on the dead replica"
    r = results["plain"]
    assert r.status_code == 502 and r.json()["error"]["code"] == "replica_failed", r.text
    assert f"replica {victim}" in r.json()["error"]["message"]
    assert stream_events[-1] == "[DONE]"
    assert json.loads(stream_events[-2])["error"]["code"] == "replica_failed"
    # While it is down (its restart held back by the test), the other replica serves.
    cluster.wait_for(lambda: not cluster.snapshot()[victim]["healthy"], "the death to be noticed")
    m0 = metrics(cluster.url)
    complete(cluster.url, "still serving?")
    assert served_by(m0, metrics(cluster.url)) == 1 - victim
    health = httpx.get(cluster.url + "/health").json()  # ok while one replica serves, and it says which
    assert health == {"status": "ok", "replicas": {str(victim): "exited", str(1 - victim): "ok"}}
    restart.set()
    cluster.wait_for(lambda: cluster.snapshot()[victim]["healthy"], "the restart")
    back = cluster.replicas[victim]
    assert back.pid != pid and os.sched_getaffinity(back.pid) == expected_cores(victim)
    m = metrics(cluster.url)
    assert m[f'hydragen_dp_replica_exits_total{{replica="{victim}"}}'] == 1
    assert m[f'hydragen_dp_replica_restarts_total{{replica="{victim}"}}'] == 1
    assert m[f'hydragen_dp_replica_failed_requests_total{{replica="{victim}"}}'] == 2
    assert m["hydragen_dp_replicas_healthy"] == 2
    assert f'hydragen_requests_finished_total{{replica="{victim}"}}' in m  # its own metrics are back
    complete(back.url, "the restarted replica answers")


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed on leaving: connections are refused


def test_a_replica_that_refuses_connections_is_skipped_and_the_request_routed_again(cluster, monkeypatch):
    """Nothing reached the replica, so the request is not lost: another replica serves it; only when no
    replica can be reached does the client get a 502."""
    url, dead = cluster.front.url, closed_port_url()
    monkeypatch.setattr(cluster.front, "url", lambda i: dead if i == 0 else url(i))
    before = metrics(cluster.url)
    for k in range(4):  # whatever the router picks first, every request ends on replica 1
        assert complete(cluster.url, f"refused {k}")["choices"][0]["text"] is not None
    after = metrics(cluster.url)
    key = 'hydragen_requests_finished_total{{replica="{}"}}'
    assert after[key.format(1)] - before.get(key.format(1), 0) == 4
    assert after.get(key.format(0), 0) == before.get(key.format(0), 0)
    refused = 'hydragen_dp_replica_unreachable_requests_total{replica="0"}'
    assert after[refused] > before.get(refused, 0)
    monkeypatch.setattr(cluster.front, "url", lambda i: dead)
    r = httpx.post(cluster.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 502 and r.json()["error"]["code"] == "replica_failed"
    assert "no replica could be connected to (tried 0, 1)" in r.json()["error"]["message"]


# ---- a replica's engine fails, or its step hangs: its process lives on ------------------------------------
def post_completion(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_a_replica_whose_engine_failed_leaves_the_rotation_and_is_restarted(cluster, faults, request):
    """Issue 39, defect 2: a replica whose engine failed still runs and answers every request at once with a
    503 ``engine_failed``, so it looked alive and idle. The front takes it out of rotation at once (the
    request it refused is routed again), says so on /health and /metrics, and restarts it."""
    restart = hold_restarts(cluster, request)
    victim = 0
    pid, url = cluster.replicas[victim].pid, cluster.replicas[victim].url
    fail = faults / f"{pid}.fail"
    fail.touch()
    request.addfinalizer(lambda: fail.unlink(missing_ok=True))
    r = post_completion(url, "the request whose step fails")  # sent to the victim itself: its engine fails
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
    fail.unlink()
    sequential = [post_completion(cluster.url, f"sequential {k}") for k in range(20)]
    failed = [r for r in sequential if r.status_code != 200]
    assert not failed, f"{len(failed)} of 20 sequential requests failed, e.g. {failed[0].text}"
    with ThreadPoolExecutor(24) as pool:
        concurrent = list(pool.map(lambda k: post_completion(cluster.url, f"concurrent {k}"), range(24)))
    failed = [r for r in concurrent if r.status_code != 200]
    assert not failed, f"{len(failed)} of 24 concurrent requests failed, e.g. {failed[0].text}"
    # Out of rotation (its restart is held back by the test), and the front says so.
    assert not cluster.snapshot()[victim]["healthy"]
    health = httpx.get(cluster.url + "/health")
    assert health.status_code == 200, health.text
    assert health.json()["replicas"] == {str(victim): "engine_failed", str(1 - victim): "ok"}
    m = metrics(cluster.url)
    assert m[f'hydragen_dp_replica_healthy{{replica="{victim}"}}'] == 0
    assert m["hydragen_dp_replicas_healthy"] == 1
    assert m[f'hydragen_dp_replica_unhealthy_total{{reason="engine_failed",replica="{victim}"}}'] == 1
    assert m[f'hydragen_dp_replica_replaced_total{{reason="engine_failed",replica="{victim}"}}'] == 1
    # Restarted like a dead process: the old one is stopped, a new one takes its place.
    assert all_gone([pid])
    restart.set()
    cluster.wait_for(lambda: cluster.snapshot()[victim]["healthy"], "the restart")
    assert cluster.replicas[victim].pid != pid
    assert post_completion(cluster.replicas[victim].url, "the new engine serves").status_code == 200
    assert httpx.get(cluster.url + "/health").json()["replicas"] == {"0": "ok", "1": "ok"}


def test_a_replica_stuck_in_a_step_leaves_the_rotation_and_is_restarted_if_it_stays_stuck(
    cluster, faults, request, caplog, monkeypatch
):
    """Issue 39, defect 11, through the front: a replica whose step hangs still answers HTTP. Past its
    --step-timeout it says so (503 engine_stalled, a log line naming the step's requests), the front routes
    around it, and once it has stayed stuck as long as the front allows, restarts it: the request it held
    ends with an error, not a hang."""
    restart = hold_restarts(cluster, request)
    body = {"model": "tiny", "prompt": "held in a stuck step", "max_tokens": 400, "ignore_eos": True}
    stream, events = start_stream(cluster.url, body)
    victim = next(i for i, r in enumerate(cluster.snapshot()) if r["in_flight"] == 1)
    pid, url = cluster.replicas[victim].pid, cluster.replicas[victim].url
    stall = faults / f"{pid}.stall"
    stall.touch()  # its next step waits for as long as the file is there
    request.addfinalizer(lambda: stall.unlink(missing_ok=True))
    cluster.wait_for(lambda: not cluster.snapshot()[victim]["healthy"], "the stall to take it out")
    err = httpx.get(url + "/health").json()["error"]
    assert err["code"] == "engine_stalled" and f"step timeout of {STEP_TIMEOUT:g} s" in err["message"], err
    wait_for_log(caplog, f"replica {victim}: engine step stalled")
    said = next(r.getMessage() for r in caplog.records if "engine step stalled" in r.getMessage())
    assert json.loads(events[0])["id"] in said, said  # the stuck step's request, by the id its client saw
    assert httpx.get(cluster.url + "/health").json()["replicas"][str(victim)] == "engine_stalled"
    m0 = metrics(cluster.url)
    assert m0[f'hydragen_dp_replica_unhealthy_total{{reason="engine_stalled",replica="{victim}"}}'] == 1
    assert m0[f'hydragen_dp_replica_healthy{{replica="{victim}"}}'] == 0
    for k in range(4):  # meanwhile the other replica serves everything
        assert post_completion(cluster.url, f"around the stall {k}").status_code == 200
    m1 = metrics(cluster.url)
    key = 'hydragen_requests_finished_total{{replica="{}"}}'
    assert m1[key.format(1 - victim)] - m0[key.format(1 - victim)] == 4
    # It stays stuck: let the front's bound pass, and it restarts the replica; the held request ends.
    monkeypatch.setattr(cluster.front.health, "restart_after", 1e-9)
    stream.join(timeout=60)
    assert not stream.is_alive(), "the stuck replica's request hangs"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and "engine_stalled" in error["message"], error
    assert all_gone([pid])
    m2 = metrics(cluster.url)
    assert m2[f'hydragen_dp_replica_replaced_total{{reason="engine_stalled",replica="{victim}"}}'] == 1
    restart.set()
    cluster.wait_for(lambda: cluster.snapshot()[victim]["healthy"], "the restart")
    assert post_completion(cluster.replicas[victim].url, "unstuck").status_code == 200


def test_stopping_the_front_ends_requests_in_flight_and_stops_the_replicas(cluster):
    """Last of the cluster's tests: it stops the shared front, as SIGTERM does."""
    assert 2 * SHUTDOWN_GRACE < 400 * STEP_DELAY
    body = {"model": "tiny", "prompt": "held past the grace period", "max_tokens": 400, "ignore_eos": True}
    result: list[httpx.Response] = []
    held = threading.Thread(
        target=lambda: result.append(httpx.post(cluster.url + "/v1/completions", json=body, timeout=120))
    )
    held.start()
    cluster.wait_for(lambda: sum(r["in_flight"] for r in cluster.snapshot()) == 1, "the request in flight")
    pids = [r.pid for r in cluster.replicas]
    cluster.stop()
    held.join(timeout=60)
    assert result and result[0].status_code == 503, result
    assert result[0].json()["error"]["code"] == "shutting_down"
    assert cluster.result == [0]
    assert all_gone(pids)


# ---- the command ----------------------------------------------------------------------------------------
@pytest.fixture
def hydragen_logger():
    """The command configures the "hydragen" logger (its own stderr handler, no propagation): put it back
    afterwards, so later tests' caplog still sees the server's log lines."""
    import logging

    logger = logging.getLogger("hydragen")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def test_bad_data_parallel_options_are_one_line_errors(model_dir, capsys, hydragen_logger, tmp_path):
    from hydragen.cli import main

    cores = len(os.sched_getaffinity(0))
    dp2 = ["--data-parallel-size", "2", "--threads", "1"]
    cases = [
        (["--data-parallel-size", "0"], 2, "--data-parallel-size must be at least 1, got 0"),
        (["--data-parallel-size", str(cores + 1)], 2, f"needs {cores + 1} cores"),
        ([*dp2, "--tensor-parallel-size", "2"], 2, "cannot be combined"),
        ([*dp2, "--router-balance-bound", "-1"], 2, "--router-balance-bound must be >= 0"),
        ([*dp2, "--kv-events-endpoint", "tcp://127.0.0.1:0"], 2, "sets each replica's KV-event addresses"),
        # The front resolves the replicas' KV cache dtype, so a bad one stops it before any replica starts.
        ([*dp2, "--dtype", "bfloat16", "--kv-cache-dtype", "float16"], 2, "needs float32 compute"),
    ]
    # Only the replicas find this one out (the front reads no weights): it ends the command, once.
    broken = Path(shutil.copytree(model_dir, tmp_path / "broken"))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    cases.append(([*dp2, "--kv-cache-tokens", "4096"], 1, "could not start: ", broken))
    for args, status, message, *model in cases:
        argv = ["serve", "--model", str(model[0] if model else model_dir), "--port", "0", *args]
        assert main(argv) == status, args
        errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (args, errors)
    assert "model.safetensors: unreadable weights file" in errors[0]  # the replica's own one-line error


def test_the_command_serves_through_n_replicas_and_stops_them_on_sigterm(model_dir):
    proc = spawn(
        "--model", model_dir, "--port", "0", "--data-parallel-size", "2", "--threads", "1", api_key="k"
    )
    lines = Lines(proc)
    try:
        ready = lines.wait_for(
            r"ready: serving 'tiny' on (http://127\.0\.0\.1:\d+)/v1 \| 2 data-parallel replicas"
        )
        pids = [int(lines.wait_for(rf"replica {i} ready: pid (\d+)").group(1)) for i in (0, 1)]
        assert (
            "KV cache" in ready.string and "1 thread" in ready.string and "API key required" in ready.string
        )
        # ignore_eos: the random tiny model (256 tokens) samples its EOS within 4 tokens about once in 60 runs
        url, body = ready.group(1), {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert all_gone(pids)
    finally:
        proc.kill()


def test_restarts_back_off_and_are_bounded_per_minute(monkeypatch):
    from hydragen import restart_backoff
    from hydragen.dp import replicas as mod

    async def nothing(_):
        return None

    replica_set = mod.ReplicaSet([], [[0]], on_up=nothing, on_down=nothing, max_restarts_per_minute=3)
    replica = replica_set.replicas[0]
    now = [1000.0]
    monkeypatch.setattr(restart_backoff.time, "monotonic", lambda: now[0])
    delays = []
    for failures in (1, 2, 3, 4, 10):
        replica.backoff.failures = failures
        delays.append(replica_set._next_delay(replica))
    assert delays == [0.5, 1.0, 2.0, 4.0, restart_backoff.BACKOFF_MAX_S]
    replica.backoff.failures = 1
    replica.backoff.recent.extend([990.0, 995.0, 999.0])  # 3 restarts in the last minute: the most allowed
    assert replica_set._next_delay(replica) == pytest.approx(50.0)  # until the first of them is a minute old
    now[0] = 1051.0
    assert replica_set._next_delay(replica) == 0.5 and list(replica.backoff.recent) == [995.0, 999.0]
