"""The grammar that enforces tool calls: a Lark grammar (llguidance's dialect) built from the tools'
JSON Schemas and the call format.

- ``required``: one call or more (one with ``parallel_tool_calls`` false), nothing else;
- named function: exactly one call of that function;
- ``auto``: free text, or calls. For a format with a marker (``<tool_call>``) the text is a *lazy*
  lexeme that ends at the first marker, after which the call is enforced: until then the mask allows
  everything (llguidance computes it in microseconds), and the model decides whether to call. For a
  bare-JSON format (llama3_json) a reply that starts with ``{`` is a call.

Each function is its own alternative, ``{"name": "f", "arguments": <f's schema>}``, so the name and the
keys are literal text: once the name is decided, jump-forward appends ``", "arguments": {"key": `` at
once, and with a single candidate (a named function, or one tool) the whole wrapper is forced.
"""

from __future__ import annotations

import json

from hydragen.structured.schema_defaults import close_objects
from hydragen.tools.formats import CallFormat
from hydragen.tools.spec import Tool, ToolChoice

# Arguments are spelled as json.dumps (and the templates' tojson) spell them: ", " and ": ", no other
# whitespace, so a model cannot pad, and earlier calls in the prompt look like the ones it writes.
ARGUMENT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    """A Lark string literal (Lark takes JSON's escapes)."""
    return json.dumps(text)


def special_markers(fmt: CallFormat, ll_tokenizer) -> dict[str, int]:
    """The format's markers that are one special token for the grammar engine (llguidance treats every
    added token as special: Qwen2.5's ``<tool_call>``, although not special to Hugging Face): the grammar
    must name them as tokens (``<[id]>``); as text they could only be spelled in pieces."""
    found = {}
    for marker in {fmt.begin.strip(), fmt.end.strip()} - {""}:
        ids = ll_tokenizer.tokenize_str(marker)
        if len(ids) == 1 and ll_tokenizer.is_special_token(ids[0]):
            found[marker] = ids[0]
    return found


def _text(text: str, special: dict[str, int]) -> str:
    """``text`` as a sequence of Lark literals and special-token references ('' for empty text)."""
    parts, rest = [], text
    while rest:
        hits = [(rest.find(m), m) for m in special if m in rest]
        if not hits:
            parts.append(_lit(rest))
            break
        at, marker = min(hits)
        if at:
            parts.append(_lit(rest[:at]))
        parts.append(f"<[{special[marker]}]>")
        rest = rest[at + len(marker) :]
    return " ".join(parts)


def _arguments_schema(tool: Tool, literal_json_schema: bool) -> dict:
    schema = tool.parameters if literal_json_schema else close_objects(tool.parameters)
    return {**schema, "x-guidance": ARGUMENT_JSON}


def tool_grammar(
    tools: list[Tool],
    choice: ToolChoice,
    fmt: CallFormat,
    parallel: bool,
    literal_json_schema: bool = False,
    special: dict[str, int] | None = None,
) -> str:
    """The Lark grammar for a request's output (not for ``tool_choice`` "none": that has none).
    ``special``: markers that are single special tokens (``special_markers``)."""
    special = special or {}
    if choice.mode == "none":
        raise ValueError("tool_choice 'none' has no grammar")
    if choice.mode == "named":
        tools = [t for t in tools if t.name == choice.name]
        parallel = False
    rules = []
    for i, tool in enumerate(tools):
        head = _lit(f'{json.dumps(tool.name)}, "{fmt.arguments_key}": ')
        rules.append(f"fn_{i}: {head} args_{i}")
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool, literal_json_schema))}")
    names = " | ".join(f"fn_{i}" for i in range(len(tools)))
    rules.append(f'object: {_lit("{" + chr(34) + "name" + chr(34) + ": ")} ({names}) "}}"')
    begin, end = _text(fmt.begin, special), _text(fmt.end, special)
    rules.append(" ".join(x for x in ("call:", begin, "object", end) if x))
    more = f" ({_lit(fmt.separator)} call)*" if parallel else ""
    if choice.mode in ("required", "named"):
        top = [f"start: call{more}"]
    elif fmt.begin:  # auto, with a marker: free text until the marker, then the rest of the call
        lead = fmt.begin[: fmt.begin.index(fmt.trigger) + len(fmt.trigger)]
        first = " ".join(x for x in (_text(fmt.begin[len(lead) :], special), "object", end) if x)
        if fmt.trigger in special:  # a special token cannot occur in TEXT: no laziness needed
            top = [f"start: TEXT | TEXT {_text(lead, special)} {first}{more}"]
        else:
            top = [f"start: TEXT | lead {first}{more}", f"lead[lazy]: TEXT {_lit(lead)}"]
        top.append(r"TEXT: /(.|\n)*/")
    else:  # auto, bare JSON: a reply starting with "{" is a call, any other reply is text
        top = [f"start: TEXT | call{more}", r"TEXT: /([^{](.|\n)*)?/"]
    return "\n".join(["%llguidance {}", *top, *rules]) + "\n"
