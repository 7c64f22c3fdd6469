"""Tools in ``hydragen chat``: functions from a JSON file, calls shown readably, results typed back in.

``hydragen chat --tools tools.json`` gives the model the functions in the file (OpenAI's shape: a list of
``{"type": "function", "function": {...}}``, or an object with such a list under ``"tools"``). A reply's
text streams as usual; each call the model makes is shown as ``-> get_weather(city="Paris")``, then the
chat asks for its result (``get_weather result>``; piped, the next input line is the result) and the model
continues with the results in the conversation, until it answers without calling. A reply that
``max_tokens`` cuts shows its calls as the server returns them, the cut one as far as it was written, and
runs none of them: the turn ends there (the server's client sees finish_reason "length").
"""

from __future__ import annotations

import json
from pathlib import Path

from hydragen.engine.sampling_params import ParamError
from hydragen.tools.session import ToolSession
from hydragen.tools.spec import ToolCall

MAX_ROUNDS = 8  # calls answered in one user turn before the chat stops asking


def load_tools(path: str) -> list[dict]:
    """The tool definitions in ``path``; ValueError naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--tools {path}: {e}") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list):
        raise ValueError(f'--tools {path}: expected a list of tool definitions (or {{"tools": [...]}})')
    return tools


def choice_from_flag(value: str | None):
    """``--tool-choice``: auto, required, none, or a function's name."""
    if value is None or value in ("auto", "required", "none"):
        return value
    return {"type": "function", "function": {"name": value}}


def show_call(call: ToolCall) -> str:
    """``name(key=value, ...)`` with the values as JSON; a call cut by max_tokens as far as it was
    written, and marked so."""
    if not call.complete:
        return f"-> {call.name}({call.arguments}... [cut off by max_tokens]"
    try:
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in call.args.items())
    except (json.JSONDecodeError, AttributeError):
        args = call.arguments
    return f"-> {call.name}({args})"


class ChatTools:
    """The chat's tools, checked once (``--tools``, ``--tool-choice``) with their output grammar built once;
    each reply is a request of its own, read by its own ``session()`` (the ToolSession that ``LLM.chat``
    and the server use too)."""

    def __init__(self, llm, tools: list[dict], tool_choice=None):
        try:  # the conversation will hold calls and results: a session even with tool_choice "none"
            first = ToolSession.open(tools, tool_choice, True, llm.tool_format, history=True)
        except ParamError as e:
            raise ValueError(f"--tools: {e}") from None
        assert first is not None
        self.request = first.request
        structured = llm.engine.structured
        self.constraint = first.constraint(structured.compiler.ll_tokenizer, structured.literal_json_schema)

    def session(self) -> ToolSession:
        """A new reply's session: its prompt, params (with the grammar built once) and streamed text."""
        return ToolSession(self.request)
