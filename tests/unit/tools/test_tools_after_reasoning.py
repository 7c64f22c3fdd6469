"""Tool calling with a reasoning model: the call grammar holds after the reasoning, and calls are read from
the text after it only (tiny reasoning models whose replies the test writes)."""

from __future__ import annotations

import json

import pytest

from hydragen import LLM, SamplingParams
from tests.helpers.reasoning_helpers import script_replies
from tests.helpers.tool_helpers import tool_json

ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [tool_json("get_weather", {"city": {"enum": ["Paris", "Rome"]}})]  # bounded: a reply off script ends
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "The user wants the weather: get_weather, with city Paris."
GREEDY = SamplingParams(temperature=0, max_tokens=100)


@pytest.fixture(scope="module")
def models(reasoning_models):
    return {kind: LLM(path, kv_cache_tokens=8192) for kind, path in reasoning_models.items()}


@pytest.mark.parametrize("kind", ["qwen3", "r1"])
def test_required_calls_come_after_free_reasoning(models, kind):
    llm = models[kind]
    assert llm.tool_format.name == ("hermes" if kind == "qwen3" else "generic")
    opens = "" if kind == "r1" else "<think>\n"
    # The script writes prose after </think>, which tool_choice "required" does not allow: the grammar
    # holds there, so the reply leaves the script and its call is the grammar's.
    script_replies(llm.engine, f"{opens}{THOUGHT}\n</think>\n\nLet me check. {CALL}")
    c = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")[0].outputs[0]
    assert c.reasoning_content == THOUGHT and c.content is None
    assert len(c.tool_calls) == 1 and c.tool_calls[0].name == "get_weather" and c.tool_calls[0].complete
    assert set(json.loads(c.tool_calls[0].arguments)) == {"city"}
    assert c.text.split("</think>", 1)[1].startswith("<tool_call>\n")
    # The call as scripted, straight after the reasoning: followed exactly.
    script_replies(llm.engine, f"{opens}{THOUGHT}\n</think>{CALL}")
    c = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")[0].outputs[0]
    assert c.reasoning_content == THOUGHT and c.content is None and c.finish_reason == "stop"
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_call_marker_inside_the_reasoning_is_not_a_call(models):
    llm = models["qwen3"]
    thought = f"Should I write {CALL}? No, I know it."
    script_replies(llm.engine, f"<think>\n{thought}\n</think>\n\nIt is sunny in Paris.")
    c = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS)[0].outputs[0]  # tool_choice "auto"
    assert c.reasoning_content == thought
    assert c.tool_calls == [] and c.content == "It is sunny in Paris."
    # and a call after the reasoning, with "auto", is one
    script_replies(llm.engine, f"<think>\n{thought}\n</think>\n\n{CALL}")
    c = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS)[0].outputs[0]
    assert c.reasoning_content == thought and c.content is None
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [("get_weather", {"city": "Paris"})]
