"""One request's ToolSession, without a model: what ``LLM.chat``, the server and ``hydragen chat`` share. It
opens from OpenAI's fields (a conversation with earlier calls gets one without tools), keeps each choice's
streamed reply apart, shows the CLI the content without call markup, and a request's own
``literal_json_schema`` wins over the engine's default."""

from __future__ import annotations

import pytest

from hydragen.engine.sampling_params import ParamError
from hydragen.tools.formats import HERMES
from hydragen.tools.request import ToolRequest
from hydragen.tools.session import ToolSession
from tests.helpers.tool_helpers import tool_json

ADD = tool_json("add", {"a": {"type": "integer"}, "b": {"type": "integer"}})
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_open_from_the_fields():
    assert ToolSession.open(None, None, None, HERMES, history=False) is None
    history = ToolSession.open(None, None, None, HERMES, history=True)
    assert history is not None and not history.enforced and history.tools == []
    session = ToolSession.open([ADD], "required", False, HERMES, history=False)
    assert session is not None and session.enforced and not session.request.parallel
    with pytest.raises(ParamError) as e:
        ToolSession.open([ADD], "always", None, HERMES, history=False)
    assert e.value.param == "tool_choice"


def test_choices_stream_apart_and_add_up_to_the_reply():
    session = ToolSession.open([ADD], "auto", None, HERMES, history=False)
    text = "Sure.\n" + CALL
    got: dict[int, list[dict]] = {0: [], 1: []}
    for at in range(0, len(text), 5):  # two choices, interleaved piece by piece
        for index in (0, 1):
            got[index] += session.deltas(index, text[at : at + 5])[0]
    for index in (0, 1):
        deltas, reason = session.deltas(index, "", "stop")
        got[index] += deltas
        assert reason == "tool_calls"
        content = "".join(d.get("content", "") for d in got[index])
        calls = [d["tool_calls"][0] for d in got[index] if "tool_calls" in d]
        arguments = "".join(call["function"].get("arguments", "") for call in calls)
        assert [call["function"].get("name") for call in calls][0] == "add"
        assert (content, arguments) == ("Sure.", '{"a": 1, "b": 2}')
    assert session.reply(text, "stop")[0] == "Sure." and session.reply(text, "stop")[2] == "tool_calls"


def test_content_hides_the_call_markup():
    session = ToolSession.open([ADD], "auto", None, HERMES, history=False)
    text = "Sure.\n" + CALL
    shown = "".join(session.content(ch) for ch in text) + session.content("", final=True)
    assert shown.strip() == "Sure." and "<tool_call>" not in shown
    plain = ToolSession.open([ADD], "none", None, HERMES, history=False)
    assert plain.content(CALL) == CALL  # tool_choice "none": nothing is parsed


def test_the_requests_literal_json_schema_wins(monkeypatch):
    monkeypatch.setattr(ToolRequest, "constraint", lambda self, ll_tokenizer, literal: literal)
    for own, default, used in [
        (None, False, False),
        (None, True, True),
        (True, False, True),
        (False, True, False),
    ]:
        session = ToolSession.open([ADD], "required", None, HERMES, history=False, literal_json_schema=own)
        assert session.constraint(None, default) is used
