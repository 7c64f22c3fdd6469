"""The server under tensor parallelism, as processes: `hydragen serve --tensor-parallel-size 2` answers as
TP = 1 does, a killed worker turns into OpenAI-shaped errors (never a hang), and nothing outlives it; and
`torchrun --nproc-per-node 2 -m hydragen serve` on localhost with TCP rendezvous (the README's command)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import all_gone, free_port, tiny_chat_model
from test_server_process import Lines

from hydragen import LLM, SamplingParams

READY = r"ready: serving 'tiny' on (http://127\.0\.0\.1:\d+)/v1"
PROMPT = "shared prefix, then a question"
MAX_TOKENS = 8
TP_TIMEOUT = 600  # seconds: the collective timeout the servers here run under


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("tp-serve") / "tiny")


@pytest.fixture(scope="module")
def expected_text(chat_model) -> str:
    """What TP = 1 generates for PROMPT, greedily."""
    llm = LLM(chat_model, kv_cache_tokens=2048)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return out[0].outputs[0].text


def _env() -> dict[str, str]:
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    path = os.pathsep.join(p for p in [src, os.environ.get("PYTHONPATH", "")] if p)
    return {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HYDRAGEN_API_KEY": "",
        "PYTHONPATH": path,
        "HYDRAGEN_TP_TIMEOUT": str(TP_TIMEOUT),
    }


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


def _complete(url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def test_serve_tp2_answers_like_tp1_and_a_killed_worker_is_an_error(chat_model, expected_text) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydragen", *_serve_args(chat_model), "--tensor-parallel-size", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    lines = Lines(proc)
    try:
        url = lines.wait_for(READY).group(1)
        workers = _descendants(proc.pid)
        assert len(workers) == 1
        first = _complete(url)
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected_text
        again = _complete(url)  # the prompt is now cached on every rank
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again.json()["choices"][0]["text"] == expected_text

        os.kill(workers[0], signal.SIGKILL)
        assert all_gone(workers)
        start = time.monotonic()
        failed = _complete(url)
        assert failed.status_code in (500, 503)
        error = failed.json()["error"]
        assert "worker rank 1" in error["message"] and "SIGKILL" in error["message"] and error["code"]
        later = _complete(url)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_failed"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert time.monotonic() - start < TP_TIMEOUT / 4  # seen, not waited out (a hang lasts all of it)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
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
