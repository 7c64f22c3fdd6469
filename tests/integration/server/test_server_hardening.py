"""The server against bad, rude and failing requests: every error in OpenAI's shape with the right status
and parameter, limits, access control, cancellation, fault isolation over HTTP, metrics and log lines.
A tiny random model with a byte-level tokenizer keeps it fast (context 512, vocabulary 256)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from hydragen import LLM, SamplingParams
from hydragen.engine.sampler import derive_seed
from hydragen.server.options import ServerOptions
from tests.helpers.server_helpers import (
    LiveServer,
    StepGate,
    metric,
    step_gate,
    tiny_chat_model,
    wait_for_log,
)

openai = pytest.importorskip("openai")
KEY = "test-key"
LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def live(model_dir):
    options = ServerOptions(
        api_key=KEY,
        allowed_hosts=["127.0.0.1", "localhost"],
        max_request_bytes=LIMIT,
        read_timeout=1.5,
        keep_alive_timeout=0.5,
    )
    srv = LiveServer(LLM(model_dir, kv_cache_tokens=4096), "tiny", options)
    yield srv
    srv.stop()


def post(srv, path, body, headers=None, timeout=30):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **srv.headers(), **(headers or {})}
    return httpx.post(srv.url + path, content=content, headers=hdrs, timeout=timeout)


def assert_openai_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD = [
    # (path, body, status, param, code)
    (C, b"{not json", 400, None, "invalid_json"),
    (C, b'\xff\xfe{"model": "tiny"}', 400, None, "invalid_json"),
    (C, b"", 400, None, "invalid_json"),
    (C, b"[1, 2]", 400, None, "invalid_json"),
    (C, b"[" * 100_000, 400, None, "invalid_json"),
    (C, b'{"model": "tiny", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400, None, "invalid_json"),
    (C, b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', 400, "prompt[1]", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"]}', 400, "stop[0]", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400, "top_p", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": "x", "temperature": -Infinity}', 400, "temperature", "invalid_value"),
    (C, b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', 400, "temperature", "invalid_value"),
    (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (C, {"prompt": "x"}, 400, "model", "missing_required_parameter"),
    (C, {"model": "tiny"}, 400, "prompt", "missing_required_parameter"),
    (C, {**OK, "foo": 1}, 400, "foo", "unsupported_parameter"),
    (C, {**OK, "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    (C, {**OK, "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    (C, {**OK, "echo": True}, 400, "echo", "unsupported_parameter"),
    (C, {**OK, "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
    (C, {**OK, "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    (C, {**OK, "frequency_penalty": -1}, 400, "frequency_penalty", "unsupported_parameter"),
    (CHAT, {**MSG, "response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value"),
    (
        CHAT,
        {**MSG, "tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]},
        400,
        "tools[0].function.name",
        "invalid_value",
    ),
    (CHAT, {**MSG, "tool_choice": "auto"}, 400, "tool_choice", "invalid_value"),
    (
        C,
        {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        "unsupported_parameter",
    ),
    (
        CHAT,
        {**MSG, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id",
        "invalid_value",
    ),
    (CHAT, {**MSG, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    (CHAT, {**MSG, "guided_json": "{not json"}, 400, "guided_json", "invalid_value"),
    (CHAT, {**MSG, "structured_outputs": {"jsonn": {}}}, 400, "structured_outputs", "unsupported_parameter"),
    (
        CHAT,
        {**MSG, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
        400,
        "messages[0].name",
        "unsupported_parameter",
    ),
    (
        CHAT,
        {**MSG, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    (
        CHAT,
        {**MSG, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options.continuous_usage_stats",
        "unsupported_parameter",
    ),
    (C, {**OK, "n": "2"}, 400, "n", "invalid_value"),
    (C, {**OK, "max_tokens": True}, 400, "max_tokens", "invalid_value"),
    (C, {**OK, "top_k": 1.5}, 400, "top_k", "invalid_value"),
    (C, {**OK, "stream": "yes"}, 400, "stream", "invalid_value"),
    (C, {**OK, "prompt": 123}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": {"text": "x"}}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": []}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": ""}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": [[1, 2], []]}, 400, "prompt[1]", "invalid_value"),
    (C, {**OK, "prompt": [1, 256]}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": [-1]}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": [2**64]}, 400, "prompt", "invalid_value"),
    (C, {**OK, "prompt": "a" * 600}, 400, "prompt", "context_length_exceeded"),
    (C, {**OK, "prompt": "a" * 200_000}, 400, "prompt", "context_length_exceeded"),
    (C, {**OK, "prompt": [5] * 512}, 400, "prompt", "context_length_exceeded"),
    (C, {**OK, "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    (C, {**OK, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (C, {**OK, "max_tokens": 2**63}, 400, "max_tokens", "invalid_value"),
    (C, {**OK, "top_k": 2**63}, 400, "top_k", "invalid_value"),
    (C, {**OK, "top_k": -1}, 400, "top_k", "invalid_value"),
    (C, {**OK, "top_p": 1e-46}, 400, "top_p", "invalid_value"),
    (C, {**OK, "top_p": 0}, 400, "top_p", "invalid_value"),
    (C, {**OK, "temperature": 1e-300}, 400, "temperature", "invalid_value"),
    (C, {**OK, "temperature": 3.5e38}, 400, "temperature", "invalid_value"),
    (C, {**OK, "seed": 2**64}, 400, "seed", "invalid_value"),
    (C, {**OK, "seed": -(2**63) - 1}, 400, "seed", "invalid_value"),
    (C, {**OK, "n": 0}, 400, "n", "invalid_value"),
    (C, {**OK, "n": 2**64}, 400, "n", "invalid_value"),
    (C, {**OK, "prompt": ["a", "b", "c"], "n": 400}, 400, "n", "invalid_value"),
    (C, {**OK, "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (C, {**OK, "stop": ["x"] * 65}, 400, "stop", "invalid_value"),
    (C, {**OK, "stop": ["x" * 2000]}, 400, "stop", "invalid_value"),
    (C, {**OK, "stop": [""]}, 400, "stop", "invalid_value"),
    (C, {**OK, "stop_token_ids": [256]}, 400, "stop_token_ids", "invalid_value"),
    (C, {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids", "invalid_value"),
    (CHAT, {**MSG, "messages": []}, 400, "messages", "invalid_value"),
    (
        CHAT,
        {**MSG, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        CHAT,
        {**MSG, "messages": [{"role": "user", "content": "a" * 3000}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (CHAT, {**MSG, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    (
        CHAT,
        {**MSG, "max_tokens": None, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        CHAT,
        {**MSG, "max_tokens": None, "max_completion_tokens": 1000},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (C, {**OK, "model": "gpt-4"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_requests_get_openai_errors_naming_the_parameter(live, path, body, status, param, code):
    r = post(live, path, body)
    assert_openai_error(r, status, param, code)


@pytest.mark.parametrize("stream", [False, True])
def test_errors_come_before_a_stream_starts(live, stream):
    """A streaming request that is refused gets the same JSON error, not an event stream."""
    r = post(live, C, {**OK, "top_k": -1, "stream": stream})
    assert_openai_error(r, 400, "top_k")
    assert r.headers["content-type"].startswith("application/json")


def test_routes_methods_keys_and_hosts(live):
    r = httpx.get(live.url + "/v1/nothing", headers=live.headers())
    assert_openai_error(r, 404, code="unknown_url")
    r = httpx.get(live.url + C, headers=live.headers())
    assert_openai_error(r, 405, code="method_not_allowed")
    r = httpx.post(live.url + C, json=OK)  # no key
    assert_openai_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(live.url + C, json=OK, headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401, code="invalid_api_key")
    r = httpx.post(live.url + C, json=OK, headers={**live.headers(), "Host": "evil.example"})
    assert_openai_error(r, 400, code="invalid_host")
    # Probes need no key; the Host check applies to them too.
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    assert httpx.get(live.url + "/metrics").status_code == 200
    assert_openai_error(httpx.get(live.url + "/health", headers={"Host": "evil.example"}), 400)
    # The official client with the key works, and without it gets the SDK's AuthenticationError.
    good = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_neutral_values_of_unimplemented_parameters_and_harmless_fields_are_accepted(live):
    body = {
        **OK,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "best_of": 1,
        "echo": False,
        "logit_bias": {},
        "suffix": None,
        "user": "someone",
        "metadata": {"a": "b"},
        "store": False,
    }
    r = post(live, C, body)
    assert r.status_code == 200, r.text
    chat = {**MSG, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u"}
    assert post(live, CHAT, chat).status_code == 200


def test_body_size_limit_is_a_413(live):
    big = json.dumps({**OK, "prompt": "a" * LIMIT}).encode()
    assert_openai_error(post(live, C, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(LIMIT // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(
        live.url + C, content=chunks(), headers={**live.headers(), "content-type": "application/json"}
    )
    assert_openai_error(r, 413, code="request_too_large")
    assert post(live, C, OK).status_code == 200  # the server is fine afterwards


def raw_connection(live) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    return s


def test_stalled_clients_cannot_hold_connections(live):
    """A body that never completes gets a 408 after the read timeout; a connection that never sends a
    request is closed after the read and keep-alive timeouts."""
    with raw_connection(live) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"model": '
        )
        t0 = time.time()
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert b'"request_timeout"' in reply
        assert time.time() - t0 < 8
    with raw_connection(live) as s:
        t0 = time.time()
        assert s.recv(1024) == b""  # closed by the server, nothing sent
        assert 1.5 <= time.time() - t0 < 8
    with raw_connection(live) as s:  # half a request line, then silence
        s.sendall(b"GET /hea")
        assert s.recv(1024) == b""


def test_unparseable_http_gets_an_openai_error(live):
    with raw_connection(live) as s:
        s.sendall(b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    assert json.loads(body)["error"]["code"] == "invalid_http"


def test_non_streaming_client_that_leaves_is_aborted(live, caplog):
    """The engine waits at its step gate, so the request is still running when the client leaves, however
    fast the machine; once the server has handled the disconnect the gate opens, and the request ends after
    the one step that was already waiting instead of generating its 4 x 480 tokens."""
    caplog.set_level(logging.INFO, logger="hydragen.server")
    engine = live.engine
    before = engine.stats.generated_tokens
    body = {**OK, "prompt": "tell me everything", "max_tokens": 480, "n": 4, "ignore_eos": True}
    with step_gate(engine) as gate:
        with pytest.raises(httpx.ReadTimeout):
            post(live, C, body, timeout=1.0)
        wait_for_log(caplog, "client=disconnected")  # the abort is queued for the engine
        assert gate.steps_started == 0
        gate.open()
        live.wait_idle(timeout=60)
    assert engine.stats.generated_tokens - before <= 4  # one step of 4 sequences, then the abort
    live.assert_no_leak()


def test_chat_without_max_tokens_gets_the_room_left(live):
    content = "x" * 480  # one token per byte
    r = post(
        live,
        CHAT,
        {**MSG, "max_tokens": None, "messages": [{"role": "user", "content": content}], "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == 512
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # Completions keep OpenAI's default of 16, capped to the room left.
    r = post(live, C, {"model": "tiny", "prompt": [7] * 505, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 7


def test_metrics_have_latency_histograms(live):
    for stream in (False, True):
        assert post(live, C, {**OK, "stream": stream}).status_code == 200
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "hydragen_time_to_first_token_seconds",
        "hydragen_time_per_output_token_seconds",
        "hydragen_e2e_request_latency_seconds",
        "hydragen_request_queue_time_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
        buckets = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] >= 2
        count = next(
            float(line.split()[1]) for line in text.splitlines() if line.startswith(name + "_count ")
        )
        assert count == buckets[-1]
    for gauge in ("hydragen_kv_pages_used", "hydragen_requests_running", "hydragen_engine_healthy"):
        assert f"# TYPE {gauge} gauge" in text


# The families /metrics served before prometheus_client wrote it (the text was built by hand): dashboards
# read these names, types and help texts. A counter's family name is its sample's without "_total".
METRIC_FAMILIES = [
    ("hydragen_requests_running", "gauge", "sequences holding KV pages (decoding or prefilling)"),
    ("hydragen_requests_waiting", "gauge", "sequences waiting for admission"),
    ("hydragen_kv_pages_used", "gauge", "KV pages in use, held or cached (16 tokens a page)"),
    ("hydragen_kv_pages_free", "gauge", "free KV pages"),
    ("hydragen_kv_pages_peak", "gauge", "most KV pages in use at once since start"),
    ("hydragen_kv_page_size", "gauge", "tokens a KV page holds"),
    ("hydragen_prefix_cache_tokens", "gauge", "tokens held by the prefix tree (whole pages)"),
    ("hydragen_prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens"),
    (
        "hydragen_prefix_cache_unreachable_pages",
        "gauge",
        "cached pages no hit can use: their sliding windows' pages are gone (0 without windows)",
    ),
    ("hydragen_generation_tokens_per_second", "gauge", "decode rate over the last 5 s"),
    ("hydragen_engine_healthy", "gauge", "1 while the engine takes requests"),
    (
        "hydragen_engine_restarting",
        "gauge",
        "1 while the engine is rebuilt after its tensor-parallel group broke",
    ),
    (
        "hydragen_engine_restarts",
        "counter",
        "tries to rebuild the engine after its tensor-parallel group broke (failed ones included)",
    ),
    ("hydragen_prompt_tokens", "counter", "prompt tokens of admitted sequences"),
    ("hydragen_prefill_tokens", "counter", "prompt tokens computed"),
    ("hydragen_generation_tokens", "counter", "generated tokens"),
    ("hydragen_requests_finished", "counter", "finished requests"),
    ("hydragen_requests_failed", "counter", "requests ended by an engine error"),
    ("hydragen_preemptions", "counter", "sequences preempted for memory"),
    ("hydragen_time_to_first_token_seconds", "histogram", "time from arrival to the first generated token"),
    (
        "hydragen_time_per_output_token_seconds",
        "histogram",
        "mean time between generated tokens of a request",
    ),
    ("hydragen_e2e_request_latency_seconds", "histogram", "time from arrival to the last token"),
    ("hydragen_request_queue_time_seconds", "histogram", "time from arrival until first scheduled"),
]
LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


def test_metrics_families_are_the_ones_dashboards_read(live):
    """/metrics parsed by prometheus_client: the same families, in the same order, with the same samples and
    labels as before the text was written by the library (and no new ones, such as ``_created``)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert post(live, C, OK).status_code == 200
    families = list(text_string_to_metric_families(httpx.get(live.url + "/metrics").text))
    assert [(f.name, f.type, f.documentation) for f in families] == METRIC_FAMILIES
    for f in families:
        samples = {(s.name, tuple(sorted(s.labels))) for s in f.samples}
        if f.type == "histogram":
            assert samples == {(f.name + "_bucket", ("le",)), (f.name + "_count", ()), (f.name + "_sum", ())}
            le = [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")]
            bounds = TOKEN_BOUNDS if f.name == "hydragen_time_per_output_token_seconds" else LATENCY_BOUNDS
            assert le == [*(str(float(b)) for b in bounds), "+Inf"]
            counts = [s.value for s in f.samples if s.name.endswith("_bucket")]
            assert counts == sorted(counts) and counts[-1] == next(
                s.value for s in f.samples if s.name.endswith("_count")
            )
        else:
            suffix = "_total" if f.type == "counter" else ""
            assert samples == {(f.name + suffix, ())}


def test_one_log_line_per_request_without_prompt_text(live, caplog):
    caplog.set_level(logging.INFO, logger="hydragen.server")
    secret = "my secret prompt"
    # ignore_eos: an unseeded draw of the tiny model can end early (EOS at token 3 was seen in CI), and this
    # line is checked for completion_tokens=4 and finish=length
    assert post(live, C, {**OK, "prompt": secret, "ignore_eos": True}).status_code == 200
    assert post(live, C, {**OK, "top_k": -1}).status_code == 400
    time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "hydragen.server"]
    lines = [x for x in lines if x.startswith("POST /v1/completions")]
    assert len(lines) == 2, lines
    ok, bad = lines
    assert " 200 " in ok and "id=cmpl-" in ok and "prompt_tokens=16" in ok and "completion_tokens=4" in ok
    assert "finish=length" in ok and "cached_tokens=" in ok
    assert " 400 " in bad and "param=top_k" in bad and "error=invalid_request_error" in bad
    assert secret not in "\n".join(lines)


