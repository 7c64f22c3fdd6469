"""Tool calling offline: the request fields, the formats and their detection, the grammar per tool_choice,
the parser (whole and streamed), prompt rendering, and validity over many requests with varied tool sets
on tiny random Qwen2 (hermes), Llama-3 (llama3_json), SentencePiece Llama (generic), Mistral v0.3
(mistral), Mistral Small 3.2 (mistral_v11) and Phi-4-mini (phi4_mini_json) models. The newer formats'
own unit tests (detection, split markers, rendering, ids) are in test_tool_formats.py."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from hydragen import LLM, SamplingParams, StructuredOutputsParams
from hydragen.bench.structured.tool_workloads import call_problems, random_tools, run_tool_requests
from hydragen.errors import ParamError
from hydragen.tools.formats import GENERIC, HERMES, LLAMA3_JSON, detect_format
from hydragen.tools.grammar import special_markers, tool_grammar
from hydragen.tools.parser import CallScanner, Content, parse
from hydragen.tools.render import template_messages
from hydragen.tools.request import ToolRequest
from hydragen.tools.spec import ToolChoice, parse_tool_choice, parse_tools
from hydragen.tools.stream import ToolCallStream
from tests.helpers.tool_helpers import arguments_parse, tiny_tool_model, tool_json

WEATHER = tool_json(
    "get_weather", {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}
)
ADD = tool_json("add", {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}})
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NEW_KINDS = ["mistral", "mistral_v11", "phi4"]  # the formats of issue 41
KINDS = ["qwen2", "llama3", "llama_sp", *NEW_KINDS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_models")
    return {k: tiny_tool_model(k, root / k) for k in KINDS}


@pytest.fixture(scope="module")
def llms(models):
    return {k: LLM(path, kv_cache_tokens=16384) for k, path in models.items()}


# ---- request fields ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tools, param",
    [
        ([], "tools"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "colour": 1}}], "tools[0].function.colour"),
        ([ADD, ADD], "tools[1].function.name"),
    ],
)
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(ParamError) as e:
        parse_tools(tools)
    assert e.value.param == param


def test_tool_choice():
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == ToolChoice(
        "named", "add"
    )
    for bad, param in [
        ("always", "tool_choice"),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ({"name": "add"}, "tool_choice"),
    ]:
        with pytest.raises(ParamError) as e:
            parse_tool_choice(bad, tools)
        assert e.value.param == param
    with pytest.raises(ParamError, match="needs tools"):
        parse_tool_choice("required", [])
    assert ToolRequest.build([], "none", None, HERMES) is None
    with pytest.raises(ParamError) as e:
        ToolRequest.build(TOOLS, "auto", "yes", HERMES)
    assert e.value.param == "parallel_tool_calls"


def test_formats_are_detected_from_the_template(llms, embedded_llm):
    assert llms["qwen2"].tool_format is HERMES
    assert llms["llama3"].tool_format is LLAMA3_JSON
    assert llms["llama_sp"].tool_format is GENERIC
    assert [llms[k].tool_format.name for k in NEW_KINDS] == ["mistral", "mistral_v11", "phi4_mini_json"]
    assert embedded_llm.tool_format is GENERIC  # SmolLM2's template has no tools
    assert detect_format(llms["qwen2"].tokenizer) is HERMES


def test_tool_format_override(models):
    assert LLM(models["qwen2"], kv_cache_tokens=1024, tool_format="generic").tool_format is GENERIC
    with pytest.raises(ValueError, match="tool_format"):
        LLM(models["qwen2"], kv_cache_tokens=1024, tool_format="xml")


# ---- parser and stream ---------------------------------------------------------------------------
HERMES_REPLY = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "}{\\"x", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
LLAMA_REPLY = (
    '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "x"}}'
)


@pytest.mark.parametrize("fmt, reply", [(HERMES, HERMES_REPLY), (LLAMA3_JSON, LLAMA_REPLY)])
def test_parse_whole_and_streamed_agree(fmt, reply):
    content, calls = parse(reply, fmt)
    assert [c.name for c in calls][-1] in ("add", "get_weather") and len(calls) == 2
    assert all(isinstance(c.args, dict) for c in calls)
    assert content == ("Let me look." if fmt is HERMES else None)
    # fed in pieces of every size, the stream's deltas rebuild exactly the same reply
    for step in (1, 3, 7, 1000):
        stream = ToolCallStream(fmt)
        got_content, got_calls = "", {}
        for at in range(0, len(reply), step):
            final = at + step >= len(reply)
            for delta in stream.feed(reply[at : at + step], "stop" if final else None):
                got_content += delta.get("content", "")
                for tc in delta.get("tool_calls", []):
                    entry = got_calls.setdefault(
                        tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""}
                    )
                    entry["name"] += tc["function"].get("name", "")
                    entry["arguments"] += tc["function"].get("arguments", "")
        assert got_content == (content or "")
        assert [(v["name"], v["arguments"]) for _, v in sorted(got_calls.items())] == [
            (c.name, c.arguments) for c in calls
        ]
        assert all(v["id"].startswith("call_") for v in got_calls.values()) and stream.complete == 2


def test_unfinished_call_is_returned_only_when_cut():
    cut = HERMES_REPLY[: HERMES_REPLY.rindex('"b"')]
    content, calls = parse(cut, HERMES)
    assert [c.name for c in calls] == ["get_weather"] and content == "Let me look."
    content, calls = parse(cut, HERMES, cut=True)  # finish_reason "length": as far as it was written
    assert [(c.name, c.complete) for c in calls] == [("get_weather", True), ("add", False)]
    assert calls[1].arguments == '{"a": 1, ' and content == "Let me look."


def test_text_that_only_looks_like_a_marker_stays_text():
    assert parse("a <tool_ is not a call", HERMES) == ("a <tool_ is not a call", [])
    events = CallScanner(HERMES).feed("answer <tool_c")  # held back: it may be a marker
    assert events == [Content("answer")]
    assert parse("Hello {there}", LLAMA3_JSON) == ("Hello {there}", [])
    # bare JSON: calls only when the reply starts with "{", as the grammar has it (its text may not)
    spaced = ' {"name": "add", "parameters": {"a": 1}}'
    assert parse(spaced, LLAMA3_JSON) == (spaced, []) and len(parse(spaced[1:], LLAMA3_JSON)[1]) == 1


def _accumulate(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client accumulates OpenAI deltas."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"].get("arguments", "")
    return content, [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("fmt, reply", [(HERMES, HERMES_REPLY), (LLAMA3_JSON, LLAMA_REPLY)])
def test_a_reply_cut_anywhere_streams_what_it_returns(fmt, reply):
    """A reply cut at every character, by max_tokens ("length") or by a stop ("stop"), fed in pieces:
    the deltas add up to what the unstreamed reply returns, and arguments that do not parse come only with
    "length", as the last call. Without stop strings the stream sends arguments as written (a reply ends
    inside a call only at max_tokens); with them (whole_calls) it sends each call once complete."""
    for end in range(len(reply) + 1):
        text = reply[:end]
        for reason in ("length", "stop"):
            content, calls = parse(text, fmt, cut=reason == "length")
            expected = (content or "", [(c.name, c.arguments) for c in calls])
            broken = [i for i, (_, arguments) in enumerate(expected[1]) if not arguments_parse(arguments)]
            assert broken == (
                [len(calls) - 1] if reason == "length" and calls and not calls[-1].complete else []
            )
            for whole_calls in (False, True) if reason == "length" else (True,):
                for step in (1, 5):
                    stream = ToolCallStream(fmt, whole_calls)
                    deltas = []
                    for at in range(0, len(text), step):
                        deltas += stream.feed(text[at : at + step])
                    deltas += stream.feed("", reason)
                    assert _accumulate(deltas) == expected, (text, reason, whole_calls, step)
                    assert stream.complete == sum(c.complete for c in calls)


def test_whole_calls_are_sent_once_complete():
    stream = ToolCallStream(HERMES, whole_calls=True)
    head = '<tool_call>\n{"name": "add", "arguments": {"a": 1, '
    assert stream.feed(head) == []  # held: a stop string could still cut it
    deltas = stream.feed('"b": 2}}\n</tool_call>')
    assert [list(d["tool_calls"][0]) for d in deltas] == [
        ["index", "id", "type", "function"],
        ["index", "function"],
    ]
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_streaming_work_per_piece_is_bounded(fmt):
    """A reply with 30,000 characters of arguments, streamed one character at a time: the scanner examines
    each piece plus at most a header's worth of held-back text (counted, not timed), so the work for a
    piece does not grow with the reply (a scan of the whole reply per piece would examine ~4.5 * 10^8)."""
    from hydragen.tools.parser import MAX_HEADER

    first = ("note", json.dumps({"body": "x" * 20_000, "tags": [{"a": "}{"}]}))
    reply = fmt.calls_text([first, ("add", json.dumps({"a": '\\"' * 10_000}))])
    stream = ToolCallStream(fmt)
    work, deltas = [], []
    for ch in reply:
        before = stream.scanner.scanned
        deltas += stream.feed(ch)
        work.append(stream.scanner.scanned - before)
    deltas += stream.feed("", "stop")
    assert _accumulate(deltas) == ("", [(c.name, c.arguments) for c in parse(reply, fmt)[1]])
    assert stream.complete == 2
    assert max(work) <= MAX_HEADER and sum(work) <= 2 * len(reply)


# ---- grammar -----------------------------------------------------------------------------------------
def _accepts(llm, grammar: str, text: str) -> bool:
    compiler = llm.engine.structured.compiler
    matcher = compiler.matcher_for(StructuredOutputsParams(grammar=grammar))
    if any(m in text for m in special_markers(llm.tool_format, compiler.ll_tokenizer)):
        ids = llm.tokenizer.encode(text, add_special_tokens=False)  # special markers as their tokens
    else:
        ids = compiler.ll_tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def _call(fmt, name, args) -> str:
    """A reply of one call."""
    return fmt.calls_text([(name, json.dumps(args))])


def _calls(fmt, *calls) -> str:
    """A reply of parallel calls, ``(name, args)`` each."""
    return fmt.calls_text([(name, json.dumps(args)) for name, args in calls])


@pytest.mark.parametrize("kind", ["llama_sp", "llama3", *NEW_KINDS])
def test_grammar_per_tool_choice(llms, kind):
    llm = llms[kind]
    fmt = llm.tool_format
    tools = parse_tools(TOOLS)
    one = _call(fmt, "add", {"a": 1, "b": 2})
    two = _calls(fmt, ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"}))

    special = special_markers(fmt, llm.engine.structured.compiler.ll_tokenizer)

    def grammar(mode, parallel=True, name=None):
        return tool_grammar(tools, ToolChoice(mode, name), fmt, parallel, special=special)

    assert _accepts(llm, grammar("required"), one) and _accepts(llm, grammar("required"), two)
    assert not _accepts(llm, grammar("required", parallel=False), two)
    assert not _accepts(llm, grammar("required"), "plain text")
    assert not _accepts(llm, grammar("required"), _call(fmt, "add", {"a": 100, "b": 2}))  # maximum 99
    assert not _accepts(
        llm, grammar("required"), _call(fmt, "add", {"a": 1, "b": 2, "c": 3})
    )  # peers' default
    assert not _accepts(llm, grammar("required"), _call(fmt, "delete_all", {}))
    assert _accepts(llm, grammar("named", name="add"), one)
    assert not _accepts(llm, grammar("named", name="get_weather"), one)
    assert _accepts(llm, grammar("auto"), "No call needed.")
    assert _accepts(llm, grammar("auto"), two)
    if fmt.marker:  # marker formats: text may come first, the call after the marker is enforced
        assert _accepts(llm, grammar("auto"), "Let me check.\n" + one)
        assert not _accepts(llm, grammar("auto"), "Let me check.\n" + fmt.marker + "oops")


def test_named_function_forces_the_whole_wrapper(llms):
    """With one candidate the wrapper, name and key are forced text: jump-forward writes them."""
    llm = llms["qwen2"]
    grammar = tool_grammar(parse_tools(TOOLS), ToolChoice("named", "get_weather"), HERMES, True)
    matcher = llm.engine.structured.compiler.matcher_for(StructuredOutputsParams(grammar=grammar))
    forced = bytes(matcher.compute_ff_bytes()).decode()
    assert forced.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": ')


# ---- prompts ------------------------------------------------------------------------------------------
HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "3"},
]


def test_generic_rendering_writes_tools_calls_and_results_as_text():
    out = template_messages(HISTORY, parse_tools(TOOLS), ToolChoice("auto"), GENERIC)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == _calls(GENERIC, ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2}))
    assert (
        out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    )
    # tool_choice "none": the tools are not described
    assert template_messages(ASK, parse_tools(TOOLS), ToolChoice("none"), GENERIC) == ASK


@pytest.mark.parametrize("fmt", [GENERIC, HERMES])
def test_rendering_gives_an_assistant_message_its_reasoning(fmt):
    """reasoning_content goes to the template as it is (the template decides whether to show it)."""
    history = [*HISTORY[:1], {**HISTORY[1], "reasoning_content": "Paris, so get_weather."}, *HISTORY[2:]]
    out = template_messages(history, parse_tools(TOOLS), ToolChoice("auto"), fmt)
    assistant = next(m for m in out if m["role"] == "assistant")
    assert assistant["reasoning_content"] == "Paris, so get_weather."
    with pytest.raises(ParamError) as e:
        template_messages(
            [*ASK, {"role": "assistant", "content": "x", "reasoning_content": 3}], [], ToolChoice("none"), fmt
        )
    assert e.value.param == "messages[1].reasoning_content"


def test_template_rendering_passes_calls_and_results_to_the_template(llms):
    out = template_messages(HISTORY, parse_tools(TOOLS), ToolChoice("auto"), HERMES)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates want objects
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]
    request = ToolRequest.build(TOOLS, "auto", None, HERMES)
    text = llms["qwen2"].tokenizer.decode(
        request.prompt_ids(llms["qwen2"].tokenizer, HISTORY), skip_special_tokens=False
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "add"' in text
    with pytest.raises(ParamError) as e:
        bad = [
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
            },
        ]
        request.prompt_ids(llms["qwen2"].tokenizer, bad)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


# ---- through the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_chat_returns_parsed_calls(llms, kind):
    llm = llms[kind]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=120)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = llm.chat(ASK, params, tools=TOOLS, tool_choice=named, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and len(c.tool_calls) == 1 and c.content is None
        assert c.tool_calls[0].name == "get_weather" and set(c.tool_calls[0].args) <= {"city", "unit"}
    none = llm.chat(ASK, params, tools=TOOLS, tool_choice="none", use_tqdm=False)[0]
    assert all(c.tool_calls == [] and c.content == c.text for c in none.outputs)
    plain = llm.chat(ASK, params, use_tqdm=False)[0]
    assert all(c.tool_calls is None for c in plain.outputs)
    with pytest.raises(ParamError, match="cannot be combined"):
        so = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
        llm.chat(ASK, so, tools=TOOLS, tool_choice="required", use_tqdm=False)


NOTE = tool_json("note", {"title": {"type": "string", "maxLength": 8}, "body": {"type": "string"}})


@pytest.mark.parametrize("kind", KINDS)
def test_chat_returns_a_cut_call_as_the_server_does(llms, kind):
    """Offline, as on the server
    (tests/integration/server/test_tools_server.py::test_a_cut_call_is_the_same_streamed_and_not): a greedy
    reply cut by max_tokens inside a call returns it as far as it was written, with ``complete`` False
    and finish_reason "length", after the calls it completed (none, unless the model is quick to close
    one: mistral_v11's tokenizer packs a call into fewer tokens); cut by a stop string, it returns no
    call."""
    llm = llms[kind]
    cut = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=60), tools=[NOTE], tool_choice="required")
    c = cut[0].outputs[0]
    assert c.finish_reason == "length" and c.content is None
    *done, last = c.tool_calls
    assert [(t.name, t.complete) for t in c.tool_calls] == [("note", True)] * len(done) + [("note", False)]
    assert last.arguments.startswith('{"title": ') and last.arguments in c.text
    assert not arguments_parse(last.arguments) and all(arguments_parse(t.arguments) for t in done)
    stopped = SamplingParams(temperature=0, max_tokens=120, stop=['"body"'])
    c = llm.chat(ASK, stopped, tools=[NOTE], tool_choice="required")[0].outputs[0]
    assert c.finish_reason == "stop" and c.tool_calls == [] and c.text.endswith('", ')


@pytest.mark.parametrize("kind", KINDS)
def test_required_and_named_calls_are_always_valid(llms, kind):
    """120 requests, each with its own random tool set (1-8 functions with nested, bounded schemas),
    tool_choice "required" or a named function, sampled at temperature 1: every call parses and
    validates against its function's schema, and every request ends by itself."""
    llm = llms[kind]
    rng = random.Random(kind)
    jobs, meta = [], []
    for i in range(120):
        tools = random_tools(rng, rng.randint(1, 8))
        named = rng.choice(tools)["function"]["name"] if i % 2 else None
        choice = {"type": "function", "function": {"name": named}} if named else "required"
        request = ToolRequest.build(tools, choice, i % 3 == 0, llm.tool_format)
        jobs.append(([{"role": "user", "content": f"Request {i}: do something useful."}], request))
        meta.append((tools, named, request.parallel))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=400)
    replies = run_tool_requests(llm, jobs, params)
    ended = 0
    for reply, (tools, named, parallel) in zip(replies, meta, strict=True):
        assert reply.calls, (reply.content, reply.finish_reason)
        assert not call_problems(reply, tools, named), call_problems(reply, tools, named)
        assert named is None or len(reply.calls) == 1
        assert parallel or len(reply.calls) == 1
        ended += reply.finish_reason == "tool_calls"
    # a random model may keep adding parallel calls until max_tokens; single calls always end
    assert ended >= sum(not p for _, _, p in meta)


