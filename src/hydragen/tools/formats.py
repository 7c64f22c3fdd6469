"""Tool-call formats: how a model family writes a call, and which one a chat template speaks.

A format is data: the text around each call's JSON object, the separator between parallel calls and the
key holding the arguments. The grammar (tools/grammar.py), the parser (tools/parser.py) and the prompt
rendering (tools/render.py) all read the same description, so they cannot disagree.

- ``hermes``: Qwen2 / Qwen2.5 / Qwen3, Hermes 2 Pro and their kin. Each call is
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, parallel calls one per line.
- ``llama3_json``: Llama 3.1-3.3 with their JSON tool calling: the reply is ``{"name": "f",
  "parameters": {...}}``, parallel calls joined by ``"; "`` (Llama's own template renders one call
  per message; hydragen accepts several).
- ``generic``: for a template that knows nothing of tools (the embedded SmolLM2's). hydragen describes
  the functions in a system message in its own words (``GENERIC_INSTRUCTIONS``) and the model answers
  in the hermes markup; earlier calls and results are written into the conversation as text.

The JSON inside a call is spelled as ``json.dumps`` spells it (``", "`` and ``": "``), which is what the
templates' ``tojson`` writes for earlier calls: the model sees its own calls the way it writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hydragen.tools.spec import Tool


@dataclass(frozen=True)
class CallFormat:
    name: str
    begin: str  # text before each call's JSON object
    end: str  # text after it
    separator: str  # between parallel calls
    arguments_key: str
    template_renders_tools: bool  # False: hydragen describes the tools itself (generic)

    @property
    def trigger(self) -> str:
        """What starts a call in free text: the marker, or ``{`` for bare-JSON formats."""
        return self.begin.strip() or "{"

    def call_text(self, name: str, arguments: str) -> str:
        """One call as this format writes it."""
        head = json.dumps({"name": name})[:-1]  # '{"name": "f"'
        return f'{self.begin}{head}, "{self.arguments_key}": {arguments}}}{self.end}'


HERMES = CallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", True)
LLAMA3_JSON = CallFormat("llama3_json", "", "", "; ", "parameters", True)
GENERIC = CallFormat("generic", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, GENERIC)}


def template_source(tokenizer) -> str:
    """The chat template's text ('' without one); of several named templates, the tool-use one."""
    template = getattr(getattr(tokenizer, "_tok", tokenizer), "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template if isinstance(template, str) else ""


def detect_format(tokenizer) -> CallFormat:
    """The format the model's chat template speaks: ``<tool_call>`` markup is hermes; a Llama-3 header
    template that renders ``tools`` and asks for ``parameters`` is llama3_json; anything else (no tools
    in the template, or a format hydragen does not parse) gets the generic format."""
    source = template_source(tokenizer)
    if "<tool_call>" in source and "tools" in source:
        return HERMES
    if "<|start_header_id|>" in source and "tools" in source and "parameters" in source:
        return LLAMA3_JSON
    return GENERIC


def resolve_format(tokenizer, name: str | None) -> CallFormat:
    """``name`` ("hermes", "llama3_json", "generic"), or the detected format when None."""
    if name is None:
        return detect_format(tokenizer)
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


GENERIC_INSTRUCTIONS = (
    "You can call functions. Each is described by one JSON object per line:\n{tools}\n"
    "To call a function, answer with\n{example}\nand nothing else; several calls go one per line. "
    "The results come back inside <tool_response></tool_response>. When no function is needed, "
    "answer in plain words."
)


def generic_instructions(tools: list[Tool]) -> str:
    """The system text that describes ``tools`` to a model whose template cannot."""
    lines = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools
    )
    example = GENERIC.call_text("function name", "{argument values}")
    return GENERIC_INSTRUCTIONS.format(tools=lines, example=example)
