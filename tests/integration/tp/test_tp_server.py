"""The server under tensor parallelism, as processes: `hydragen serve --tensor-parallel-size 2` answers as
TP = 1 does, a request whose forward fails (on every rank, or on the worker only) gets its error while the
others complete, a worker killed during requests turns every one in flight into an OpenAI-shaped error
(never a hang) and the server rebuilds the group and serves again, a group that keeps dying is rebuilt at
most --max-restarts-per-minute times, and nothing outlives it; and `torchrun --nproc-per-node 2 -m hydragen
serve` on localhost with TCP rendezvous (the README's command)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hydragen import LLM, SamplingParams
from tests.helpers.paths import SLOWED, SRC
from tests.helpers.server_helpers import Lines, all_gone, free_port, metric, process_alive, tiny_chat_model
from tests.helpers.tp_faults import ENV as FAULTS_ENV
from tests.helpers.tp_faults import SITE as FAULTS_SITE

READY = r"ready: serving 'tiny' on (http://127\.0\.0\.1:\d+)/v1"
PROMPT = "shared prefix, then a question"
MAX_TOKENS = 8
STREAM_TOKENS = 400  # a stream's tokens: each takes STEP_DELAY at least, so it is in flight >= 8 s
TP_TIMEOUT = 600  # seconds: the collective timeout the servers here run under
STEP_DELAY = 0.02  # seconds before every engine step: a request of N tokens is in flight >= N x this
FAULTS = [  # a prompt holding the token fails its forward on those ranks (tests/helpers/tp_faults.py)
    {"token": 250, "ranks": [0, 1], "at": 1},
    {"token": 252, "ranks": [1], "at": 1},
]


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("tp-serve") / "tiny")


@pytest.fixture(scope="module")
def expected_text(chat_model) -> str:
    """What TP = 1 generates for PROMPT, greedily."""
    llm = LLM(chat_model, kv_cache_tokens=2048)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return out[0].outputs[0].text


@pytest.fixture(scope="module")
def stream_tokens(chat_model) -> list[int]:
    """What TP = 1 generates for PROMPT, greedily, over a stream's STREAM_TOKENS; TP = 2 generates the same:
    its logits are within 1e-5 of TP = 1's, far below the gap between any of these steps' top two."""
    llm = LLM(chat_model, kv_cache_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True, logprobs=2)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    for step in out.logprobs:
        first, second = sorted(step.values(), reverse=True)[:2]
        assert first - second > 1e-4
    return out.token_ids


def _env(faults: list[dict] | None = None, stalls: Path | None = None) -> dict[str, str]:
    """The servers' environment; ``faults`` are installed on every rank (tests/helpers/tp_faults.py);
    ``stalls``: the folder where a slowed server looks for its hold, stall and fail files
    (tests/helpers/slowed_hydragen.py)."""
    site = FAULTS_SITE if faults else ""
    path = os.pathsep.join(p for p in [str(SRC), site, os.environ.get("PYTHONPATH", "")] if p)
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HYDRAGEN_API_KEY": "",
        "PYTHONPATH": path,
        "HYDRAGEN_TP_TIMEOUT": str(TP_TIMEOUT),
    }
    if faults:
        env[FAULTS_ENV] = json.dumps(faults)
    if stalls is not None:
        env["HYDRAGEN_TEST_STALLS"] = str(stalls)
    return env


def _serve_args(model: str) -> list[str]:
    return [
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--kv-cache-tokens",
        "2048",
    ]


def _complete(url: str, prompt: str | list[int] = PROMPT) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _concurrently(calls: dict) -> dict:
    """Run the zero-argument ``calls`` on threads at once; their results by name."""
    results: dict = {}
    threads = [threading.Thread(target=lambda k=k, f=f: results.update({k: f()})) for k, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def _stream_events(url: str, started: threading.Event) -> list[str]:
    """A long streamed completion's ``data:`` payloads; ``started`` is set at its first one. Greedy, so that
    its tokens are ``stream_tokens``, none of them poison (sampled ones would hit one sooner or later)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                events.append(line[6:])
    return events


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, whichever of their parent's threads started them (a rebuilt group's
    workers are the server's engine thread's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
        out += kids
        todo += kids
    return out


def _error_code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"] if response.status_code != 200 else "ok"


