"""The formats of issue 41, without a model: Mistral's ``[TOOL_CALLS]`` (a JSON list: Mistral v0.3 to Small
3.1; ``f[ARGS]{...}`` per call: the tekken v11+ templates) and Phi-4-mini's ``functools[...]``. Detected from
minimal templates in those families' style, parsed whole and streamed (character by character, and token by
token through the tiny tokenizers, their markers split or special), rendered for the next turn and parsed
back, with the ids Mistral's templates accept. The grammar and engine runs of these formats are in
test_tools.py, beside the older formats'."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from hydragen.engine.config import TOOL_FORMATS
from hydragen.engine.detokenizer import new_detokenizer
from hydragen.model.tokenizer import Tokenizer
from hydragen.tools.formats import (
    FORMATS,
    MISTRAL,
    MISTRAL_V11,
    PHI4_MINI_JSON,
    detect_format,
    resolve_format,
    spelled_as_template,
)
from hydragen.tools.parser import CallScanner, Content, parse
from hydragen.tools.render import template_messages, template_tools
from hydragen.tools.request import ToolRequest
from hydragen.tools.stream import ToolCallStream
from tests.helpers.tool_helpers import (
    MISTRAL_V03_TEMPLATE,
    MISTRAL_V11_TEMPLATE,
    PHI4_MINI_TEMPLATE,
    tiny_tool_tokenizer,
    tool_json,
)

MISTRAL_V03 = spelled_as_template(MISTRAL, MISTRAL_V03_TEMPLATE)  # "[TOOL_CALLS] [", as v0.3 writes it
NEW = [MISTRAL, MISTRAL_V03, MISTRAL_V11, PHI4_MINI_JSON]
IDS = ["mistral_nemo", "mistral_v03", "mistral_v11", "phi4_mini_json"]
# arguments with what could end a list or an object early: brackets, braces and quotes inside strings
CALLS = [
    ("get_weather", json.dumps({"city": 'Pa]ris"}', "unit": "c"})),
    ("add", json.dumps({"a": 1, "b": [2, {"x": "]}"}]})),
]
TOOLS = [
    tool_json("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}),
    tool_json("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
]
ALNUM9 = re.compile(r"[A-Za-z0-9]{9}")

# Ministral 3 / Devstral 2 style (tekken, Dec 2025): like Small 3.2's but without call ids
MINISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for m in messages %}{% if m.role == 'user' %}"
    "{% if tools and m == users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
# Mistral-Nemo style (tekken, before v11): the v0.3 template without the spaces SentencePiece needs
NEMO_TEMPLATE = MISTRAL_V03_TEMPLATE.replace("[TOOL_CALLS] [", "[TOOL_CALLS][").replace(
    "[AVAILABLE_TOOLS] [", "[AVAILABLE_TOOLS]["
)


def _template(source: str):
    return SimpleNamespace(chat_template=source)


# ---- detection ---------------------------------------------------------------------------------------
def test_formats_are_detected_from_the_templates():
    assert detect_format(_template(MISTRAL_V03_TEMPLATE)) == MISTRAL_V03
    assert MISTRAL_V03.opener == "[TOOL_CALLS] [" and MISTRAL_V03.name == "mistral"
    assert detect_format(_template(NEMO_TEMPLATE)) == MISTRAL and MISTRAL.opener == "[TOOL_CALLS]["
    assert detect_format(_template(MISTRAL_V11_TEMPLATE)) == MISTRAL_V11
    assert detect_format(_template(MINISTRAL3_TEMPLATE)) == MISTRAL_V11
    assert detect_format(_template(PHI4_MINI_TEMPLATE)) == PHI4_MINI_JSON
    # the tiny models' tokenizers carry the same templates
    found = [detect_format(tiny_tool_tokenizer(k)) for k in ("mistral", "mistral_v11", "phi4")]
    assert found == [MISTRAL_V03, MISTRAL_V11, PHI4_MINI_JSON]


def test_formats_are_chosen_by_name():
    """By name, a format keeps the template's spelling of its opener; the names are the config's choices."""
    assert resolve_format(_template(MISTRAL_V03_TEMPLATE), "mistral") == MISTRAL_V03
    assert resolve_format(_template(NEMO_TEMPLATE), "mistral") == MISTRAL
    assert resolve_format(_template(""), "phi4_mini_json") == PHI4_MINI_JSON
    assert resolve_format(_template(PHI4_MINI_TEMPLATE), "mistral_v11") == MISTRAL_V11
    with pytest.raises(ValueError, match="mistral, mistral_v11, phi4_mini_json"):
        resolve_format(_template(""), "mistral_v3")
    assert tuple(FORMATS) == TOOL_FORMATS  # the CLI's --tool-format and LLM(tool_format=) take these


# ---- parsing ---------------------------------------------------------------------------------------------
def _streamed(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) as a client accumulates the stream's deltas."""
    stream = ToolCallStream(fmt)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        for delta in stream.feed(piece, "stop" if i == len(pieces) - 1 else None):
            content += delta.get("content", "")
            for tc in delta.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], ["", "", tc.get("id")])
                entry[0] += tc["function"].get("name", "")
                entry[1] += tc["function"].get("arguments", "")
    return content, [(n, a) for n, a, _ in calls.values()], [i for _, _, i in calls.values()]


