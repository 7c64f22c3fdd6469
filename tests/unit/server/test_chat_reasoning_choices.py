"""The chat choices of a reasoning model, without an engine: a reply in pieces cut anywhere, tags included,
streams as reasoning_content and content (or tool-call) deltas that add up to the unstreamed message, and no
delta carries a tag or a piece of one."""

from __future__ import annotations

import json

import pytest

from hydragen.engine.outputs import CompletionOutput
from hydragen.reasoning.formats import OPENING, REASONING, ReasoningFormat
from hydragen.server.serving_chat import ChatChoices
from hydragen.tools.formats import HERMES
from hydragen.tools.session import ToolSession

FMT = ReasoningFormat("qwen3", "<think>", "</think>", 1, 2, decode=lambda ids: "")
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
REPLIES = [
    (OPENING, "<think>\nA < B, so </thinking> is no tag.\n</think>\n\nB wins.", "B wins."),
    (REASONING, "R1 style.\n</think>\n\nDone.", "Done."),
    (OPENING, "No reasoning <think> here.", "No reasoning <think> here."),
]


def _stream(choices: ChatChoices, pieces: list[str]) -> list[dict]:
    deltas = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        piece = CompletionOutput(0, text, [7], "stop" if last else None)
        deltas += [c["delta"] for c in choices.delta(0, piece)]
    return deltas


def _cuts(text: str) -> list[list[str]]:
    """The reply cut in two at every place, and in pieces of 3 characters."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [
        [text[i : i + 3] for i in range(0, len(text), 3)]
    ]


@pytest.mark.parametrize("phase, reply, content", REPLIES)
def test_streamed_pieces_add_up_to_the_message_and_never_show_a_tag(phase, reply, content):
    whole = ChatChoices(None, 0, False, None, FMT, phase).final(0, reply, [], [], "stop")["message"]
    assert whole["content"] == content
    for pieces in _cuts(reply):
        deltas = _stream(ChatChoices(None, 0, False, None, FMT, phase), pieces)
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        text = "".join(d.get("content", "") for d in deltas)
        assert (thought or None, text) == (whole["reasoning_content"], whole["content"]), pieces
        # Each delta is final text, never taken back (it adds up), so a held "</th" that turned out to be
        # "</thinking>" came out as reasoning once decided, and the tags never did.
        assert not any("think>" in d.get("reasoning_content", "").replace("</thinking>", "") for d in deltas)


def test_tool_calls_are_read_after_the_reasoning_only():
    reply = f"<think>\nMaybe {CALL}? Yes.\n</think>\n\n{CALL}"
    session = ToolSession.open(TOOLS, "auto", True, HERMES, False)
    message = ChatChoices(None, 0, False, session, FMT, OPENING).final(0, reply, [], [], "stop")["message"]
    assert message["reasoning_content"] == f"Maybe {CALL}? Yes." and message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("f", {"x": 1})]
    for pieces in _cuts(reply):
        session = ToolSession.open(TOOLS, "auto", True, HERMES, False)
        deltas = _stream(ChatChoices(None, 0, False, session, FMT, OPENING), pieces)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == ""
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "f"
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"x": 1}


def test_include_reasoning_false_drops_it_and_a_model_that_does_not_reason_has_no_field():
    reply = "<think>\nhmm\n</think>\n\nok"
    hidden = ChatChoices(None, 0, False, None, FMT, OPENING, include_reasoning=False)
    assert hidden.final(0, reply, [], [], "stop")["message"] == {"role": "assistant", "content": "ok"}
    assert _stream(ChatChoices(None, 0, False, None, FMT, OPENING, include_reasoning=False), [reply]) == [
        {"content": "ok"}
    ]
    plain = ChatChoices(None, 0, False).final(0, reply, [], [], "stop")["message"]
    assert plain == {"role": "assistant", "content": reply}
