"""What a tool request says: the functions (OpenAI's ``tools``), which may be called (``tool_choice``), and
the calls a model made (``ToolCall``), checked with errors that name the offending field."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from hydragen.errors import ParamError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 1024
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is the JSON Schema of its arguments object."""

    name: str
    description: str
    parameters: dict

    def to_openai(self) -> dict:
        """The OpenAI shape, which chat templates render (``{"type": "function", "function": {...}}``)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: "none" (answer in text, tools not shown), "auto" (text or calls), "required" (one or more
    calls) or "named" (exactly one call of ``name``)."""

    mode: str
    name: str | None = None


@dataclass
class ToolCall:
    """A call the model made: ``arguments`` is the JSON object text as the model wrote it (OpenAI's
    shape: a string); ``args`` parses it. ``complete`` is False only for the last call of a reply cut by
    ``max_tokens`` (finish_reason "length") while it wrote the arguments: they are as far as written and
    do not parse."""

    name: str
    arguments: str
    id: str = ""
    complete: bool = True

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    @property
    def args(self) -> dict:
        return json.loads(self.arguments)

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_tools(value, param: str = "tools") -> list[Tool]:
    """``value`` as OpenAI sends it: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}. ParamError naming the first bad field."""
    if not isinstance(value, list) or not value:
        raise ParamError(param, f"{param} must be a non-empty list of function definitions")
    if len(value) > MAX_TOOLS:
        raise ParamError(param, f"{param} holds {len(value)} functions; the limit is {MAX_TOOLS}")
    tools, seen = [], set()
    for i, entry in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise ParamError(f"{where}.type", f'{where} must be {{"type": "function", "function": {{...}}}}')
        if set(entry) - {"type", "function"}:
            extra = sorted(set(entry) - {"type", "function"})[0]
            raise ParamError(f"{where}.{extra}", f"{where} has an unknown key {extra!r}")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise ParamError(f"{where}.function", f"{where}.function must be an object")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            key = sorted(unknown)[0]
            raise ParamError(f"{where}.function.{key}", f"{where}.function has an unknown key {key!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ParamError(
                f"{where}.function.name",
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
            )
        if name in seen:
            raise ParamError(f"{where}.function.name", f"function {name!r} is defined twice")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ParamError(
                f"{where}.function.description", f"{where}.function.description must be a string"
            )
        parameters = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ParamError(
                f"{where}.function.parameters",
                f"{where}.function.parameters must be a JSON Schema of type object",
            )
        tools.append(Tool(name, description, parameters))
    return tools


def parse_tool_choice(value, tools: list[Tool] | None, param: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice``: "none", "auto", "required" or {"type": "function", "function": {"name"}}.
    Absent (None): "auto" with tools, "none" without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ParamError(
                param, f"{param} must be 'none', 'auto', 'required' or a named function, got {value!r}"
            )
        if value != "none" and not tools:
            raise ParamError(param, f"{param} {value!r} needs tools")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ParamError(
            param, f'{param} must be a string or {{"type": "function", "function": {{"name": ...}}}}'
        )
    if not any(t.name == name for t in tools or []):
        raise ParamError(f"{param}.function.name", f"{param} names {name!r}, which is not among the tools")
    return ToolChoice("named", name)