@pytest.mark.parametrize("fmt", NEW, ids=IDS)
def test_parallel_calls_parse_whole_and_streamed(fmt):
    """Content, then two calls: parsed whole, and streamed in pieces of every size (one character at a time
    splits every marker), the same content and calls, with ids as the format's templates take them."""
    reply = "Let me look.\n" + fmt.calls_text(CALLS)
    content, calls = parse(reply, fmt)
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == CALLS
    for step in (1, 2, 3, 7, len(reply)):
        pieces = [reply[at : at + step] for at in range(0, len(reply), step)]
        assert _streamed(fmt, pieces)[:2] == ("Let me look.", CALLS)
    ids = [c.id for c in calls] + _streamed(fmt, [reply])[2]
    if fmt.ids == "alnum9":
        assert all(ALNUM9.fullmatch(i) for i in ids) and len(set(ids)) == 4
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("fmt", NEW, ids=IDS)
def test_a_marker_split_across_pieces_is_held_back(fmt):
    """The start of a marker at the end of a piece is held back until the next piece says what it is;
    text that only resembles it is content."""
    at = len(fmt.marker) // 2
    scanner = CallScanner(fmt)
    assert scanner.feed("Sure. " + fmt.marker[:at]) == [Content("Sure.")]
    events = scanner.feed(fmt.marker[at:] + fmt.lead[len(fmt.marker) :] + "add" + fmt.before_arguments)
    assert [type(e).__name__ for e in events] == ["CallStarted"]
    near = fmt.marker[:-1] + "?"  # "[TOOL_CALLS?", "functools?"
    assert parse(f"a {near} b", fmt) == (f"a {near} b", [])


def test_functools_alone_is_not_a_call():
    """Phi-4-mini's marker is "functools[", not the word: prose about the module stays prose."""
    text = "Python's functools module has lru_cache; functools.partial too."
    assert parse(text, PHI4_MINI_JSON) == (text, [])


@pytest.mark.parametrize("fmt", NEW, ids=IDS)
def test_the_list_ends_the_calls(fmt):
    """After the closer (or, for mistral_v11, anything but the next marker) nothing more is a call."""
    reply = fmt.calls_text(CALLS[:1]) + " " + fmt.call_text(*CALLS[1])
    expected = ["get_weather"] if fmt.closer else ["get_weather", "add"]
    assert [c.name for c in parse(reply, fmt)[1]] == expected


@pytest.mark.parametrize("kind", ["mistral", "mistral_v11", "phi4"])
def test_token_by_token_through_the_tokenizer(kind):
    """A reply encoded by the tiny model's tokenizer and decoded one token at a time by the engine's
    detokenizer, as the engine streams it: with special tokens kept (as a tool request asks) the calls come
    out whole, whether the markers are single special tokens (Mistral's) or split over several tokens
    (Phi-4-mini's "functools["). Skipping special tokens loses Mistral's marker, and with it the calls."""
    hf = tiny_tool_tokenizer(kind)
    tok = Tokenizer(hf)
    fmt = detect_format(hf)
    reply = "Let me look. " + fmt.calls_text(CALLS)
    ids = tok.encode(reply, add_special_tokens=False)
    split = [m for m in (fmt.marker, *fmt.tokens) if len(tok.encode(m, add_special_tokens=False)) > 1]
    assert split == ([] if kind != "phi4" else ["functools["])
    for skip in (False, True):
        detok = new_detokenizer(tok, skip_special_tokens=skip)
        pieces = [detok.add([i]) for i in ids] + [detok.flush()]
        content, calls, _ = _streamed(fmt, pieces)
        if skip and fmt.tokens:  # Mistral's markers are special tokens: skipped, no call is found
            assert calls == [] and "[TOOL_CALLS]" not in content
        else:
            assert (content, calls) == ("Let me look.", CALLS)


# ---- rendering the next turn -------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 1 + 2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [  # an id as OpenAI's clients and servers make them, and one as Mistral's
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, (name, arguments) in zip(["call_abc", "A1b2C3d4E"], CALLS, strict=True)
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
    {"role": "tool", "tool_call_id": "A1b2C3d4E", "content": "3"},
]


def _rendered(kind: str) -> tuple[str, object]:
    hf = tiny_tool_tokenizer(kind)
    tok = Tokenizer(hf)
    request = ToolRequest.build(TOOLS, "auto", None, detect_format(hf))
    return tok.decode(request.prompt_ids(tok, HISTORY), skip_special_tokens=False), request.fmt


