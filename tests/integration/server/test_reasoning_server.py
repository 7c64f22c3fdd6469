"""A reasoning model over /v1/chat/completions with the ``openai`` client: message.reasoning_content and
delta.reasoning_content (vLLM's field) apart from the content, streamed and not; JSON Schema and tool calls
constrained after the reasoning; chat_template_kwargs reaching the template; include_reasoning. On tiny
reasoning models whose replies the test writes (tests/helpers/reasoning_helpers.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from hydragen import LLM
from tests.helpers.reasoning_helpers import script_replies
from tests.helpers.server_helpers import LiveServer
from tests.helpers.structured_helpers import assert_valid
from tests.helpers.tool_helpers import tool_json

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Is 7 prime?"}]
THOUGHT = 'Check 2, 3: 7 % 2 = 1 and 7 % 3 = 1, {"so": <prime>}.\nYes.'
SCHEMA = {
    "type": "object",
    "properties": {"prime": {"type": "boolean"}, "checked": {"enum": [2, 3]}},
    "required": ["prime", "checked"],
}
WEATHER = tool_json("get_weather", {"city": {"enum": ["Paris", "Rome"]}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["qwen3", "r1"])
def live(request, reasoning_models):
    srv = LiveServer(LLM(reasoning_models[request.param], kv_cache_tokens=8192))
    srv.kind = request.param
    yield srv
    srv.stop()


def _opens(live) -> str:
    return "" if live.kind == "r1" else "<think>\n"  # R1's generation prompt opened the block already


def _client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


def _create(live, **kw):
    args = {"model": "tiny", "messages": ASK, "max_tokens": 100, "temperature": 0, **kw}
    return _client(live).chat.completions.create(**args)


def _streamed(live, **kw) -> tuple[str, str, list]:
    """(reasoning, content, finish reasons) of a streamed reply, added up from its deltas."""
    thought, content, reasons = "", "", []
    for chunk in _create(live, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for text in (getattr(delta, "reasoning_content", None), delta.content):
                assert "<think" not in (text or "") and "</th" not in (
                    text or ""
                )  # never a tag, whole or part
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return thought, content, reasons


def test_reasoning_content_apart_from_the_content_streamed_and_not(live):
    script_replies(live.engine, f"{_opens(live)}{THOUGHT}\n</think>\n\nYes, 7 is prime.")
    message = _create(live).choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == "Yes, 7 is prime."
    assert _streamed(live) == (THOUGHT, "Yes, 7 is prime.", ["stop"])
    # a reply cut inside its reasoning: all reasoning so far, no content
    message = _create(live, max_tokens=6).choices[0].message
    assert THOUGHT.startswith(message.reasoning_content) and message.content == ""
    thought, content, reasons = _streamed(live, max_tokens=6)
    assert (thought, content, reasons) == (message.reasoning_content, "", ["length"])
    live.assert_no_leak()


def test_no_reasoning_and_include_reasoning_false(live):
    if live.kind == "qwen3":  # a reply that does not open a block is all content
        script_replies(live.engine, "Yes, it is.")
        message = _create(live).choices[0].message
        assert message.reasoning_content is None and message.content == "Yes, it is."
        assert _streamed(live) == ("", "Yes, it is.", ["stop"])
    script_replies(live.engine, f"{_opens(live)}{THOUGHT}\n</think>\n\nYes.")
    r = httpx.post(
        live.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": ASK,
            "max_tokens": 100,
            "temperature": 0,
            "include_reasoning": False,
        },
        timeout=120,
    ).json()
    message = r["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "Yes."
    assert _streamed(live, extra_body={"include_reasoning": False}) == ("", "Yes.", ["stop"])


def test_a_json_schema_holds_after_the_reasoning(live):
    # The script answers in prose after </think>: the schema holds there, so the reply leaves the script.
    script_replies(live.engine, f"{_opens(live)}{THOUGHT}\n</think>\n\nIt is prime.")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    message = _create(live, response_format=fmt).choices[0].message
    assert message.reasoning_content == THOUGHT
    assert_valid(message.content, SCHEMA, live.kind)
    thought, content, reasons = _streamed(live, response_format=fmt)
    assert (thought, content, reasons) == (THOUGHT, message.content, ["stop"])


def test_tool_calls_after_the_reasoning(live):
    script_replies(live.engine, f"{_opens(live)}{THOUGHT}\n</think>{CALL}")
    choice = _create(live, tools=[WEATHER], tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == THOUGHT
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in _create(live, tools=[WEATHER], tool_choice="required", stream=True):
        state.handle_chunk(chunk)
    (streamed,) = state.current_completion_snapshot.choices
    assert streamed.finish_reason == "tool_calls" and streamed.message.reasoning_content == THOUGHT
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_chat_template_kwargs_reach_the_template(live):
    plain = _create(live, max_tokens=1).usage.prompt_tokens
    off = _create(live, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if live.kind == "r1":  # a template without the switch renders the same prompt
        assert off.usage.prompt_tokens == plain
        return
    assert off.usage.prompt_tokens > plain  # the empty <think></think> block is in the prompt
    # the prompt closed the reasoning: the reply is content, whatever it writes
    script_replies(live.engine, "<think>\nx\n</think>\n\nHi")
    message = (
        _create(live, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    )
    assert message.reasoning_content is None and message.content == "<think>\nx\n</think>\n\nHi"
    for kwargs, param in (
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ({"tokenize": True}, "chat_template_kwargs.tokenize"),
        ([1], "chat_template_kwargs"),
    ):
        r = httpx.post(
            live.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "chat_template_kwargs": kwargs},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
