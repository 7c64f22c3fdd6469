"""Tool calling through /v1/chat/completions with the ``openai`` client: message.tool_calls with ids,
finish_reason "tool_calls", streamed delta.tool_calls that the client's accumulator rebuilds, history
with assistant calls and tool results, tool_choice none / auto / required / named, and 400s naming the
field. On tiny random models speaking each format (hermes, llama3_json, mistral, mistral_v11,
phi4_mini_json, generic)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from hydragen import LLM
from tests.helpers.server_helpers import LiveServer
from tests.helpers.tool_helpers import arguments_parse, tiny_tool_model, tool_json

openai = pytest.importorskip("openai")

WEATHER = tool_json(
    "get_weather", {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}
)
ADD = tool_json("add", {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}})
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module", params=["qwen2", "llama3", "llama_sp", "mistral", "mistral_v11", "phi4"])
def live(request, tmp_path_factory):
    path = tiny_tool_model(request.param, tmp_path_factory.mktemp(request.param) / "model")
    srv = LiveServer(LLM(path, kv_cache_tokens=16384))
    yield srv
    srv.stop()


def _client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


def _create(live, **kw):
    args = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 120, "seed": 4, **kw}
    return _client(live).chat.completions.create(**args)


def _valid(live, call, tools=TOOLS) -> None:
    import jsonschema

    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    shape = r"[A-Za-z0-9]{9}" if live.llm.tool_format.ids == "alnum9" else r"call_[0-9a-f]{24}"
    assert re.fullmatch(shape, call.id) and call.type == "function"  # Mistral's templates take 9 characters


def test_required_and_named_return_tool_calls(live):
    r = _create(live, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        _valid(live, call)
    r = _create(live, tool_choice=NAMED, temperature=1.0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _valid(live, call)
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 1
    live.assert_no_leak()


def test_streamed_calls_match_the_unstreamed_ones(live):
    """Greedy, so both runs write the same reply: the stream's deltas, accumulated by the openai client,
    give the same calls (names and argument text) and finish reason."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    whole = _create(live, tool_choice="required", temperature=0).choices[0]
    state = ChatCompletionStreamState()
    chunks = list(_create(live, tool_choice="required", temperature=0, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    pairs = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    assert pairs == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # OpenAI's delta shape: the first delta of a call carries its id, type and name, later ones arguments
    deltas = [tc for ch in chunks for c in ch.choices if c.delta.tool_calls for tc in c.delta.tool_calls]
    firsts = [d for d in deltas if d.id is not None]
    assert len(firsts) == len(pairs) and all(d.type == "function" and d.function.name for d in firsts)
    assert all(d.function.name is None for d in deltas if d.id is None)
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_two_step_loop_with_results_in_the_history(live):
    first = _create(live, tool_choice=NAMED, temperature=0).choices[0].message
    history = [
        *ASK,
        first.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in first.tool_calls],
    ]
    r = _create(live, messages=history, tool_choice="auto", max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:  # auto: text or calls; calls that come are valid
        _valid(live, call)
    # the history renders without tools too (tool_choice none hides the tools, not the earlier turns)
    assert (
        _create(live, messages=history, tool_choice="none", max_tokens=4).choices[0].message.tool_calls
        is None
    )


def test_none_and_auto(live):
    r = _create(live, tool_choice="none", max_tokens=12, temperature=1.0, n=2)
    assert all(c.message.tool_calls is None and c.finish_reason in ("stop", "length") for c in r.choices)
    r = _create(live, max_tokens=60, temperature=1.0, n=4)  # auto: the default with tools
    for c in r.choices:
        assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
        for call in c.message.tool_calls or []:
            _valid(live, call)


def _error(live, **body) -> dict:
    payload = {"model": "tiny", "messages": ASK, "max_tokens": 8, **body}
    r = httpx.post(live.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_bad_tool_requests_are_400s_naming_the_field(live):
    err = _error(live, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err["param"] == "tool_choice.function.name"
    bad = tool_json("f", {"ids": {"type": "array", "uniqueItems": True}})
    err = _error(live, tools=[WEATHER, bad], tool_choice="required")
    assert err["param"] == "tools[1].function.parameters" and '"uniqueItems"' in err["message"]
    err = _error(live, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert err["param"] == "tool_choice"
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
        },
    ]
    err = _error(live, tools=TOOLS, messages=history)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    assert _error(live, tool_choice="required")["param"] == "tool_choice"
    assert (
        _error(live, messages=[*ASK, {"role": "user", "content": "x", "tool_calls": []}])["param"]
        == "messages[1].tool_calls"
    )
    live.assert_no_leak()


def test_literal_json_schema_reaches_the_tool_grammar(live):
    compiled = live.engine.structured.compiler.compile_seconds
    probe = [tool_json("probe", {"x": {"type": "object", "properties": {"y": {"type": "boolean"}}}})]
    for literal in (False, True):
        before = set(compiled)
        _create(
            live,
            tools=probe,
            tool_choice="required",
            max_tokens=4,
            extra_body={"literal_json_schema": literal},
        )
        (source,) = set(compiled) - before
        assert ('"additionalProperties": false' in source.text) != literal


# ---- a call cut by max_tokens or a stop string -------------------------------------------------------
NOTE = tool_json("note", {"title": {"type": "string", "maxLength": 8}, "body": {"type": "string"}})


def _accumulated(live, **kw):
    """The streamed reply's choices as the openai SDK's stream accumulator holds them (its
    get_final_completion raises LengthFinishReasonError on a cut reply, so its snapshot)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in _create(live, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices


@pytest.mark.parametrize("cut", [{"max_tokens": 60}, {"stop": ['"body"']}], ids=["max_tokens", "stop"])
def test_a_cut_call_is_the_same_streamed_and_not(live, cut):
    """The same greedy request, cut inside its call's arguments (by max_tokens: finish_reason "length"; by
    a stop string: "stop"), gives the same content, calls and finish_reason streamed (as the openai SDK
    accumulates it) and not. Arguments that do not parse are handed over only with "length", and then only
    as the last call: the unfinished one, as far as it was written."""
    kw = {"tools": [NOTE], "tool_choice": "required", "temperature": 0, **cut}
    whole = _create(live, **kw).choices[0]
    (streamed,) = _accumulated(live, **kw)
    length = "max_tokens" in cut
    assert whole.finish_reason == streamed.finish_reason == ("length" if length else "stop")

    def calls(message):
        return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]

    assert calls(streamed.message) == calls(whole.message)
    assert (streamed.message.content or None) == whole.message.content
    broken = [i for i, (_, arguments) in enumerate(calls(whole.message)) if not arguments_parse(arguments)]
    if length:  # the cut call is returned as far as it was written, named, after any finished ones
        assert broken == [len(calls(whole.message)) - 1]
        assert calls(whole.message)[-1][0] == "note"
        assert calls(whole.message)[-1][1].startswith('{"title": ')
    else:  # a stop string ended the reply inside the call: the call is not handed over at all
        assert broken == [] and calls(whole.message) == []
    live.assert_no_leak()


# ---- history sent back as the openai SDK dumps it ----------------------------------------------------
def _first_turn(live, with_calls: bool):
    """Turn 1, greedy, twice: the message as `create` returns it and as the SDK's stream accumulator
    builds it (which adds `parsed`, and on each call `index` and `function.parsed_arguments`)."""
    kw = (
        {"tool_choice": NAMED, "max_tokens": 120}
        if with_calls
        else {"tools": openai.NOT_GIVEN, "max_tokens": 8}
    )
    whole = _create(live, temperature=0, **kw).choices[0].message
    streamed = _accumulated(live, temperature=0, **kw)[0].message
    return whole, streamed


def _minimal(message) -> dict:
    """The same message with only the fields hydragen always took."""
    out = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    return out


@pytest.mark.parametrize("with_calls", [True, False], ids=["tool_calls", "text"])
def test_a_reply_sent_back_as_model_dump_continues_the_conversation(live, with_calls):
    """Frameworks keep history as dicts: turn 1's message goes back as `model_dump()` (refusal,
    annotations, audio and function_call all null) or as dumped from the stream accumulator. Turn 2 is
    accepted, and its prompt and greedy reply are those of the minimal message."""
    whole, streamed = _first_turn(live, with_calls)
    assert bool(whole.tool_calls) == with_calls

    def turn2(message: dict):
        after = [
            {"role": "tool", "tool_call_id": c["id"], "content": "sunny"}
            for c in message.get("tool_calls") or []
        ]
        after = after or [{"role": "user", "content": "And tomorrow?"}]
        extra = {} if with_calls else {"tools": openai.NOT_GIVEN}
        return _create(live, messages=[*ASK, message, *after], temperature=0, max_tokens=8, **extra)

    # the same ids as in the minimal message: Mistral's templates write them into the prompt
    expected = {"whole": turn2(_minimal(whole)), "streamed": turn2(_minimal(streamed))}
    streamed_dump = streamed.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "parsed"} <= set(streamed_dump)
    if with_calls:
        assert "index" in streamed_dump["tool_calls"][0]
        assert "parsed_arguments" in streamed_dump["tool_calls"][0]["function"]
    dumps = [whole.model_dump(), whole.model_dump(exclude_none=False), whole.model_dump(mode="json")]
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumps[0])
    dumps += [streamed_dump, {**dumps[0], "parsed": {"city": "Paris"}}]  # .parse()'s copy of the content
    for dumped, source in zip(dumps, ["whole"] * 3 + ["streamed", "whole"], strict=True):
        got = turn2(dumped)
        assert got.usage.prompt_tokens == expected[source].usage.prompt_tokens
        assert got.choices[0].message.content == expected[source].choices[0].message.content
    live.assert_no_leak()


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("audio", {"id": "audio_abc"}, "messages[1].audio"),
        ("function_call", {"name": "get_weather", "arguments": "{}"}, "messages[1].function_call"),
        ("refusal", "I cannot help with that.", "messages[1].refusal"),
        (
            "annotations",
            [
                {
                    "type": "url_citation",
                    "url_citation": {"url": "https://a.b", "title": "t", "start_index": 0, "end_index": 1},
                }
            ],
            "messages[1].annotations",
        ),
        (
            "tool_calls",
            [{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}],
            "messages[1].tool_calls[0].type",
        ),
    ],
)
def test_response_fields_that_ask_for_something_unsupported_are_400s(live, field, value, param):
    """The same fields, set: an audio reference, a deprecated function_call, a refusal, citations and a custom
    tool call are things hydragen cannot render, so each is a 400 naming the field (never dropped)."""
    message = {"role": "assistant", "content": "It is sunny.", field: value}
    err = _error(live, tools=TOOLS, messages=[*ASK, message])
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert field in err["message"]


@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no_tools"])
def test_reasoning_in_history_is_given_to_the_template(live, with_tools):
    """An assistant message's reasoning_content, or reasoning (vLLM's newer name), reaches the chat template
    as reasoning_content: the tiny Qwen2's template shows it as Qwen3's does (for turns after the last user
    message), the other tiny templates ignore it. Two different values, or reasoning on a user message, are
    400s naming the field."""
    from hydragen.tools.formats import HERMES

    thought = "The user asks for the weather, so get_weather is the function to call."
    if with_tools:
        first = _create(live, tool_choice=NAMED, temperature=0).choices[0].message
        after = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in first.tool_calls]
        assistant, extra = _minimal(first), {}
    else:  # an assistant message last: the model continues it
        assistant, after, extra = (
            {"role": "assistant", "content": "Let me see."},
            [],
            {"tools": openai.NOT_GIVEN},
        )

    def prompt_tokens(**fields) -> int:
        messages = [*ASK, {**assistant, **fields}, *after]
        return _create(live, messages=messages, max_tokens=1, **extra).usage.prompt_tokens

    plain, shown = prompt_tokens(), prompt_tokens(reasoning_content=thought)
    assert (
        prompt_tokens(reasoning=thought)
        == shown
        == prompt_tokens(reasoning=thought, reasoning_content=thought)
    )
    assert (shown > plain) == (live.llm.tool_format is HERMES)
    err = _error(live, messages=[*ASK, {**assistant, "reasoning": "a", "reasoning_content": "b"}, *after])
    assert err["param"] == "messages[1].reasoning" and err["code"] == "invalid_value"
    err = _error(live, messages=[{**ASK[0], "reasoning_content": thought}])
    assert err["param"] == "messages[0].reasoning_content"