def test_phi4_mini_renders_functions_calls_and_results():
    """Phi-4-mini's template: the functions go in the system message's tools field, between <|tool|> and
    <|/tool|>, the call syntax in its text; earlier calls are the assistant's text in the format, which
    parses back to the same calls; results are role "tool" messages, as the template writes them."""
    text, fmt = _rendered("phi4")
    system = re.search(r"<\|system\|>(.*?)<\|tool\|>(.*?)<\|/tool\|><\|end\|>", text, re.S)
    assert system.group(1).startswith("Be brief.\n\n")
    assert 'functools[{"name": "function name", "arguments": {argument values}}, ...]' in system.group(1)
    assert [f["name"] for f in json.loads(system.group(2))] == ["get_weather", "add"]
    turn = re.search(r"<\|assistant\|>(.*?)<\|end\|>", text, re.S).group(1)
    assert turn == fmt.calls_text(CALLS)
    assert [(c.name, c.arguments) for c in parse(turn, fmt)[1]] == CALLS  # round trip
    assert "<|tool|>sunny<|end|><|tool|>3<|end|><|assistant|>" in text


@pytest.mark.parametrize("kind", ["mistral", "mistral_v11"])
def test_mistral_renders_calls_and_results_with_ids_it_accepts(kind):
    """The Mistral templates (which refuse ids that are not 9 characters) get the calls and results: an
    OpenAI-style id becomes 9 letters and digits derived from it, the same for the call and its result; a
    9-character id stays. The calls are written as the format writes them, with the template's id in them
    (the grammar never makes a model write one): without the ids they parse back to the same calls."""
    text, fmt = _rendered(kind)
    mapped = fmt.template_id("call_abc")
    assert ALNUM9.fullmatch(mapped) and fmt.template_id("A1b2C3d4E") == "A1b2C3d4E"
    assert mapped == fmt.template_id("call_abc") != fmt.template_id("call_abd")
    assert "call_abc" not in text and text.count(mapped) == 2 and text.count("A1b2C3d4E") == 2
    if kind == "mistral":
        assert f'{fmt.opener}{{"name": "get_weather", "arguments": ' in text
        calls = re.search(r"\[TOOL_CALLS\].*?\]</s>", text).group(0)[: -len("</s>")]
        without_ids = re.sub(r', "id": "[A-Za-z0-9]{9}"', "", calls)
        assert f'[TOOL_RESULTS] {{"content": sunny, "call_id": "{mapped}"}}' in text
    else:
        calls = re.search(r"\[TOOL_CALLS\].*?(?=</s>)", text).group(0)
        without_ids = re.sub(r"\[CALL_ID\][A-Za-z0-9]{9}", "", calls)
        assert f"[TOOL_RESULTS]{mapped}[TOOL_CONTENT]sunny[/TOOL_RESULTS]" in text
    assert without_ids == fmt.calls_text(CALLS)
    assert [(c.name, c.arguments) for c in parse(without_ids, fmt)[1]] == CALLS


def test_ministral3_renders_calls_the_format_parses():
    """A v11 template without call ids (Ministral 3, Devstral 2) writes earlier calls exactly as the format
    writes them: the rendered turn parses back to the same calls."""
    hf = tiny_tool_tokenizer("mistral_v11")
    fmt = detect_format(_template(MINISTRAL3_TEMPLATE))
    request = ToolRequest.build(TOOLS, "auto", None, fmt)
    conversation = template_messages(HISTORY[1:], request.tools, request.choice, fmt)
    tools = template_tools(request.tools, request.choice, fmt)
    text = hf.apply_chat_template(
        conversation, tools=tools, chat_template=MINISTRAL3_TEMPLATE, tokenize=False
    )
    turn = re.search(r"\[/INST\](.*?)</s>", text).group(1)
    assert turn == fmt.calls_text(CALLS)
    assert [(c.name, c.arguments) for c in parse(turn, fmt)[1]] == CALLS
    assert "[TOOL_RESULTS]sunny[/TOOL_RESULTS][TOOL_RESULTS]3[/TOOL_RESULTS]" in text


def test_new_ids_are_what_the_templates_take():
    """Mistral formats' fresh ids are 9 letters and digits (different each time); others keep OpenAI's."""
    ids = {MISTRAL_V11.new_id() for _ in range(200)} | {MISTRAL.new_id() for _ in range(200)}
    assert len(ids) == 400 and all(ALNUM9.fullmatch(i) for i in ids)
    assert re.fullmatch(r"call_[0-9a-f]{24}", PHI4_MINI_JSON.new_id())
    assert PHI4_MINI_JSON.template_id("call_abc") == "call_abc"  # ids other templates get are kept
