"""The engine step watchdog (issue 39, defect 11): a server stuck inside a step answered "ok" on /health, so
nothing routed away from it. Past ``--step-timeout`` it now answers 503 ``engine_stalled``, refuses new
requests the same way, and logs the stuck step's requests; when the step ends, all is as before.

The stall is injected: the model's forward is held until the test lets it go, so the step is stuck for
exactly as long as the test looks at it, however fast the machine."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from hydragen import LLM
from hydragen.server.options import ServerOptions
from hydragen.server.step_watchdog import StepWatchdog
from tests.helpers.server_helpers import HeldCalls, LiveServer, metric, tiny_chat_model, wait_for_log

BOUND = 0.2  # seconds: the test holds the step far longer, and waits for nothing shorter


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("watchdog") / "tiny")


def wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed assumption
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_stalled_step_turns_health_503_names_its_requests_and_clears_when_it_ends(model_dir, caplog):
    srv = LiveServer(LLM(model_dir, kv_cache_tokens=4096), "tiny", ServerOptions(step_timeout=BOUND))
    runner = srv.engine.runner
    held = HeldCalls(runner.forward)
    try:
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}  # idle: no step, never stalled
        runner.forward = held
        body = {"model": "tiny", "prompt": "a request whose step hangs", "max_tokens": 3, "ignore_eos": True}
        result: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: result.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=120))
        )
        client.start()
        held.wait_arrivals(1)  # the engine thread is inside the step's forward, and stays there
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, "/health to turn 503")
        err = httpx.get(srv.url + "/health").json()["error"]
        assert err["code"] == "engine_stalled" and f"step timeout of {BOUND:g} s" in err["message"], err
        refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stalled"
        assert metric(srv.url, "hydragen_engine_healthy") == 0
        wait_for_log(caplog, "engine step stalled")
        stalled = next(r.getMessage() for r in caplog.records if "engine step stalled" in r.getMessage())
        assert f"past --step-timeout {BOUND:g} s" in stalled
        held.release()  # the step ends: its request completes, and the engine is healthy again
        client.join(timeout=60)
        assert not client.is_alive() and result[0].status_code == 200, result
        assert f"its requests: {result[0].json()['id']} (" in stalled, stalled  # named as the log names it
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, "/health to be ok again")
        wait_for_log(caplog, "the stalled engine step ended after")
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        srv.assert_no_leak()
    finally:
        held.release()
        srv.stop()


def test_the_watchdog_counts_only_the_running_step_past_its_bound():
    now = [100.0]
    dog = StepWatchdog(5.0, lambda: "", clock=lambda: now[0])
    assert dog.stalled() is None
    dog.begin()
    now[0] = 105.0
    assert dog.stalled() is None  # at the bound: not past it
    now[0] = 105.5
    assert dog.stalled() == pytest.approx(5.5)
    dog.end()
    assert dog.stalled() is None  # between steps nothing is stalled
    off = StepWatchdog(0, lambda: "", clock=lambda: now[0])
    off.begin()
    now[0] = 1e9
    assert off.stalled() is None  # 0: the watchdog is off
    dog.close()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_step_timeout_must_be_a_finite_number_of_seconds(bad):
    with pytest.raises(ValueError, match="--step-timeout must be a finite number >= 0"):
        ServerOptions(step_timeout=bad).check()