class SeedFault:
    """Sampler wrapper that raises whenever the batch holds the victim's sequence."""

    def __init__(self, real, seed):
        self.real, self.victim = real, derive_seed(seed, 0)

    def __call__(self, logits, temperature, top_k, top_p, seeds, steps, *flags):
        if bool((seeds == self.victim).any()) and int(steps.max()) >= 3:
            raise RuntimeError("injected fault")
        return self.real(logits, temperature, top_k, top_p, seeds, steps, *flags)


def test_a_fault_in_one_request_fails_it_alone_over_http(live):
    """Mid-decode, the sampler raises for one request: it gets a 500 (JSON, or an error event when
    streaming); requests running beside it complete exactly as when run alone; /health stays ok."""
    innocent = [
        {**OK, "prompt": f"innocent {i}", "max_tokens": 40, "temperature": 0.9, "seed": i, "ignore_eos": True}
        for i in range(3)
    ]
    alone = [post(live, C, b).json()["choices"][0]["text"] for b in innocent]
    engine = live.engine
    real = engine.sampler
    engine.sampler = SeedFault(real, 4242)
    try:
        victim = {**OK, "prompt": "victim", "max_tokens": 40, "seed": 4242, "ignore_eos": True}
        results = {}

        def run(name, body):
            results[name] = post(live, C, body)

        threads = [threading.Thread(target=run, args=(f"i{i}", b)) for i, b in enumerate(innocent)]
        threads += [threading.Thread(target=run, args=("victim", victim))]
        threads += [threading.Thread(target=run, args=("victim-stream", {**victim, "stream": True}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.sampler = real
    err = assert_openai_error(results["victim"], 500, code="request_failed")
    assert "sampling failed" in err["message"] and "injected fault" in err["message"]
    events = [line[6:] for line in results["victim-stream"].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_failed"
    assert [results[f"i{i}"].json()["choices"][0]["text"] for i in range(3)] == alone
    assert httpx.get(live.url + "/health").status_code == 200
    live.assert_no_leak()


class PairFaultTokenizer:
    """The real tokenizer, except that decoding the victim's tokens raises: the victim is recognised by a
    pair of consecutive generated ids that no other request produces (an incremental detokenizer decodes
    short windows of recent ids, never the whole generation). No Rust backend: the engine then detokenizes
    with IncrementalDetokenizer, which decodes through this class (DecodeStream would bypass it)."""

    backend_tokenizer = None

    def __init__(self, real, victim_pair: list[int]):
        self.real, self.victim_pair = real, victim_pair

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if any(ids[i : i + 2] == self.victim_pair for i in range(len(ids) - 1)):
            raise ValueError("injected detokenizer fault")
        return self.real.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_detokenizer_fault_in_one_request_fails_it_alone_over_http(live, model_dir):
    greedy = {**OK, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    prompts = [[40, 41, 42], [50, 51], [60, 61, 62, 63], [70]]
    alone = [post(live, C, {**greedy, "prompt": p}).json()["choices"][0] for p in prompts]
    offline = LLM(model_dir, kv_cache_tokens=1024).generate(
        prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )
    victim_ids, *innocent_ids = [o.outputs[0].token_ids for o in offline]
    seen = {tuple(ids[i : i + 2]) for ids in innocent_ids for i in range(len(ids) - 1)}
    pair = next(
        victim_ids[i : i + 2] for i in range(len(victim_ids) - 1) if tuple(victim_ids[i : i + 2]) not in seen
    )
    engine = live.engine
    real = engine.tokenizer
    engine.tokenizer = PairFaultTokenizer(real, pair)
    results = {}
    try:
        threads = [
            threading.Thread(
                target=lambda i=i, p=p: results.__setitem__(i, post(live, C, {**greedy, "prompt": p}))
            )
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.tokenizer = real
    err = assert_openai_error(results[0], 500, code="request_failed")
    assert "injected detokenizer fault" in err["message"], err
    for i in range(1, len(prompts)):
        assert results[i].json()["choices"][0]["text"] == alone[i]["text"]
    live.assert_no_leak()


def test_small_pool_refuses_what_can_never_fit(model_dir):
    srv = LiveServer(LLM(model_dir, kv_cache_tokens=300), "tiny")
    try:
        r = post(srv, C, {**OK, "prompt": [3] * 100, "max_tokens": 250})
        err = assert_openai_error(r, 400, "max_tokens", "invalid_value")
        assert "KV" in err["message"]
        # n sequences that do not fit at once are not refused: they run in waves.
        r = post(
            srv,
            C,
            {
                **OK,
                "prompt": [3] * 20,
                "max_tokens": 100,
                "n": 8,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": 1,
            },
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == 8
        offline = LLM(model_dir, kv_cache_tokens=8192).generate(
            [[3] * 20],
            SamplingParams(n=8, max_tokens=100, ignore_eos=True, temperature=1.0, seed=1),
            use_tqdm=False,
        )[0]
        assert [c["text"] for c in r.json()["choices"]] == [c.text for c in offline.outputs]
        srv.assert_no_leak()
    finally:
        srv.stop()


def test_engine_failure_fails_everything_in_flight_and_health_turns_503(model_dir):
    """An exception the engine cannot attribute: every request in flight ends with a 500 at once,
    /health and new requests answer 503, and the server still shuts down promptly."""
    srv = LiveServer(LLM(model_dir, kv_cache_tokens=4096), "tiny")
    engine = srv.engine
    real_step, fail_now = engine.step, threading.Event()

    def failing_step():
        if fail_now.is_set():
            raise RuntimeError("injected engine failure")
        return real_step()

    engine.step = failing_step
    gate = StepGate(engine)  # steps pass one at a time, so the requests cannot end before the failure
    results = {}
    body = {**OK, "max_tokens": 400, "n": 2, "ignore_eos": True}

    def run(name, b):
        results[name] = post(srv, C, b)

    threads = [
        threading.Thread(target=run, args=("plain", body)),
        threading.Thread(target=run, args=("stream", {**body, "stream": True})),
    ]
    for t in threads:
        t.start()
    gate.wait_at_gate()
    while metric(srv.url, "hydragen_requests_running") < 4:  # until both requests are decoding
        gate.allow(1)
        gate.wait_at_gate()
    fail_now.set()
    gate.open()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    err = assert_openai_error(results["plain"], 500, code="engine_failed")
    assert "injected engine failure" in err["message"]
    events = [line[6:] for line in results["stream"].text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
    assert_openai_error(httpx.get(srv.url + "/health"), 503, code="engine_failed")
    assert_openai_error(post(srv, C, OK), 503, code="engine_failed")
    assert "hydragen_engine_healthy 0.0" in httpx.get(srv.url + "/metrics").text
    assert srv.stop() < 10
