"""A server rebuilds its engine when the engine's tensor-parallel group broke (server/engine_restarts.py),
in one process: the break is the ``TPGroupBroken`` a dead worker raises, injected into a TP = 1 engine,
and ``rebuild`` builds a TP = 1 LLM (tests/integration/tp/test_tp_server.py does it with real worker
processes).

The requests in flight end with the error; while the rebuild runs (held by the test) ``/health`` and new
requests answer 503 ``engine_restarting``; the broken engine is freed before the new one is built; the new
one gives the same tokens. A rebuild that keeps failing ends in 503 ``engine_failed`` after
--max-restarts-per-minute tries; any other engine failure stays final, as in one process."""

from __future__ import annotations

import gc
import itertools
import json
import threading
import time
import weakref

import httpx
import pytest

from hydragen import LLM
from hydragen.server.options import ServerOptions
from hydragen.tp.coordinator import TPGroupBroken
from tests.helpers.server_helpers import LiveServer, metric, tiny_chat_model

CAUSE = "tensor-parallel group is down: worker rank 1 (pid 4242) was killed by SIGKILL"
PROMPT = "shared prefix, then a question"


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("restarts") / "tiny")


def _llm(model_dir: str) -> LLM:
    return LLM(model_dir, kv_cache_tokens=4096)


def _complete(srv: LiveServer, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def _error(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


def _group_breaks_at_forward(engine, first: int) -> threading.Event:
    """From the engine's ``first``-th forward on (counting from 0), each forward waits for the returned
    event, then raises what a dead worker makes it raise. Installed on the engine itself, so that the test
    holds no reference to it and a restart can free it."""
    go, seen = threading.Event(), itertools.count()

    def forward(batch, real=engine.runner.forward):
        if next(seen) >= first:
            assert go.wait(60), "the test never broke the group"
            raise TPGroupBroken(CAUSE)
        return real(batch)

    engine.runner.forward = forward
    return go


def _wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.02)


def _health(srv: LiveServer) -> httpx.Response:
    return httpx.get(srv.url + "/health", timeout=10)


def test_a_broken_group_ends_its_requests_and_the_engine_is_rebuilt_after_the_old_one_is_freed(model_dir):
    release, freed_when_built = threading.Event(), []

    def rebuild() -> LLM:
        gc.collect()
        freed_when_built.append(old_model() is None)
        assert release.wait(60), "the test never let the rebuild go on"
        return _llm(model_dir)

    srv = LiveServer(_llm(model_dir), "tiny", rebuild=rebuild)
    old_model = weakref.ref(srv.app.state.engine_client.llm.model)
    try:
        want = _complete(srv).json()["choices"][0]["text"]
        go = _group_breaks_at_forward(srv.engine, first=2)  # the stream's prefill and first decode run
        events, first_event = [], threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_event.wait(60)
        go.set()
        client.join(timeout=60)
        assert not client.is_alive(), "a client waits on the broken engine"
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == "engine_failed", events[-2:]
        assert CAUSE in error["message"] and "the server restarts the group" in error["message"]

        # The rebuild is held: the server says why it cannot take requests, and the old engine is gone.
        status, code, message = _error(_health(srv))
        assert (status, code) == (503, "engine_restarting") and CAUSE in message
        assert _error(_complete(srv))[:2] == (503, "engine_restarting")
        assert metric(srv.url, "hydragen_engine_restarting") == 1
        assert metric(srv.url, "hydragen_engine_healthy") == 0
        _wait_until(lambda: freed_when_built, "rebuilding")
        assert freed_when_built == [True]
        assert metric(srv.url, "hydragen_engine_restarts_total") == 1

        release.set()
        _wait_until(lambda: _health(srv).status_code == 200, "serving again")
        again = _complete(srv)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
        assert metric(srv.url, "hydragen_engine_restarting") == 0
        assert metric(srv.url, "hydragen_engine_restarts_total") == 1
    finally:
        release.set()
        srv.stop()


def test_a_group_that_broke_between_requests_is_seen_by_health_and_the_next_request(model_dir):
    """A worker that died while the engine was idle: /health and the next request say so at once (503
    engine_restarting), not after the engine thread's next look, and no request fails on the dead group."""
    release = threading.Event()

    def rebuild() -> LLM:
        assert release.wait(60), "the test never let the rebuild go on"
        return _llm(model_dir)

    srv = LiveServer(_llm(model_dir), "tiny", rebuild=rebuild)
    engine, dead = srv.app.state.engine_client, threading.Event()
    broken = weakref.ref(engine.llm)  # the LLM whose worker "dies"; the rebuilt one is sound
    engine.restarts.group_failure = lambda llm: CAUSE if dead.is_set() and llm is broken() else None
    try:
        assert _health(srv).status_code == 200
        dead.set()
        status, code, message = _error(_health(srv))
        assert (status, code) == (503, "engine_restarting") and CAUSE in message
        assert _error(_complete(srv))[:2] == (503, "engine_restarting")
        release.set()
        _wait_until(lambda: _health(srv).status_code == 200, "serving again")
        assert _complete(srv).status_code == 200
    finally:
        release.set()
        srv.stop()


@pytest.mark.parametrize("cap", [2, 0])
def test_a_group_that_cannot_be_rebuilt_ends_in_engine_failed_after_the_cap(model_dir, cap):
    tries: list[float] = []

    def rebuild() -> LLM:
        tries.append(time.monotonic())
        raise RuntimeError("the model no longer loads")

    options = ServerOptions(max_restarts_per_minute=cap)
    srv = LiveServer(_llm(model_dir), "tiny", options, rebuild=rebuild)
    try:
        _group_breaks_at_forward(srv.engine, first=0).set()
        status, code, message = _error(_complete(srv))
        assert (status, code) == (500, "engine_failed") and CAUSE in message
        _wait_until(lambda: _error(_health(srv))[1] == "engine_failed", "failed for good")
        status, code, message = _error(_health(srv))
        assert status == 503 and CAUSE in message
        if cap:
            capped = "not restarted again after 2 restarts in the last minute (--max-restarts-per-minute 2)"
            last = "the last one failed: rebuilding the engine failed: RuntimeError: the model no longer"
            assert capped in message and last in message
            assert tries[1] - tries[0] >= 1.0  # the second try waited the doubled backoff
        else:
            assert "not restarted: restarts are off (--max-restarts-per-minute 0)" in message
        assert len(tries) == cap
        assert metric(srv.url, "hydragen_engine_restarts_total") == cap
        assert _error(_complete(srv))[:2] == (503, "engine_failed")
    finally:
        srv.stop()


def test_an_engine_failure_of_this_process_stays_final_when_the_server_could_rebuild(model_dir):
    """Only a broken group is rebuilt: rank 0's own engine failing (a sticky CUDA error, say) is left to
    whatever supervises the process, as without tensor parallelism."""
    tries = []
    srv = LiveServer(_llm(model_dir), "tiny", rebuild=lambda: tries.append(1))
    try:

        def failing_step():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        srv.engine.step = failing_step
        status, code, message = _error(_complete(srv))
        assert (status, code) == (500, "engine_failed") and "illegal memory access" in message
        assert _error(_health(srv))[:2] == (503, "engine_failed")
        assert metric(srv.url, "hydragen_engine_restarts_total") == 0 and tries == []
    finally:
        srv.stop()
