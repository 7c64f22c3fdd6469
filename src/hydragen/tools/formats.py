"""Tool-call formats: how a model family writes a call, and which one a chat template speaks.

A format is data. The calls of a reply are ``opener`` + call + (``separator`` + call)* + ``closer``, and one
call is ``before_name`` + the function's name + ``before_arguments`` + its arguments (a JSON object) +
``after_arguments``. ``marker`` is what starts the calls in free text. The grammar (tools/grammar.py), the
parser (tools/parser.py), the stream (tools/stream.py) and the prompt rendering (tools/render.py) all read
the same description, so they cannot disagree.

- ``hermes``: Qwen2 / Qwen2.5 / Qwen3, Hermes 2 Pro and their kin. Each call is
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, parallel calls one per line.
- ``llama3_json``: Llama 3.1-3.3 with their JSON tool calling: the reply is ``{"name": "f",
  "parameters": {...}}``, parallel calls joined by ``"; "`` (Llama's own template renders one call
  per message; hydragen accepts several).
- ``mistral``: Mistral 7B v0.3, Mistral-Nemo, Mistral Small 2409-3.1: ``[TOOL_CALLS]`` then one JSON array of
  ``{"name": "f", "arguments": {...}}`` objects. The templates of SentencePiece models (v0.3) write
  ``[TOOL_CALLS] [``, those of tekken models ``[TOOL_CALLS][``: detection takes the template's spelling.
- ``mistral_v11``: the tekken v11+ templates (Mistral Small 3.2, Magistral, Devstral, Ministral 3): each call
  is ``[TOOL_CALLS]f[ARGS]{...}``, parallel calls written one after the other.
- ``phi4_mini_json``: Phi-4-mini-instruct: ``functools[{"name": "f", "arguments": {...}}, ...]`` (vLLM's
  ``phi4_mini_json``). Its template takes the functions as a JSON string in the system message's ``tools``
  field (``<|tool|>...<|/tool|>``) and renders no calls or results of its own: hydragen writes earlier calls
  as text and tells the model the call syntax in one sentence of the system message.
- ``generic``: for a template that knows nothing of tools (the embedded SmolLM2's). hydragen describes
  the functions in a system message in its own words (``GENERIC_INSTRUCTIONS``) and the model answers
  in the hermes markup; earlier calls and results are written into the conversation as text.

The JSON inside a call is spelled as ``json.dumps`` spells it (``", "`` and ``": "``), which is what the
templates' ``tojson`` writes for earlier calls: the model sees its own calls the way it writes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
from dataclasses import dataclass

from hydragen.tools.spec import Tool, new_call_id

_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ALNUM9 = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True)
class CallFormat:
    name: str
    marker: str  # what starts the calls in free text; "" for bare JSON (a reply starting with the calls)
    before_name: str  # one call's text before the function's name
    before_arguments: str  # between the name and the arguments object
    after_arguments: str  # after the arguments object
    separator: str = ""  # between parallel calls
    opener: str = ""  # before the first call (a list's "[")
    closer: str = ""  # after the last call
    tokens: tuple[str, ...] = ()  # markers a tokenizer may hold as single (often special) tokens
    tools_in: str = "template"  # the functions: the template's tools= ("template"), the system
    # message's "tools" field ("system"), or hydragen's own description ("text")
    calls_in: str = "template"  # earlier calls: the assistant's tool_calls ("template") or its text ("text")
    results_in: str = "template"  # results: role "tool" ("template") or user messages of hydragen's ("text")
    ids: str = "openai"  # call ids: "openai" ("call_" + 24 hex digits) or "alnum9" (9 letters and digits)

    def __post_init__(self) -> None:
        lead = self.opener + self.before_name
        if not lead.lstrip().startswith(self.marker) or (not self.marker and not lead):
            raise ValueError(f"format {self.name}: the calls must start with the marker {self.marker!r}")
        if self.ids not in ("openai", "alnum9"):
            raise ValueError(f"format {self.name}: ids must be 'openai' or 'alnum9'")

    @property
    def trigger(self) -> str:
        """What starts the calls in free text: the marker, or the first character of bare-JSON calls."""
        return self.marker or self.lead[0]

    @property
    def lead(self) -> str:
        """The text before the first call's name (the marker, when there is one, starts it)."""
        return self.opener + self.before_name

    def call_text(self, name: str, arguments: str) -> str:
        """One call as this format writes it (``arguments``: the JSON object's text)."""
        return f"{self.before_name}{name}{self.before_arguments}{arguments}{self.after_arguments}"

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """A reply's calls, ``[(name, arguments)]``, as this format writes them."""
        return self.opener + self.separator.join(self.call_text(n, a) for n, a in calls) + self.closer

    def new_id(self) -> str:
        """A fresh call id as this format's templates accept them (Mistral's: 9 letters and digits)."""
        if self.ids == "alnum9":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return new_call_id()

    def template_id(self, given: str) -> str:
        """A call id from the conversation as the template gets it: for "alnum9" formats an id that is not
        9 letters and digits becomes 9 derived from it, the same for a call and its result (Mistral's
        templates refuse other ids)."""
        if self.ids != "alnum9" or _ALNUM9.fullmatch(given):
            return given
        n = int.from_bytes(hashlib.sha256(given.encode()).digest(), "big")
        return "".join(_ALNUM[(n >> (6 * k)) % 62] for k in range(9))