@pytest.mark.parametrize("kind", ["mistral", "mistral_v11"])
def test_mistral_call_ids_go_back_into_the_template(llms, kind):
    """Mistral's templates refuse call ids that are not 9 letters and digits. A reply's calls get such ids,
    and a client that sends the calls and their results back with them gets the next turn rendered, each
    id written for the call and for its result; ids of another shape are turned into such ids, where the
    template alone refuses them."""
    llm = llms[kind]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120) for seed in range(3)]
    outs = llm.chat([ASK] * 3, params, tools=[WEATHER], tool_choice="required", use_tqdm=False)
    c = max((o.outputs[0] for o in outs), key=lambda c: len(c.tool_calls))  # bounded: every call complete
    assert c.finish_reason == "stop" and all(re.fullmatch(r"[A-Za-z0-9]{9}", t.id) for t in c.tool_calls)
    calls = [t.to_openai() for t in c.tool_calls]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}]
    history += [{"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in c.tool_calls]
    request = ToolRequest.build(TOOLS, "auto", None, llm.tool_format)
    text = llm.tokenizer.decode(request.prompt_ids(llm.tokenizer, history), skip_special_tokens=False)
    assert all(text.count(t.id) == 2 for t in c.tool_calls)  # the call's and its result's
    add = {"name": "add", "arguments": {"a": 1}}
    openai_ids = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": add}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    with pytest.raises(ValueError, match="length 9"):  # the template's own check
        llm.tokenizer.apply_chat_template(openai_ids)
    text = llm.tokenizer.decode(request.prompt_ids(llm.tokenizer, openai_ids), skip_special_tokens=False)
    mapped = llm.tool_format.template_id("call_1")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped) and text.count(mapped) == 2 and "call_1" not in text


# ---- hydragen chat --tools ------------------------------------------------------------------------------
def test_chat_shows_calls_and_asks_for_results(llms):
    """Piped: the question, then one line per call result. The named function is always called: the call
    is shown readably (no markup on screen), its result goes back into the conversation, and the model
    is asked again (here it calls again, and the input ends)."""
    import io

    from hydragen.chat import Chat
    from hydragen.chat_tools import ChatTools

    llm = llms["qwen2"]
    out, err = io.StringIO(), io.StringIO()
    tools = ChatTools(llm, TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    chat = Chat(
        llm,
        SamplingParams(temperature=0, max_tokens=1),
        4096,
        max_tokens=100,
        tools=tools,
        stdin=io.StringIO("Weather in Paris?\nsunny, 21 C\n"),
        stdout=out,
        stderr=err,
    )
    assert chat.run(0.0) == 0
    shown = out.getvalue()
    assert shown.count("-> get_weather(city=") == 2 and "<tool_call>" not in shown
    prompts = [int(n) for n in re.findall(r"prompt (\d+) tokens", err.getvalue())]
    result_tokens = len(llm.tokenizer.encode("sunny, 21 C", add_special_tokens=False))
    assert len(prompts) == 2 and prompts[1] > prompts[0] + result_tokens  # the call and its result


def test_chat_shows_a_cut_call_and_runs_none(llms):
    """A reply cut by --max-tokens inside its call: the chat shows the call as the server returns it (as far
    as it was written, marked), says that it runs no call of a cut reply, and asks for no result."""
    import io

    from hydragen.chat import Chat
    from hydragen.chat_tools import ChatTools

    llm = llms["qwen2"]
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(
        llm,
        SamplingParams(temperature=0, max_tokens=1),
        4096,
        max_tokens=60,
        tools=ChatTools(llm, [NOTE], "required"),
        stdin=io.StringIO("Take a note.\nnot a result\n"),
        stdout=out,
        stderr=err,
    )
    assert chat.run(0.0) == 0
    shown = out.getvalue()
    assert '-> note({"title": ' in shown and shown.count("[cut off by max_tokens]") == 2  # two turns
    assert "<tool_call>" not in shown and err.getvalue().count("its calls are not run") == 2
    assert chat.history[-1] == {"role": "assistant", "content": ""}  # the next line was a user turn


class _Terminal:
    """A chat's standard input on a terminal, and its prompts: each ``input`` takes the next scripted
    answer (an exception is raised, as Ctrl-C and Ctrl-D raise them) and records its prompt."""

    def __init__(self, answers: list) -> None:
        self.answers, self.asked = answers, []

    def isatty(self) -> bool:
        return True

    def prompt(self):
        terminal = self

        class Prompt:
            def input(self, prompt: str) -> str:
                terminal.asked.append(prompt)
                answer = terminal.answers.pop(0)
                if isinstance(answer, BaseException):
                    raise answer
                return answer

        return Prompt()


@pytest.mark.parametrize("key", [KeyboardInterrupt(), EOFError()], ids=["ctrl-c", "ctrl-d"])
def test_chat_on_a_terminal_asks_for_results_at_its_prompt(llms, monkeypatch, key):
    """On a terminal a call's result is read by the chat's prompt (the one messages use; Ctrl-C and
    Ctrl-D raise there): an answer goes back to the model, Ctrl-C or Ctrl-D leaves the calls unanswered
    and ends the turn but not the chat, which asks for the next message."""
    import io

    import hydragen.chat
    from hydragen.chat import Chat
    from hydragen.chat_tools import ChatTools

    terminal = _Terminal(["Weather in Paris?", "sunny, 21 C", key, EOFError()])
    monkeypatch.setattr(hydragen.chat, "TerminalPrompt", terminal.prompt)
    llm = llms["qwen2"]
    err = io.StringIO()
    chat = Chat(
        llm,
        SamplingParams(temperature=0, max_tokens=1),
        4096,
        max_tokens=100,
        tools=ChatTools(llm, TOOLS, {"type": "function", "function": {"name": "get_weather"}}),
        stdin=terminal,
        stdout=io.StringIO(),
        stderr=err,
    )
    assert chat.run(0.0) == 0
    assert terminal.asked == [">>> ", "get_weather result> ", "get_weather result> ", ">>> "]
    assert err.getvalue().count("the calls are left unanswered") == 1
    assert chat.history == []  # the unanswered turn is not kept


def test_chat_tools_file_is_checked_before_loading(tmp_path, capsys, monkeypatch):
    import hydragen
    from hydragen.cli import main

    monkeypatch.setattr(hydragen, "LLM", lambda *a, **k: pytest.fail("the model must not be loaded"))
    bad = tmp_path / "tools.json"
    bad.write_text("{not json")
    assert main(["chat", "--tools", str(bad)]) == 2
    assert f"--tools {bad}" in capsys.readouterr().err
    bad.write_text('{"functions": []}')
    assert main(["chat", "--tools", str(bad)]) == 2
    assert main(["chat", "--tool-choice", "required"]) == 2
    assert "--tool-choice needs --tools" in capsys.readouterr().err


# ---- the benchmarks' measuring code, at toy size -------------------------------------------------
def test_bench_tool_workloads_run(llms, tmp_path):
    """`bench structured --workload tools` (jump vs token by token), `bench tools` (cost, the no-stall
    measurement) and `bench schema-defaults`, on a tiny model: every part runs and reports what it says."""
    from hydragen.bench.structured import schema_defaults
    from hydragen.bench.structured import tool_calling as tools
    from hydragen.bench.structured import tool_workloads as tool_calls

    llm = llms["qwen2"]
    speed = {r["mode"]: r for r in tool_calls.speed_rows(llm, [2], 2, 1, 48, 1)["rows"]}
    assert speed["jump"]["forced_fraction"] > 0 == speed["no_jump"]["forced_fraction"]
    assert speed["jump"]["decode_steps"] < speed["no_jump"]["decode_steps"]
    cost = tools.cost(llm, 0, 16, 5)
    assert len(cost) == 5 and all(r["masks"] > 0 for r in cost)
    stall, timelines = tools.no_stall(llm, 1, 5, 20)
    assert [r["case"] for r in stall] == [f"compiled on the {p}" for p in timelines]
    assert all(len(t["arrivals"]) >= 10 for t in timelines.values())
    assert not llm.engine.has_unfinished()  # the server's engine thread has let go of the engine
    rows = schema_defaults.run(llm, ["flat_person", "nested_address"], 2, 40, 0)
    assert {r["reading"] for r in rows} == {
        "peers' default (named properties only)",
        "literal (any extra keys)",
    }
    assert not any(r["with_extra_keys"] > 0 for r in rows if r["reading"].startswith("peers"))
    paths = tools.plots({"rows": cost + stall, "timelines": timelines}, tmp_path)
    paths += schema_defaults.plots({"rows": rows}, tmp_path)
    assert len(paths) == 3 and all(p.stat().st_size > 0 for p in paths)


@pytest.mark.parametrize("kind", ["qwen2", "llama_sp", *NEW_KINDS])
def test_auto_enforces_the_call_once_the_marker_is_written(llms, kind):
    """auto: the reply's text is free; once the call marker is in it (here appended with
    EngineCore.append_forced, as if the model had written it), the rest is grammar-enforced and the reply
    parses into a valid call."""
    llm = llms[kind]
    engine, tok = llm.engine, llm.tokenizer
    request = ToolRequest.build(TOOLS, "auto", False, llm.tool_format)
    structured = engine.structured
    constraint = request.constraint(structured.compiler.ll_tokenizer, False)
    params = request.sampling_params(SamplingParams(temperature=1.0, seed=2, max_tokens=200), constraint)
    req = engine.add_request(request.prompt_ids(tok, ASK), params)
    lead = tok.encode("Let me check.\n" + llm.tool_format.trigger, add_special_tokens=False)
    engine.append_forced(req.request_id, 0, lead)
    while engine.has_unfinished():
        engine.step()
    c = req.seqs[0]
    content, calls, reason = request.reply(c.text, c.finish_reason)
    assert content == "Let me check." and reason == "tool_calls" and len(calls) == 1
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == calls[0].name)
    jsonschema.validate(calls[0].args, schema)
