"""The grammar that enforces tool calls: a Lark grammar (llguidance's dialect) built from the tools'
JSON Schemas and the call format.

- ``required``: one call or more (one with ``parallel_tool_calls`` false), nothing else;
- named function: exactly one call of that function;
- ``auto``: free text, or calls. For a format with a marker (``<tool_call>``, ``[TOOL_CALLS]``,
  ``functools[``) the text is a *lazy* lexeme that ends at the first marker, after which the calls are
  enforced: until then the mask allows everything (llguidance computes it in microseconds), and the model
  decides whether to call. For a bare-JSON format (llama3_json) a reply that starts with ``{`` is a call.

The rules follow the format's description: the calls are ``opener call (separator call)* closer``, a call
is ``before_name`` then one alternative per function, ``f`` + ``before_arguments`` + <f's schema>, then
``after_arguments``. So the name and the keys are literal text: once the name is decided, jump-forward
appends ``", "arguments": {"key": `` at once, and with a single candidate (a named function, or one
tool) the whole wrapper is forced.
"""

from __future__ import annotations

import json
import re

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
    added token as special: Qwen2.5's ``<tool_call>``, although not special to Hugging Face; Mistral's
    ``[TOOL_CALLS]``): the grammar must name them as tokens (``<[id]>``); as text they could only be spelled
    in pieces."""
    found = {}
    for marker in fmt.tokens:
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
        rules.append(f"fn_{i}: {_text(tool.name + fmt.before_arguments, special)} args_{i}")
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool, literal_json_schema))}")
    names = " | ".join(f"fn_{i}" for i in range(len(tools)))
    after = _text(fmt.after_arguments, special)
    rules.append(" ".join(x for x in ("call:", _text(fmt.before_name, special), f"({names})", after) if x))
    separator = _text(fmt.separator, special)
    more = f" ({separator + ' ' if separator else ''}call)*" if parallel else ""
    closer = f" {_text(fmt.closer, special)}" if fmt.closer else ""
    opener = f"{_text(fmt.opener, special)} " if fmt.opener else ""
    if choice.mode in ("required", "named"):
        top = [f"start: {opener}call{more}{closer}"]
    elif fmt.marker:  # auto, with a marker: free text until the marker, then the rest of the calls
        lead = fmt.lead[: fmt.lead.index(fmt.marker) + len(fmt.marker)]
        rest = _text(fmt.lead[len(lead) :], special)
        first = " ".join(x for x in (rest, f"({names})", after) if x) + more + closer
        if fmt.marker in special:  # a special token cannot occur in TEXT: no laziness needed
            top = [f"start: TEXT | TEXT {_text(lead, special)} {first}"]
        else:
            top = [f"start: TEXT | lead {first}", f"lead[lazy]: TEXT {_lit(lead)}"]
        top.append(r"TEXT: /(.|\n)*/")
    else:  # auto, bare JSON: a reply starting with "{" is a call, any other reply is text
        top = [f"start: TEXT | {opener}call{more}{closer}", rf"TEXT: /([^{re.escape(fmt.trigger)}](.|\n)*)?/"]
    return "\n".join(["%llguidance {}", *top, *rules]) + "\n"
