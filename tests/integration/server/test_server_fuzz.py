"""Fuzz: hundreds of malformed and hostile requests against a live server while innocent requests stream.

Every hostile request must get a 4xx in OpenAI's error shape; every innocent stream must produce exactly
the output it produced undisturbed; /health must answer ok throughout (that the event loop is never blocked
by parsing or tokenizing is shown without timing by test_server.py's held-call test); no KV page may
leak. Rude clients (streams dropped mid-way, non-streaming requests abandoned) are mixed in. Each hostile
request is sent only while at least one innocent stream is mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from hydragen import LLM
from hydragen.server.options import ServerOptions
from tests.helpers.server_helpers import LiveServer, tiny_chat_model

KEY = "fuzz-key"
LIMIT = 128 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {"model": "tiny", "prompt": "a small prompt", "max_tokens": 8}
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

INNOCENT = [
    (
        C,
        {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 60,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 1,
            "n": 2,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    (
        C,
        {
            "model": "tiny",
            "prompt": [10, 20, 30, 40, 50],
            "max_tokens": 60,
            "temperature": 0,
            "logprobs": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        CHAT,
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about owls."},
            ],
            "max_tokens": 60,
            "temperature": 1.0,
            "top_k": 20,
            "seed": 7,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    (
        C,
        {
            "model": "tiny",
            "prompt": "The capital of",
            "max_tokens": 60,
            "temperature": 0,
            "stop": ["\n\n\n"],
            "ignore_eos": True,
            "stream": True,
        },
    ),
]

# Values at and beyond every numeric limit: int64, float32 underflow/overflow, NaN, infinities, wrong types.
INT_EDGES = [-1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, "1", True]
FLOAT_EDGES = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    -0.5,
    1e-300,
    1e-46,
    1e-40,
    5e-324,
    3.5e38,
    1e308,
    "1",
    True,
]
NUMERIC = {
    "n": INT_EDGES + [0, 1025, 2**31, 2**63 - 1, None, "NaN", "Infinity"],
    "max_tokens": INT_EDGES + [0, 600, 2**31, 2**63 - 1, "NaN", "Infinity", "1e400"],
    "top_k": INT_EDGES + [-(2**63), "NaN"],
    "seed": [2**63, 2**64, -(2**63) - 1, 10**30, 1.5, "1", True, "NaN", "Infinity"],
    "logprobs": [-1, 21, 2**63, 2**64, 1.5, True, "NaN"],
    "temperature": FLOAT_EDGES + [1e-7, -1e-45],
    "top_p": FLOAT_EDGES + [0, -0.0, 1.0000001, 2, -1],
}


def body_bytes(obj: dict, raw: dict | None = None) -> bytes:
    """JSON for ``obj`` with ``raw`` fields spliced in verbatim (NaN, Infinity, 1e400 are not JSON values
    Python would write, but its parser reads them)."""
    text = json.dumps(obj)
    for key, literal in (raw or {}).items():
        text = text[:-1] + f', "{key}": {literal}}}'
    return text.encode()


def hostile_requests() -> list[dict]:
    """Each: method, path, content (bytes), headers (extra), params (the names the error may give)."""
    out: list[dict] = []

    def add(path, content, params=None, method="POST", headers=None, stream_too=True):
        out.append(dict(method=method, path=path, content=content, params=params, headers=headers or {}))
        if stream_too and content and content.startswith(b"{") and content.endswith(b"}"):
            streamed = content[:-1] + b', "stream": true}'
            out.append(dict(method=method, path=path, content=streamed, params=params, headers=headers or {}))

    for name, values in NUMERIC.items():
        for v in values:
            for path, base in ((C, BASE), (CHAT, CHAT_BASE)):
                if name == "logprobs" and path == CHAT:
                    body, key = {**base, "logprobs": True}, "top_logprobs"
                else:
                    body, key = dict(base), name
                if isinstance(v, str) and v not in ("1",):
                    add(path, body_bytes(body, {key: v}), {key}, stream_too=False)
                else:
                    add(path, json.dumps({**body, key: v}).encode(), {key}, stream_too=False)
    for stop in ([""], ["x"] * 65, ["x" * 2000], [1], {"a": 1}, 10**6):
        add(C, json.dumps({**BASE, "stop": stop}).encode(), {"stop"})
    add(C, b'{"model": "tiny", "prompt": "x", "stop": ["\\udc00"]}', {"stop[0]"})
    for ids in ([256], [-1], [2**63], [2**64], ["a"], [1.5], list(range(1025)), "5"):
        add(C, json.dumps({**BASE, "stop_token_ids": ids}).encode(), {"stop_token_ids"})
    for prompt in (
        "",
        [],
        [[]],
        [-1],
        [256],
        [2**63],
        [2**64],
        [1.5],
        [True],
        123,
        {"a": 1},
        None,
        "a" * 600,
        "a" * 100_000,
        [5] * 512,
        [[1], [300]],
        ["a", 1],
        [[1, 2], []],
    ):
        add(C, json.dumps({**BASE, "prompt": prompt}).encode(), {"prompt", "prompt[0]", "prompt[1]"})
    for surrogate in (b"\\ud800", b"\\udfff", b"a\\ud83db", b"\\ud83d\\ud83d"):
        add(C, b'{"model": "tiny", "prompt": "' + surrogate + b'"}', {"prompt"})
        add(
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "' + surrogate + b'"}]}',
            {"messages[0].content"},
        )
    for messages in (
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 123}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "x", "name": "n"}],
        [{"content": "x"}],
        "hi",
        [{"role": "user", "content": "a" * 5000}],
        [{"role": "tool", "content": "x"}],
    ):
        add(CHAT, json.dumps({**CHAT_BASE, "messages": messages}).encode(), None)
    unsupported = {
        "presence_penalty": 0.5,
        "frequency_penalty": 1,
        "repetition_penalty": 1.2,
        "best_of": 3,
        "echo": True,
        "suffix": "s",
        "logit_bias": {"1": 5},
        "functions": [{"name": "f"}],
        "modalities": ["audio"],
        "foo": 1,
        "min_tokens": 3,
        "use_beam_search": True,
    }
    for key, value in unsupported.items():
        add(C, json.dumps({**BASE, key: value}).encode(), {key})
        add(CHAT, json.dumps({**CHAT_BASE, key: value}).encode(), {key})
    # Tools are a chat feature: unknown to /v1/completions, checked field by field on chat.
    for key, value in {"tools": [{"type": "function"}], "tool_choice": "auto"}.items():
        add(C, json.dumps({**BASE, key: value}).encode(), {key})
    malformed_tools = [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ]
    for extra, param in malformed_tools:
        add(CHAT, json.dumps({**CHAT_BASE, **extra}).encode(), {param})
    malformed_constraints = {  # output constraints are supported; these values of them are not valid
        "response_format": {"type": "xml"},
        "guided_json": "{not json",
        "guided_regex": "[a",
        "structured_outputs": {"json": {}, "regex": "a"},
    }
    for key, value in malformed_constraints.items():
        add(C, json.dumps({**BASE, key: value}).encode(), {key})
        add(CHAT, json.dumps({**CHAT_BASE, key: value}).encode(), {key})
    for content in (
        b"{not json",
        b'{"model": "tiny", "prompt": "x",}',
        b'{"model": "tiny"',
        b"",
        b"null",
        b"[]",
        b'"text"',
        b"42",
        b"[" * 50_000,
        b'{"model": "tiny", "prompt": "x", "seed": 1' + b"7" * 5000 + b"}",
        b"\xff\xfe\x00",
        b'{"model": "tiny", "prompt": "\xc3\x28"}',
        b'{"\\ud800": 1}',
        b'{"model": "tiny", "prompt": "x"}' * 2,
        b"\x00" * 64,
    ):
        add(C, content, None, stream_too=False)
        add(CHAT, content, None, stream_too=False)
    ok = json.dumps(BASE).encode()
    for headers in (
        {"Authorization": ""},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Host": "evil.example"},
        {"Host": "127.0.0.1.evil"},
    ):
        add(C, ok, None, headers=headers, stream_too=False)
    for method, path in (
        ("GET", "/v1/nothing"),
        ("POST", "/v1/nothing"),
        ("GET", C),
        ("PUT", CHAT),
        ("DELETE", "/v1/models"),
        ("POST", "/health"),
        ("GET", "/v1/completions/x"),
        ("PATCH", "/metrics"),
    ):
        add(path, ok if method != "GET" else b"", None, method=method, stream_too=False)
    for model in ("gpt-4", "", 123, None):
        add(C, json.dumps({**BASE, "model": model}).encode(), {"model"})
    add(C, json.dumps({**BASE, "prompt": "a" * LIMIT}).encode(), None, stream_too=False)  # 413
    add(CHAT, json.dumps({**CHAT_BASE, "max_tokens": 10**4}).encode(), {"max_tokens"})
    add(CHAT, json.dumps({**CHAT_BASE, "top_logprobs": 3}).encode(), {"top_logprobs"})
    return out


async def stream_once(
    client: httpx.AsyncClient, url: str, path: str, body: dict, started: asyncio.Event
) -> dict:
    """Text per choice, finish reasons, logprob tokens and usage of one streamed request."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    lp_tokens: dict[int, list] = {}
    usage = None
    async with client.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                i = c["index"]
                piece = c["delta"].get("content") if "delta" in c else c["text"]
                texts[i] = texts.get(i, "") + (piece or "")
                if c.get("finish_reason"):
                    reasons[i] = c["finish_reason"]
                if c.get("logprobs") and "tokens" in c["logprobs"]:
                    lp_tokens.setdefault(i, []).extend(c["logprobs"]["tokens"])
    return {"texts": texts, "reasons": reasons, "lp_tokens": lp_tokens, "usage": usage}


