"""How schemas are read: by default an object without additionalProperties generates only its named
properties (as the peers, XGrammar); a per-request and per-engine switch gives JSON Schema's literal
semantics. Unsupported keywords are refused naming the keyword, offline and over HTTP (400)."""

from __future__ import annotations

import json

import httpx
import pytest

from hydragen import LLM, SamplingParams, StructuredOutputsParams
from hydragen.errors import ParamError
from hydragen.structured.schema_defaults import close_objects
from tests.helpers.server_helpers import LiveServer
from tests.helpers.structured_helpers import tiny_bpe_model

SO = StructuredOutputsParams
OPEN = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return tiny_bpe_model(tmp_path_factory.mktemp("bpe_defaults") / "model")


@pytest.fixture(scope="module")
def bpe_llm(bpe_path):
    return LLM(bpe_path, kv_cache_tokens=16384)


def _complete(llm, constraint: SO, text: str, literal_default: bool = False) -> bool:
    """Whether ``text`` is a whole output the constraint allows."""
    so = llm.engine.structured
    matcher = so.compiler.matcher_for(constraint, literal_default)
    ids = so.compiler.ll_tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def test_close_objects_closes_named_objects_only():
    schema = {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "either": {"anyOf": [{"properties": {"p": {}}}, {"type": "string"}]},
            "list": {"type": "array", "items": {"type": "object", "properties": {"q": {}}}},
            "merged": {"allOf": [{"properties": {"m": {}}}, {"properties": {"n": {}}}]},
            "extends": {"$ref": "#/$defs/base", "properties": {"extra": {}}},
            "uses": {"$ref": "#/$defs/leaf"},
            "maybe": {"type": ["object", "null"], "properties": {"r": {}}},
            "text": {"type": "string"},
        },
        "$defs": {"base": {"properties": {"k": {}}}, "leaf": {"properties": {"v": {}}}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["point"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # names nothing: "any object" stays any object
    assert props["open"]["additionalProperties"] is True  # the schema said so
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["maybe"]["additionalProperties"] is False
    # allOf parts and $ref extensions keep JSON Schema's meaning: closing them would forbid each other's keys
    assert all("additionalProperties" not in part for part in props["merged"]["allOf"])
    assert "additionalProperties" not in props["extends"]
    assert "additionalProperties" not in closed["$defs"]["base"]
    assert closed["$defs"]["leaf"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_default_generates_only_named_properties(bpe_llm):
    assert _complete(bpe_llm, SO(json=OPEN), '{"a":1,"b":"x"}')
    assert not _complete(bpe_llm, SO(json=OPEN), '{"a":1,"zz":2}')
    # literal semantics, per request or as the engine's default
    assert _complete(bpe_llm, SO(json=OPEN, literal_json_schema=True), '{"a":1,"zz":2}')
    assert _complete(bpe_llm, SO(json=OPEN), '{"a":1,"zz":2}', literal_default=True)
    assert not _complete(bpe_llm, SO(json=OPEN, literal_json_schema=False), '{"a":1,"zz":2}', True)


def test_engine_switch_reaches_generation(bpe_path):
    """``LLM(literal_json_schema=True)``: the engine compiles the schema as written (no additionalProperties
    added); by default it compiles the closed schema."""
    for literal in (False, True):
        llm = LLM(bpe_path, kv_cache_tokens=4096, literal_json_schema=literal)
        llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=SO(json=OPEN)), use_tqdm=False)
        (source,) = llm.engine.structured.compiler.compile_seconds
        assert ("additionalProperties" in source.text) != literal


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("uniqueItems", True),
        ("contains", {"type": "integer"}),
        ("not", {"type": "string"}),
        ("if", {"type": "string"}),
        ("dependentRequired", {"a": ["b"]}),
        ("dependentSchemas", {"a": {}}),
        ("propertyNames", {"pattern": "^a"}),
        ("unevaluatedProperties", False),
        ("unevaluatedItems", False),
        ("minContains", 1),
        ("$dynamicRef", "#x"),
    ],
)
def test_unsupported_keyword_is_refused_naming_it(bpe_llm, keyword, value):
    schema = {"type": "object", "properties": {"tags": {"type": "array", keyword: value}}}
    with pytest.raises(ParamError) as e:
        bpe_llm.generate("x", SamplingParams(structured_outputs=SO(json=schema)), use_tqdm=False)
    assert f'unsupported JSON Schema keyword "{keyword}" (at #/properties/tags)' in str(e.value)
    assert e.value.param == "structured_outputs"


@pytest.fixture(scope="module")
def live(bpe_llm):
    srv = LiveServer(bpe_llm)
    yield srv
    srv.stop()


def _chat(live, **extra) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "json"}], **extra}
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)


def test_server_unsupported_keyword_is_a_400_naming_it(live):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = _chat(live, response_format=rf)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["code"] == "invalid_value"
    assert '"uniqueItems" (at #/properties/ids)' in err["message"]
    r = _chat(live, guided_json={"type": "object", "if": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert 'keyword "if" (at #)' in r.json()["error"]["message"]


def test_server_literal_switch_per_request(live):
    schema = {**OPEN, "properties": {**OPEN["properties"], "tag": {"type": "string", "maxLength": 5}}}
    compiled = live.engine.structured.compiler.compile_seconds
    for literal in (None, True, False):
        extra = {} if literal is None else {"literal_json_schema": literal}
        r = _chat(live, guided_json=schema, **extra)
        assert r.status_code == 200, r.text
        want = json.dumps(schema if literal else close_objects(schema))
        assert any(s.text == want for s in compiled), literal
    r = _chat(live, guided_json=schema, literal_json_schema="yes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "literal_json_schema"
