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
from hydragen.tools.parser import CallScanner, Content
from hydragen.tools.request import ToolRequest
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
    """The chat's tool request: prompt rendering, the output grammar, and the reply's text and calls."""

    def __init__(self, llm, tools: list[dict], tool_choice=None):
        try:
            request = ToolRequest.build(tools, tool_choice, True, llm.tool_format)
        except ParamError as e:
            raise ValueError(f"--tools: {e}") from None
        self.request = request or ToolRequest.history_only(llm.tool_format)
        structured = llm.engine.structured
        self.constraint = self.request.constraint(
            structured.compiler.ll_tokenizer, structured.literal_json_schema
        )
        self.scanner: CallScanner | None = None

    def prompt_ids(self, tokenizer, conversation: list[dict]) -> list[int]:
        return self.request.prompt_ids(tokenizer, conversation)

    def params(self, params):
        return self.request.sampling_params(params, self.constraint)

    def start(self) -> None:
        self.scanner = CallScanner(self.request.fmt) if self.request.enforced else None

    def visible(self, piece: str, final: bool = False) -> str:
        """Of the reply's new text, what to print now: its content, never the call markup."""
        if self.scanner is None:
            return piece
        return "".join(e.text for e in self.scanner.feed(piece, final) if isinstance(e, Content))

    def reply(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall]]:
        content, calls, _ = self.request.reply(text, reason)
        return content, calls
