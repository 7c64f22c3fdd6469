"""Structured outputs through the OpenAI server: response_format, structured_outputs and the guided_*
fields on both endpoints, streaming and not; every schema of the shared set validates; bad constraints
are 400s naming the field."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hydragen import LLM
from hydragen.structured.schemas import SCHEMAS
from tests.helpers.server_helpers import LiveServer
from tests.helpers.structured_helpers import assert_valid, tiny_bpe_model

# (n, temperature) per schema, cycled: every entry point sees all four combinations.
CONFIGS = [(1, 0.0), (8, 1.0), (8, 0.0), (1, 1.0)]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tiny_bpe_model(tmp_path_factory.mktemp("bpe_server") / "model")
    srv = LiveServer(LLM(path, kv_cache_tokens=65536))
    yield srv
    srv.stop()


def _body(
    chat: bool, constraint: dict, n: int, temperature: float, stream: bool, max_tokens: int = 200
) -> dict:
    body = {"model": "tiny", "n": n, "temperature": temperature, "seed": 3, "max_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": "Fill in the record as JSON."}]
    else:
        body["prompt"] = "Fill in the record as JSON:"
    if stream:
        body["stream"] = True
    return {**body, **constraint}


def _post(live, chat: bool, body: dict) -> tuple[int, list[str], list[str]]:
    """(status, text per choice, finish_reason per choice), reading the SSE stream when streaming."""
    url = live.url + ("/v1/chat/completions" if chat else "/v1/completions")
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=300)
        if r.status_code != 200:
            return r.status_code, [r.text], []
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        texts = [c["message"]["content"] if chat else c["text"] for c in choices]
        return 200, texts, [c["finish_reason"] for c in choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, [r.read().decode()], []
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["delta"].get("content", "") if chat else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                if c.get("finish_reason"):
                    reasons[c["index"]] = c["finish_reason"]
    return 200, [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


def _spelling(i: int, schema: dict) -> dict:
    """The constraint as clients send it, rotating through the accepted spellings."""
    return [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
        {"structured_outputs": {"json": schema}},
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
    ][i % 4]


ENTRY_POINTS = [(False, False), (False, True), (True, False), (True, True)]  # (chat, stream)


def _run_schemas(live, jobs: list[tuple[str, dict, bool, dict]], jump: bool) -> None:
    """Send (name, schema, chat, body) jobs concurrently (the engine batches them); every choice must
    end with "stop" and validate."""
    live.engine.structured.jump_forward = jump
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _post(live, job[2], job[3]), jobs))
    finally:
        live.engine.structured.jump_forward = True
    for (name, schema, chat, body), (status, texts, reasons) in zip(jobs, results, strict=True):
        where = f"{name} chat={chat} stream={body.get('stream', False)} jump={jump}"
        assert status == 200, (where, texts)
        assert len(texts) == body["n"] and reasons == ["stop"] * body["n"], (where, reasons)
        for text in texts:
            assert_valid(text, schema, where)
    live.assert_no_leak()


@pytest.mark.parametrize("jump", [True, False], ids=["jump", "no_jump"])
def test_every_schema_validates(live, jump):
    """Every schema through the server in one concurrent burst, the entry points (completions, chat,
    each streaming or not) and the (n, temperature) configurations rotating over the schemas."""
    jobs = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        chat, stream = ENTRY_POINTS[i % 4]
        n, t = CONFIGS[(i // 4) % 4]
        jobs.append((name, schema, chat, _body(chat, _spelling(i, schema), n, t, stream)))
    _run_schemas(live, jobs, jump)


@pytest.mark.slow
@pytest.mark.parametrize("jump", [True, False], ids=["jump", "no_jump"])
@pytest.mark.parametrize(
    "chat, stream", ENTRY_POINTS, ids=["completions", "completions_stream", "chat", "chat_stream"]
)
def test_every_schema_validates_on_every_entry_point(live, chat, stream, jump):
    """The full matrix: every schema on every entry point, jump on and off, all four (n, T) configs."""
    jobs = [
        (name, schema, chat, _body(chat, _spelling(i, schema), n, t, stream))
        for i, (name, schema) in enumerate(SCHEMAS.items())
        for n, t in CONFIGS
    ]
    _run_schemas(live, jobs, jump)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_regex_choice_grammar_and_json_object(live, chat, stream):
    cases = [
        ({"guided_regex": r"[a-z]{2}[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2}[0-9]{3}", t)),
        ({"structured_outputs": {"regex": r"(ab|cd){1,3}"}}, lambda t: re.fullmatch(r"(ab|cd){1,3}", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "<" /[a-c]{1,4}/ ">"'}, lambda t: re.fullmatch(r"<[a-c]{1,4}>", t)),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]'}}, lambda t: re.fullmatch(r"x[0-9]", t)),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: _post(live, chat, _body(chat, c[0], 3, 1.0, stream, 40)), cases))
    for (constraint, ok), (status, texts, _) in zip(cases, results, strict=True):
        assert status == 200, (constraint, texts)
        assert all(ok(t) for t in texts), (constraint, texts)


def test_json_object_gives_a_json_object(live):
    """Any JSON object: a random model need not close it, so the check is on what it wrote: a prefix of a
    JSON object (parsed whole when the grammar ended it)."""
    status, texts, reasons = _post(
        live, True, _body(True, {"response_format": {"type": "json_object"}}, 4, 0.0, False, 60)
    )
    assert status == 200
    for text, reason in zip(texts, reasons, strict=True):
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "constraint, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
            "response_format",
        ),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "[x"}}}},
            "guided_json",
        ),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "[", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace": " "}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_constraint_is_a_400_naming_the_field(live, chat, constraint, param):
    status, texts, _ = _post(live, chat, _body(chat, constraint, 1, 0.0, False))
    assert status == 400, texts
    err = json.loads(texts[0])["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"]
    live.assert_no_leak()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_logprobs_of_forced_tokens_are_null(live, chat):
    body = _body(chat, {"guided_json": SCHEMAS["entity_movie"]}, 1, 1.0, False, 200)
    body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    r = httpx.post(live.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    values = [c["logprob"] for c in lp["content"]] if chat else lp["token_logprobs"]
    assert None in values and any(v is not None for v in values)
    if chat:
        assert all(c["top_logprobs"] == [] for c in lp["content"] if c["logprob"] is None)
        # sampled: at most the 2 asked for, only tokens the constraint allowed (so maybe fewer)
        assert all(1 <= len(c["top_logprobs"]) <= 2 for c in lp["content"] if c["logprob"] is not None)


def test_a_slow_compile_never_stalls_other_requests(live):
    """A request whose constraint takes long to compile is compiled on a request thread: while its compile
    is held (a gate, not a timing), a stream that is already decoding keeps receiving tokens."""
    import threading

    compiler = live.engine.structured.compiler
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real_build = compiler._build

    def gated_build(llguidance, source):
        if "gate" in source.text:
            threads.append(threading.current_thread().name)
            entered.set()
            assert release.wait(120)
        return real_build(llguidance, source)

    compiler._build = gated_build
    received: list[str] = []
    stream_body = {**_body(False, {}, 1, 1.0, True, 400), "ignore_eos": True}

    def stream() -> None:
        url = live.url + "/v1/completions"
        with httpx.stream("POST", url, json=stream_body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received.append(line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        deadline = time.monotonic() + 120
        while len(received) < 3:
            assert time.monotonic() < deadline and streamer.is_alive()
            time.sleep(0.01)
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(
                _post, live, False, _body(False, {"guided_regex": "gate[0-9]{2}"}, 1, 1.0, False)
            )
            assert entered.wait(120)
            before = len(received)
            while len(received) < before + 5:  # the gate is still closed: the engine thread is free
                assert time.monotonic() < deadline and streamer.is_alive(), "decoding stalled"
                time.sleep(0.01)
            release.set()
            status, texts, _ = slow.result(timeout=120)
        assert status == 200 and re.fullmatch("gate[0-9]{2}", texts[0]), texts
        assert threads and "hydragen-engine" not in threads
    finally:
        release.set()
        compiler._build = real_build
        streamer.join(timeout=300)
    live.assert_no_leak()