HERMES = CallFormat(
    "hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n",
    tokens=("<tool_call>", "</tool_call>"),
)  # fmt: skip
LLAMA3_JSON = CallFormat("llama3_json", "", '{"name": "', '", "parameters": ', "}", "; ")
MISTRAL = CallFormat(
    "mistral", "[TOOL_CALLS]", '{"name": "', '", "arguments": ', "}", ", ", "[TOOL_CALLS][", "]",
    tokens=("[TOOL_CALLS]",), ids="alnum9",
)  # fmt: skip
MISTRAL_V11 = CallFormat(
    "mistral_v11", "[TOOL_CALLS]", "[TOOL_CALLS]", "[ARGS]", "",
    tokens=("[TOOL_CALLS]", "[ARGS]"), ids="alnum9",
)  # fmt: skip
PHI4_MINI_JSON = CallFormat(
    "phi4_mini_json", "functools[", '{"name": "', '", "arguments": ', "}", ", ", "functools[", "]",
    tools_in="system", calls_in="text",
)  # fmt: skip
GENERIC = dataclasses.replace(HERMES, name="generic", tools_in="text", calls_in="text", results_in="text")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, PHI4_MINI_JSON, GENERIC)}


def template_source(tokenizer) -> str:
    """The chat template's text ('' without one); of several named templates, the tool-use one."""
    template = getattr(getattr(tokenizer, "_tok", tokenizer), "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template if isinstance(template, str) else ""


def detect_format(tokenizer) -> CallFormat:
    """The format the model's chat template speaks: ``<tool_call>`` markup is hermes; ``[TOOL_CALLS]`` is
    Mistral's, ``mistral_v11`` when the template writes ``[ARGS]``; ``<|tool|>...<|/tool|>`` is Phi-4-mini's;
    a Llama-3 header template that renders ``tools`` and asks for ``parameters`` is llama3_json; anything
    else (no tools in the template, or a format hydragen does not parse) gets the generic format."""
    source = template_source(tokenizer)
    if "<tool_call>" in source and "tools" in source:
        found = HERMES
    elif "[TOOL_CALLS]" in source:
        found = MISTRAL_V11 if "[ARGS]" in source else MISTRAL
    elif "<|tool|>" in source and "<|/tool|>" in source:
        found = PHI4_MINI_JSON
    elif "<|start_header_id|>" in source and "tools" in source and "parameters" in source:
        found = LLAMA3_JSON
    else:
        found = GENERIC
    return spelled_as_template(found, source)


def spelled_as_template(fmt: CallFormat, source: str) -> CallFormat:
    """``fmt`` with its opener spelled as the template spells it: a template that writes a space after the
    marker (Mistral v0.3's ``[TOOL_CALLS] [``, a SentencePiece model's dummy-prefix space) gets it in the
    grammar too, so the model writes the tokens it was trained on."""
    marker, opener = fmt.marker, fmt.opener
    if marker and opener.startswith(marker) and f"{marker} {opener[len(marker) :]}" in source:
        return dataclasses.replace(fmt, opener=f"{marker} {opener[len(marker) :]}")
    return fmt


def resolve_format(tokenizer, name: str | None) -> CallFormat:
    """The format called ``name`` (one of ``FORMATS``), spelled as the template spells it, or the detected
    format when None."""
    if name is None:
        return detect_format(tokenizer)
    if name not in FORMATS:
        raise ValueError(f"tool_format must be one of {', '.join(FORMATS)}, got {name!r}")
    return spelled_as_template(FORMATS[name], template_source(tokenizer))


GENERIC_INSTRUCTIONS = (
    "You can call functions. Each is described by one JSON object per line:\n{tools}\n"
    "To call a function, answer with\n{example}\nand nothing else; several calls go one per line. "
    "The results come back inside <tool_response></tool_response>. When no function is needed, "
    "answer in plain words."
)


CALL_SYNTAX = "To call functions, answer with\n{example}\nand nothing else."


def _function(tool: Tool) -> dict:
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


def generic_instructions(tools: list[Tool]) -> str:
    """The system text that describes ``tools`` to a model whose template cannot."""
    lines = "\n".join(json.dumps(_function(t)) for t in tools)
    example = GENERIC.call_text("function name", "{argument values}")
    return GENERIC_INSTRUCTIONS.format(tools=lines, example=example)


def system_field_tools(tools: list[Tool]) -> str:
    """The functions as a template that reads them from the system message's ``tools`` field takes them
    (Phi-4-mini's: a JSON list of ``{"name", "description", "parameters"}``)."""
    return json.dumps([_function(t) for t in tools])


def call_syntax(fmt: CallFormat) -> str:
    """One sentence that shows the model ``fmt``'s call syntax, for a template that lists the functions but
    never says how to call them (Phi-4-mini's)."""
    one = fmt.call_text("function name", "{argument values}")
    return CALL_SYNTAX.format(example=f"{fmt.opener}{one}{fmt.separator}...{fmt.closer}")
