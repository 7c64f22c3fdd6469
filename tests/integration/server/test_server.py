"""The OpenAI-compatible server, driven by the real `openai` client over loopback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hydragen import LLM, SamplingParams
from tests.helpers.server_helpers import (
    HeldCalls,
    LiveServer,
    metric,
    step_gate,
    tiny_chat_model,
    wait_for_log,
)

openai = pytest.importorskip("openai")
MODEL = "smol"
SYSTEM = ("You are a meticulous assistant for a public library. " * 30).strip()


@pytest.fixture(scope="module")
def server():
    # HYDRAGEN_TEST_TP=3 runs this whole file against a tensor-parallel engine (the embedded model's 9 heads
    # and 3 KV heads split over 3 ranks); the default run uses one process.
    llm = LLM(kv_cache_tokens=65536, tensor_parallel_size=int(os.environ.get("HYDRAGEN_TEST_TP", "1")))
    srv = LiveServer(llm, MODEL)
    yield srv.url, llm
    srv.stop()
    srv.app.state.engine_client.shutdown()
    llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_health_metrics(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in (
        "hydragen_requests_running",
        "hydragen_requests_waiting",
        "hydragen_kv_pages_used",
        "hydragen_kv_pages_free",
        "hydragen_prefix_cache_hit_rate",
        "hydragen_prefix_cache_unreachable_pages",
        "hydragen_generation_tokens_per_second",
    ):
        assert f"# TYPE {name}" in text


def test_completions_n4_equal_offline(client, embedded_llm):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, n=4
    )
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    offline = embedded_llm.generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )[0].outputs[0]
    assert all(c.text == offline.text for c in r.choices)
    assert r.usage.completion_tokens == 4 * len(offline.token_ids)


def test_chat_equals_offline(client, embedded_llm):
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    offline = embedded_llm.chat(msgs, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[
        0
    ].outputs[0]
    assert r.choices[0].message.content == offline.text
    assert r.choices[0].finish_reason == offline.finish_reason
    assert r.usage.prompt_tokens == len(embedded_llm.tokenizer.apply_chat_template(msgs))


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, n=2)
    full = client.completions.create(**kw)
    parts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            parts[c.index] += c.text
        if chunk.usage is not None:
            usage = chunk.usage
    assert parts == {c.index: c.text for c in full.choices}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

    msgs = [{"role": "user", "content": "Write one sentence about rivers."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=20, temperature=0)
    text, reason = "", None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=20, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert text == full.choices[0].message.content and reason == full.choices[0].finish_reason


def test_stop_seed_and_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    kw = dict(model=MODEL, prompt="Roses are red,", max_tokens=16, temperature=0.9, seed=5)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    base = client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=16, temperature=0)
    word = base.choices[0].text.split()[1]
    stopped = client.completions.create(
        model=MODEL, prompt="Roses are red,", max_tokens=16, temperature=0, stop=[word]
    )
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].text


def test_completion_logprobs_give_each_token_its_text_offset(client):
    """The legacy completions logprobs: one text_offset per token, where the token starts in the choice's
    text, counted on across stream chunks; with plain ASCII text the tokens spell the text."""
    kw = dict(model=MODEL, prompt="Roses are red, violets are", max_tokens=12, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.text_offset) == len(lp.tokens) == len(lp.token_logprobs) == 12
    ends = [0]
    for t in lp.tokens:
        ends.append(ends[-1] + len(t))
    assert lp.text_offset == ends[:-1]
    if whole.text.isascii():
        assert "".join(lp.tokens) == whole.text
        assert all(whole.text[o : o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens, strict=True))
    offsets, tokens = [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, 400, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"]


def test_client_disconnect_aborts_and_frees(server, caplog):
    """Steps pass one at a time until the first token reaches the client, which then leaves: the request
    is aborted (it never generates its 2 x 2000 tokens) and its private pages come back."""
    url, llm = server
    caplog.set_level(logging.INFO, logger="hydragen.server")
    used_before = metric(url, "hydragen_kv_pages_used")
    generated_before = llm.engine.stats.generated_tokens
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
        "n": 2,
    }
    first_token = threading.Event()

    def read_until_the_first_token():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    first_token.set()
                    return

    with step_gate(llm.engine) as gate:
        reader = threading.Thread(target=read_until_the_first_token)
        reader.start()
        while not first_token.is_set():
            gate.allow(1)
            gate.wait_at_gate()
        reader.join(timeout=60)
        wait_for_log(caplog, "client=disconnected")  # the abort is queued for the engine
        steps = gate.steps_started
        gate.open()
        deadline = time.time() + 60
        while metric(url, "hydragen_requests_running") or metric(url, "hydragen_requests_waiting"):
            assert time.time() < deadline, "aborted request still running"
            time.sleep(0.05)
    # Two sequences, one token per step: the steps let through, plus the one already at the gate.
    assert llm.engine.stats.generated_tokens - generated_before <= 2 * (steps + 1)
    # Private pages are back; what remains is the prefix cache (which may now hold this prompt).
    usage = llm.engine.kv_usage()
    assert usage["used"] == usage["cached"]
    assert metric(url, "hydragen_kv_pages_used") <= used_before + 2100


def test_32_concurrent_clients_share_a_system_prompt(server, client, embedded_llm):
    url, llm = server
    questions = [f"In one sentence, what is book number {i} about?" for i in range(32)]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    before = llm.engine.stats.prefill_tokens

    def ask(conv):
        r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, convs))
    offline = embedded_llm.chat(convs, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert answers == [o.outputs[0].text for o in offline]
    system_len = len(embedded_llm.tokenizer.apply_chat_template(convs[0][:1], add_generation_prompt=False))
    # The system prompt was computed at most a couple of times (requests that raced in before it was
    # cached), not 32 times.
    assert llm.engine.stats.prefill_tokens - before < 4 * system_len + 32 * 40


def test_serving_benchmark_quick(server, tmp_path):
    """`hydragen bench serve` against a running server at tiny sizes: it runs and writes its tables."""
    from hydragen.bench.serving import shared_prefix_load as serve

    args = argparse.Namespace(
        url=server[0],
        model=None,
        served_model_name=MODEL,
        groups=2,
        per_group=2,
        system_len=30,
        question_len=5,
        output_len=4,
        rate=0.0,
        max_num_seqs=8,
        no_baseline=True,
        out=str(tmp_path),
    )
    rows = serve.run(args)
    assert len(rows) == 1 and rows[0]["requests"] == 4 and rows[0]["output_tok_s"] > 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["rows"][0]["ttft_p50"] <= data["rows"][0]["wall_s"]
    assert "| cache on | 4 |" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "serve_ttft.png").read_bytes()[:4] == b"\x89PNG"


def test_serving_benchmark_quick_spawns_servers(tiny_models, tmp_path):
    """`hydragen bench serve --quick` starts its own servers, cache on then off, and tears them down
    (on a tiny model with a byte tokenizer: the spawning is what this checks, not the model)."""
    from hydragen.bench.serving import shared_prefix_load as serve

    model = tiny_chat_model(tiny_models["llama"], tmp_path / "model")
    serve.main(["--quick", "--model", model, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["cache on", "cache off"]
    assert all(r["requests"] == 4 and r["output_tok_s"] > 0 for r in rows)
    assert rows[0]["hit_rate"] > 0 and rows[1]["hit_rate"] == 0
    for name in ("serve_ttft.png", "serve_tpot.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_health_answers_while_huge_prompts_are_parsed_and_tokenized(server, monkeypatch):
    """Megabytes of prompt are parsed and tokenized off the event loop. Parsing and tokenizing are held
    until the test releases them, and /health must answer while they are held: were either on the event
    loop, the held call would block it and /health would never answer. One text is past the context's
    character bound (refused without tokenizing), one is under it (tokenized before its 400), one is a
    million token ids (never tokenized)."""
    from hydragen.server import body as body_module

    url, llm = server
    bodies = [
        json.dumps({"model": MODEL, "prompt": p}).encode()
        for p in ("word " * 1_400_000, "word " * 400_000, [17] * 1_000_000)
    ]
    parse = HeldCalls(body_module._parse)
    encode = HeldCalls(llm.tokenizer.encode)
    monkeypatch.setattr(body_module, "_parse", parse)
    monkeypatch.setattr(llm.tokenizer, "encode", encode)
    results = []

    def send(body):
        headers = {"content-type": "application/json"}
        results.append(httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=300))

    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    try:
        with httpx.Client(base_url=url, timeout=60) as probe:
            for t in threads:
                t.start()
            parse.wait_arrivals(3)  # all three bodies are being parsed
            assert probe.get("/health").status_code == 200
            parse.release()
            encode.wait_arrivals(1)  # the text under the character bound is being tokenized
            assert probe.get("/health").status_code == 200
            encode.release()
    finally:
        parse.release()
        encode.release()
        for t in threads:
            t.join(timeout=300)
    assert [r.status_code for r in results] == [400] * 3
    assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in results)
    assert encode.arrived == 1  # the text past the bound and the token ids were never tokenized


def test_sequential_requests_keep_their_own_sampling_settings(server, embedded_llm):
    """One request after another, alternating greedy and seeded sampling with different top_p / top_k:
    each answer equals the offline answer for its own settings (never a finished request's settings)."""
    url, _ = server
    kinds = [
        dict(temperature=0),
        dict(temperature=1.2, top_p=0.9, seed=3),
        dict(temperature=0.7, top_k=5, seed=4),
    ]
    prompt = "Once upon a time"
    offline = [
        embedded_llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **k), use_tqdm=False)[0]
        for k in kinds
    ]
    for i in range(12):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **kinds[i % 3]}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline[i % 3].outputs[0].text, i