@pytest.fixture(scope="module")
def live(tiny_models, tmp_path_factory):
    path = tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("fuzz") / "tiny")
    options = ServerOptions(api_key=KEY, allowed_hosts=["127.0.0.1"], max_request_bytes=LIMIT, read_timeout=5)
    srv = LiveServer(LLM(path, kv_cache_tokens=4096), "tiny", options)
    yield srv
    srv.stop()


def test_hostile_requests_never_disturb_innocent_streams(live):
    hostile = hostile_requests()
    assert len(hostile) >= 300
    asyncio.run(_attack(live, hostile))
    live.assert_no_leak()


async def _attack(live, hostile: list[dict]) -> None:
    url = live.url
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        baseline = [await stream_once(client, url, p, b, asyncio.Event()) for p, b in INNOCENT]
        assert all(len(t) >= 20 for b in baseline for t in b["texts"].values())

        active, done, outcomes = [0], asyncio.Event(), []
        any_active = asyncio.Event()

        async def innocent_worker(k: int) -> None:
            while not done.is_set():
                started = asyncio.Event()

                async def watch(started=started):
                    await started.wait()
                    active[0] += 1
                    any_active.set()

                watcher = asyncio.create_task(watch())
                try:
                    outcomes.append((k, await stream_once(client, url, *INNOCENT[k], started)))
                finally:
                    watcher.cancel()
                    if started.is_set():
                        active[0] -= 1
                        if active[0] == 0:
                            any_active.clear()

        health_latencies: list[float] = []

        async def health_poller() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                r = await client.get(url + "/health")
                health_latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json() == {"status": "ok"}
                await asyncio.sleep(0.05)

        workers = [asyncio.create_task(innocent_worker(k)) for k in range(len(INNOCENT))]
        poller = asyncio.create_task(health_poller())
        semaphore = asyncio.Semaphore(8)
        failures: list[str] = []

        async def attack(i: int, h: dict) -> None:
            async with semaphore:
                await any_active.wait()  # only while an innocent request is mid-stream
                headers = {
                    "Authorization": f"Bearer {KEY}",
                    "Content-Type": "application/json",
                    **h["headers"],
                }
                if i % 37 == 5:  # a rude client: drops a stream after its first bytes
                    body = {**INNOCENT[0][1], "max_tokens": 200}
                    async with client.stream("POST", url + C, json=body, headers=headers) as r:
                        async for _ in r.aiter_bytes():
                            break
                elif i % 37 == 19:  # a rude client: abandons a non-streaming request
                    body = {**BASE, "max_tokens": 300, "ignore_eos": True}
                    with contextlib.suppress(httpx.TimeoutException):
                        await client.post(url + C, json=body, headers=headers, timeout=0.2)
                r = await client.request(h["method"], url + h["path"], content=h["content"], headers=headers)
                problem = _check_error(r, h)
                if problem:
                    failures.append(
                        f"{h['method']} {h['path']} {h['content'][:120]!r} {h['headers']}: {problem}"
                    )

        t0 = time.time()
        await asyncio.gather(*(attack(i, h) for i, h in enumerate(hostile)))
        attack_seconds = time.time() - t0
        done.set()
        await asyncio.gather(*workers)
        await poller
    assert not failures, "\n".join(failures[:20])
    by_kind: dict[int, list] = {}
    for k, out in outcomes:
        by_kind.setdefault(k, []).append(out)
    assert set(by_kind) == set(range(len(INNOCENT)))
    for k, outs in by_kind.items():
        for out in outs:
            assert out["texts"] == baseline[k]["texts"], k
            assert out["reasons"] == baseline[k]["reasons"], k
            assert out["lp_tokens"] == baseline[k]["lp_tokens"], k
    print(
        f"\n{len(hostile)} hostile requests in {attack_seconds:.1f} s beside {len(outcomes)} innocent "
        "streams; "
        f"/health worst {max(health_latencies) * 1000:.0f} ms over {len(health_latencies)} polls"
    )


def _check_error(r: httpx.Response, h: dict) -> str | None:
    """None when r is a 4xx in OpenAI's shape naming one of the expected parameters, else the problem."""
    if not 400 <= r.status_code < 500:
        return f"status {r.status_code}: {r.text[:200]}"
    if not r.headers.get("content-type", "").startswith("application/json"):
        return f"content-type {r.headers.get('content-type')}"
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error: {r.text[:200]}"
    if (
        set(err) != {"message", "type", "param", "code"}
        or not err["message"]
        or err["type"] != "invalid_request_error"
    ):
        return f"bad error object {err}"
    named = err["param"] or ""
    if (
        h["params"] is not None
        and r.status_code == 400
        and not any(named == p or named.startswith((p + "[", p + ".")) for p in h["params"])
    ):
        return f"param {err['param']!r} not in {sorted(h['params'])}: {err['message']}"
    return None