def _wait_for_health(url: str, code: str, timeout: float = 180) -> httpx.Response:
    """Until /health answers with ``code`` ("ok" for 200); fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10)
        if _error_code(health)[1] == code:
            return health
        assert time.monotonic() < deadline, f"/health still answers {health.text}"
        time.sleep(0.05)


def _wait_for_metric(url: str, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (seen := metric(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {seen}, not {value}"
        time.sleep(0.05)


def test_serve_tp2_fails_a_request_alone_and_restarts_the_group_a_killed_worker_broke(
    chat_model, expected_text, stream_tokens, tmp_path
) -> None:
    held = tmp_path / "hold-the-rebuilt-worker"  # while it exists, a rebuilt worker waits at its load
    faults = [*FAULTS, {"at": "load", "ranks": [1], "action": "stall", "while_exists": str(held)}]
    proc = subprocess.Popen(
        [sys.executable, SLOWED, str(STEP_DELAY), *_serve_args(chat_model), "--tensor-parallel-size", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(faults, stalls=tmp_path),
    )
    lines = Lines(proc)
    hold = tmp_path / f"{proc.pid}.hold"  # while it exists, the server's steps do nothing (slowed_hydragen)
    try:
        url = lines.wait_for(READY).group(1)
        workers = _descendants(proc.pid)
        assert len(workers) == 1
        first = _complete(url)
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected_text
        again = _complete(url)  # the prompt is now cached on every rank
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again.json()["choices"][0]["text"] == expected_text

        # Requests whose forward fails get their own error; the one sent with them completes. They share
        # one step: the poisoned two alone in a step would be an engine failure (every request of the step
        # failing alone is not one request's fault), so the steps are held until all three wait.
        replies: dict = {}
        calls = {
            "every rank": lambda: _complete(url, [60, 61, 250, 62]),
            "worker only": lambda: _complete(url, [70, 71, 252, 72]),
            "innocent": lambda: _complete(url),
        }
        hold.touch()
        sent = threading.Thread(target=lambda: replies.update(_concurrently(calls)))
        sent.start()
        _wait_for_metric(url, "hydragen_requests_waiting", 3)
        hold.unlink()
        sent.join(timeout=120)
        for name, token in [("every rank", 250), ("worker only", 252)]:
            error = replies[name].json()["error"]
            assert replies[name].status_code == 500 and error["code"] == "request_failed", error
            assert f"injected fault on token {token}" in error["message"]
        assert replies["innocent"].status_code == 200
        assert replies["innocent"].json()["choices"][0]["text"] == expected_text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

        # SIGKILL (running out of memory, on a CPU) during three requests: each gets an error event. Their
        # tokens hold no poison token: only the kill can end them.
        assert not {f["token"] for f in FAULTS} & set(stream_tokens)
        started = [threading.Event() for _ in range(3)]
        calls = {i: lambda e=e: _stream_events(url, e) for i, e in enumerate(started)}
        streams = threading.Thread(target=lambda: replies.update(_concurrently(calls)))
        streams.start()
        assert all(e.wait(60) for e in started)
        held.touch()
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        streams.join(timeout=120)
        assert all_gone(workers)  # the dead worker is reaped
        for i in range(3):
            events = replies[i]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_failed", error
            assert "worker rank 1" in error["message"] and "SIGKILL" in error["message"]
            assert "the server restarts the group" in error["message"]
        assert time.monotonic() - start < TP_TIMEOUT / 4  # seen, not waited out (a hang lasts all of it)

        # While the group is rebuilt (held at its new worker's load): 503 engine_restarting, naming why.
        later = _complete(url)
        assert _error_code(later) == (503, "engine_restarting"), later.text
        health = httpx.get(f"{url}/health", timeout=10)
        assert _error_code(health) == (503, "engine_restarting")
        assert f"worker rank 1 (pid {workers[0]}) was killed by SIGKILL" in health.json()["error"]["message"]
        assert metric(url, "hydragen_engine_restarting") == 1
        _wait_for_metric(url, "hydragen_engine_restarts_total", 1)  # counted once its backoff is over
        held.unlink()
        _wait_for_health(url, "ok")
        again = _complete(url)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected_text
        rebuilt = _descendants(proc.pid)
        assert len(rebuilt) == 1 and rebuilt[0] != workers[0]
        assert metric(url, "hydragen_engine_restarting") == 0
        assert metric(url, "hydragen_engine_restarts_total") == 1
        lines.wait_for(r"the tensor-parallel group was restarted \(restart 1\): serving again")
        assert not any("still referenced" in line for line in lines.lines)  # the old model was freed first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert all_gone(workers + rebuilt)


def test_a_group_that_keeps_dying_is_rebuilt_at_most_the_cap_then_the_engine_failed(
    chat_model, tmp_path
) -> None:
    """A worker killed between requests is seen without a request; every rebuilt worker then dies as it
    starts: the server tries --max-restarts-per-minute times (1 here, for time:
    tests/integration/server/test_server_restarts.py has 2, and the backoff between), then answers 503
    engine_failed for good, with every worker it started gone."""
    doomed = tmp_path / "rebuilt-workers-die"  # while it exists, a worker dies as it loads its shard
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydragen", *_serve_args(chat_model), "--tensor-parallel-size", "2"]
        + ["--max-restarts-per-minute", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env([{"at": "load", "ranks": [1], "action": "kill", "while_exists": str(doomed)}]),
    )
    lines = Lines(proc)
    workers: list[int] = []
    try:
        url = lines.wait_for(READY).group(1)
        workers = _descendants(proc.pid)
        assert len(workers) == 1
        doomed.touch()
        os.kill(workers[0], signal.SIGKILL)
        health = _wait_for_health(url, "engine_failed")
        message = health.json()["error"]["message"]
        assert f"worker rank 1 (pid {workers[0]}) was killed by SIGKILL" in message  # the first cause
        capped = "not restarted again after 1 restart in the last minute (--max-restarts-per-minute 1)"
        assert capped in message
        assert "killed by SIGKILL while starting" in message  # why the last rebuild failed
        assert metric(url, "hydragen_engine_restarts_total") == 1
        failed = [re.search(r"restart (\d) of the tensor-parallel group failed", x) for x in lines.lines]
        assert [m.group(1) for m in failed if m] == ["1"]
        started = [int(p) for x in lines.lines for p in re.findall(r"worker rank 1 \(pid (\d+)\)", x)]
        assert len(set(started) - set(workers)) == 1  # the rebuild's worker, reaped
        assert not any(process_alive(p) for p in [*started, *_descendants(proc.pid)])
        later = _complete(url)
        assert _error_code(later) == (503, "engine_failed")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert all_gone(workers)


def test_torchrun_two_ranks_on_localhost_with_tcp_rendezvous(chat_model, expected_text) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "hydragen",
        *_serve_args(chat_model),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    lines = Lines(proc)
    ranks: list[int] = []
    try:
        url = lines.wait_for(READY).group(1)
        ranks = _descendants(proc.pid)
        reply = _complete(url)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected_text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert ranks and all_gone(ranks)
