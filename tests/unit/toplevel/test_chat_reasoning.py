"""``hydragen chat`` with a reasoning model: the reasoning shown before the answer (dimmed on a terminal) or
hidden (``--hide-reasoning``), kept in the conversation as reasoning_content, tool calls read after it, and
``--chat-template-kwargs`` reaching the template (a tiny reasoning model whose replies the test writes)."""

from __future__ import annotations

import io

import pytest

from hydragen import LLM, SamplingParams
from hydragen.chat import DIM, PLAIN, Chat
from hydragen.chat_tools import ChatTools
from hydragen.cli import main
from tests.helpers.reasoning_helpers import script_replies
from tests.helpers.tool_helpers import tool_json

THOUGHT = "7 is odd, and 7 % 3 = 1.\nSo it is prime."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\nYes, 7 is prime."


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def llm(reasoning_models):
    return LLM(reasoning_models["qwen3"], kv_cache_tokens=8192)


def _chat(llm, out, **kw) -> Chat:
    params = SamplingParams(temperature=0, max_tokens=1)
    chat = Chat(
        llm,
        params,
        4096,
        max_tokens=80,
        stdin=io.StringIO("Is 7 prime?\n"),
        stdout=out,
        stderr=io.StringIO(),
        **kw,
    )
    assert chat.run(0.0) == 0
    return chat


def test_the_reasoning_is_shown_dimmed_on_a_terminal_plain_when_piped_or_hidden(llm):
    script_replies(llm.engine, REPLY)
    out = Terminal()
    chat = _chat(llm, out)
    assert out.getvalue() == f"{DIM}{THOUGHT}{PLAIN}\n\nYes, 7 is prime.\n"
    assert chat.history[-1] == {
        "role": "assistant",
        "content": "Yes, 7 is prime.",
        "reasoning_content": THOUGHT,
    }
    out = io.StringIO()
    _chat(llm, out)
    assert out.getvalue() == f"{THOUGHT}\n\nYes, 7 is prime.\n"
    out = Terminal()
    chat = _chat(llm, out, hide_reasoning=True)
    assert out.getvalue() == "Yes, 7 is prime.\n"
    assert chat.history[-1]["reasoning_content"] == THOUGHT  # hidden from the screen, not from the model


def test_tool_calls_after_the_reasoning_and_template_kwargs(llm):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'

    def script(seq) -> str:  # a call, then, with its result in the prompt, an answer
        if "<tool_response>" in llm.tokenizer.decode(seq.prompt_ids, skip_special_tokens=False):
            return "<think>\nIt said sunny.\n</think>\n\nSunny in Rome."
        return f"<think>\n{THOUGHT}\n</think>{call}"

    script_replies(llm.engine, script)
    tools = ChatTools(llm, [tool_json("get_weather", {"city": {"enum": ["Paris", "Rome"]}})], "auto")
    out = io.StringIO()
    chat = Chat(
        llm, SamplingParams(temperature=0, max_tokens=1), 4096, max_tokens=80, tools=tools,
        stdin=io.StringIO("Weather in Rome?\nsunny\n"), stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    assert chat.run(0.0) == 0
    shown = out.getvalue()
    assert shown.startswith(f'{THOUGHT}\n-> get_weather(city="Rome")') and "<tool_call>" not in shown
    assert shown == f'{THOUGHT}\n-> get_weather(city="Rome")\nIt said sunny.\n\nSunny in Rome.\n'
    assert chat.history[1]["reasoning_content"] == THOUGHT and chat.history[1]["tool_calls"]
    assert chat.history[3] == {
        "role": "assistant",
        "content": "Sunny in Rome.",
        "reasoning_content": "It said sunny.",
    }
    # With thinking off in the template, the prompt closed the reasoning: the reply is shown as it is.
    script_replies(llm.engine, REPLY)
    out = io.StringIO()
    _chat(llm, out, chat_template_kwargs={"enable_thinking": False})
    assert out.getvalue() == REPLY + "\n"


def test_bad_chat_template_kwargs_are_usage_errors(capsys, monkeypatch):
    import hydragen

    monkeypatch.setattr(hydragen, "LLM", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert main(["chat", "--chat-template-kwargs", "{bad"]) == 2
    assert "--chat-template-kwargs is not JSON" in capsys.readouterr().err
    assert main(["chat", "--chat-template-kwargs", '{"add_generation_prompt": false}']) == 2
    assert "cannot set 'add_generation_prompt'" in capsys.readouterr().err