def test_32_streaming_clients_on_both_endpoints(server, client, embedded_llm):
    """32 concurrent streams, half chat and half completions: tokenizing on the server's threads beside the
    engine's detokenizing, every stream equals the offline output."""
    questions = [f"In one sentence, what is book number {i} about?" for i in range(32)]

    def ask(i: int) -> str:
        if i % 2:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": questions[i]}],
                max_tokens=10,
                temperature=0,
                stream=True,
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stream = client.completions.create(
            model=MODEL, prompt=questions[i], max_tokens=10, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    greedy = SamplingParams(max_tokens=10, temperature=0)
    for i, answer in enumerate(answers):
        if i % 2:
            conv = [{"role": "user", "content": questions[i]}]
            want = embedded_llm.chat(conv, greedy, use_tqdm=False)[0].outputs[0].text
        else:
            want = embedded_llm.generate(questions[i], greedy, use_tqdm=False)[0].outputs[0].text
        assert answer == want, i


def test_metrics_read_the_engine_snapshot(server, monkeypatch):
    """/metrics reads what the engine thread published after its last step, never the live engine: the
    KV manager's usage is only ever asked for from the engine thread."""
    url, llm = server
    callers = []
    real = llm.engine.kv.usage

    def usage():
        callers.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(llm.engine.kv, "usage", usage)
    body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                assert metric(url, "hydragen_kv_pages_used") >= 0
    assert metric(url, "hydragen_kv_pages_used") > 0
    assert callers and set(callers) == {"hydragen-engine"}


def test_model_sampling_defaults_fill_what_a_request_leaves_unset(tiny_models, tmp_path):
    """generation_config.json says temperature 0: a request naming no temperature decodes greedily (the
    same text as an explicit temperature 0, whatever its seed), one naming a temperature keeps it."""
    model = tiny_chat_model(tiny_models["llama"], tmp_path / "model")
    gen = tmp_path / "model" / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "temperature": 0.0}))
    llm = LLM(model, kv_cache_tokens=2048)
    srv = LiveServer(llm, "tiny")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="tiny", prompt="abc", max_tokens=12)
        greedy = client.completions.create(**ask, temperature=0).choices[0].text
        assert all(client.completions.create(**ask, seed=s).choices[0].text == greedy for s in (1, 2, 3))
        sampled = {
            client.completions.create(**ask, temperature=1.0, seed=s).choices[0].text for s in range(4)
        }
        assert sampled != {greedy}
    finally:
        srv.stop()
        srv.app.state.engine_client.shutdown()
