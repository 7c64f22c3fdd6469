"""`hydragen serve` as a process: options checked before the model loads, the ready line, and SIGTERM
with requests in flight (bounded grace, then an error for what is left; a second signal exits at once)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.helpers.server_helpers import Lines, metric, spawn, tiny_chat_model

STEP_DELAY = 0.05  # seconds before every engine step: a 500-token request then runs >= 25 s on any machine


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("proc") / "tiny")


def test_bad_options_are_one_line_errors_before_the_model_loads(model_dir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = {
        "port": (["--port", "70000"], "--port must be in [0, 65535]"),
        "busy": (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
        "level": (["--log-level", "loud"], "--log-level must be one of"),
        "restarts": (["--max-restarts-per-minute", "-1"], "--max-restarts-per-minute must be an integer"),
        "events": (["--kv-events-endpoint", "localhost:5557"], "--kv-events-endpoint must be a ZMQ address"),
        "events-busy": (
            ["--port", "0", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}"],
            "cannot publish KV events",
        ),
    }
    procs = {name: spawn("--model", model_dir, *args) for name, (args, _) in cases.items()}  # in parallel
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            lines = [x for x in err.splitlines() if x.strip()]
            assert proc.returncode == 2, (name, err)
            assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
            assert cases[name][1] in lines[0], (name, lines[0])
    finally:
        busy.close()
        for proc in procs.values():
            proc.kill()


def start_server(model_dir: str, grace: float, api_key: str = "") -> tuple[subprocess.Popen, Lines, str]:
    """A server whose engine steps are slowed (STEP_DELAY), so its long requests outlast any grace here."""
    proc = spawn(
        "--model",
        model_dir,
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--shutdown-timeout",
        str(grace),
        "--kv-cache-tokens",
        "8192",
        api_key=api_key,
        step_delay=STEP_DELAY,
    )
    lines = Lines(proc)
    m = lines.wait_for(
        r"ready: serving 'tiny' on (http://127\.0\.0\.1:\d+)/v1 \| KV cache 8192 tokens \(\d+ MiB\)"
        + r" \| API key "
        + ("required" if api_key else "not required")
    )
    return proc, lines, m.group(1)


def test_sigterm_finishes_short_requests_and_aborts_long_ones_after_the_grace(model_dir):
    """The long requests need >= 500 slowed steps (25 s), longer than the grace on any machine; the short
    one needs 5 steps, which it gets within the grace unless the machine is absurdly slow."""
    grace = 8
    assert 2 * grace < 500 * STEP_DELAY
    proc, lines, url = start_server(model_dir, grace=grace)
    results: dict = {}
    first_chunk = threading.Event()
    long_body = {"model": "tiny", "prompt": "go on and on", "max_tokens": 500, "n": 8, "ignore_eos": True}

    def streaming():
        events = []
        with httpx.stream(
            "POST", url + "/v1/completions", json={**long_body, "stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
                    events.append(line[6:])
        results["stream"] = events

    def plain(name, body):
        results[name] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    threads = [
        threading.Thread(target=streaming),
        threading.Thread(target=plain, args=("long", long_body)),
    ]
    try:
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        short = threading.Thread(
            target=plain,
            args=("short", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "ignore_eos": True}),
        )
        short.start()
        # SIGTERM only once the short request is in the batch (16 long sequences + it), or done: a loaded
        # machine may take longer than any fixed sleep to parse it, and then it would meet the shutdown
        deadline = time.time() + 60
        while "short" not in results and metric(url, "hydragen_requests_running") < 17:
            assert time.time() < deadline, "the short request never reached the batch"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        lines.wait_for("shutting down: no new requests")
        deadline = time.time() + 30
        while True:  # the listener closes (on the server's next tick), while requests are still in flight
            try:
                httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                break
            assert time.time() < deadline, "the server kept accepting connections after SIGTERM"
            time.sleep(0.05)
        assert "long" not in results  # in flight: closing the listener did not end it
        for t in [*threads, short]:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        elapsed = time.time() - t0
    finally:
        proc.kill()
    assert results["short"].status_code == 200  # finished within the grace period
    assert results["short"].json()["usage"]["completion_tokens"] == 5
    err = results["long"].json()["error"]
    assert results["long"].status_code == 503 and err["code"] == "shutting_down"
    assert results["stream"][-1] == "[DONE]"
    assert json.loads(results["stream"][-2])["error"]["code"] == "shutting_down"
    assert grace <= elapsed < grace + 30
    log = "\n".join(lines.lines)
    assert "POST /v1/completions 200" in log and "POST /v1/completions 503" in log
    assert "go on and on" not in log  # no prompt text in the request lines


def test_a_second_signal_exits_at_once(model_dir):
    """Also: the API key comes from $HYDRAGEN_API_KEY when --api-key is not given."""
    proc, lines, url = start_server(model_dir, grace=60, api_key="env-key")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 500, "n": 8, "ignore_eos": True}
    auth = {"Authorization": "Bearer env-key"}
    thread = threading.Thread(
        target=lambda: pytest.raises(
            httpx.TransportError, httpx.post, url + "/v1/completions", json=body, headers=auth, timeout=60
        )
    )
    try:
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        thread.start()
        deadline = time.time() + 60
        while metric(url, "hydragen_requests_running") < 8:  # in flight (500 slowed steps: >= 25 s)
            assert time.time() < deadline, "the request never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        lines.wait_for("shutting down")
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert time.time() - t0 < 5 and code == 128 + signal.SIGTERM
    finally:
        proc.kill()
        thread.join(timeout=30)
