"""Tool-call workloads shared by ``hydragen bench tools``, ``hydragen bench structured --workload tools``
and the tests: varied tool sets made from a seed, requests batched through the engine (each with its own
tools), and the check that a reply's calls parse and validate against their functions' schemas."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

_WORDS = ["city", "query", "limit", "unit", "user", "item", "date", "color", "level", "note", "tags", "size"]
_VERBS = ["get", "set", "find", "add", "list", "send", "book", "check", "convert", "lookup"]
_NOUNS = ["weather", "stock", "flight", "order", "email", "event", "price", "route", "recipe", "account"]


def _property(rng: random.Random, depth: int) -> dict:
    """One argument's schema: bounded, so a call always ends within a bounded number of tokens."""
    kind = rng.choice(["string", "integer", "enum", "boolean", "number", "array", "object", "nullable"])
    if kind == "object" and depth > 0:
        kind = "string"
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24]), "description": "free text"}
    if kind == "integer":
        low = rng.choice([0, 1, -10])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([9, 99, 999])}
    if kind == "enum":
        return {"enum": rng.sample(["low", "medium", "high", "red", "green", "celsius", "fahrenheit"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
    if kind == "nullable":
        return {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}
    return _parameters(rng, depth + 1, rng.randint(1, 2))


def _parameters(rng: random.Random, depth: int, count: int) -> dict:
    names = rng.sample(_WORDS, count)
    props = {n: _property(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def random_tools(rng: random.Random, count: int) -> list[dict]:
    """``count`` OpenAI tool definitions with distinct names and varied, bounded argument schemas."""
    names = rng.sample([f"{v}_{n}" for v in _VERBS for n in _NOUNS], count)
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ')} for the user",
                "parameters": _parameters(rng, 0, rng.randint(0, 4)),
            },
        }
        for name in names
    ]


@dataclass
class ToolReply:
    content: str | None
    calls: list  # hydragen.tools.ToolCall
    finish_reason: str | None
    token_ids: list[int]
    forced: int = 0

    @property
    def complete_calls(self) -> list:
        """The calls the model finished (a reply cut by max_tokens also returns the one it was writing)."""
        return [c for c in self.calls if c.complete]


def run_tool_requests(llm, jobs: list[tuple[list[dict], object]], params) -> list[ToolReply]:
    """Run (conversation, ToolRequest) jobs in one batch, each with its own tools and grammar; ``params``
    is the SamplingParams every job starts from."""
    structured = llm.engine.structured
    ids, job_params = [], []
    for conversation, request in jobs:
        ids.append(request.prompt_ids(llm.tokenizer, conversation))
        constraint = request.constraint(structured.compiler.ll_tokenizer, structured.literal_json_schema)
        job_params.append(request.sampling_params(params, constraint))
    outs = llm.generate(ids, job_params, use_tqdm=False)
    replies = []
    for out, (_, request) in zip(outs, jobs, strict=True):
        c = out.outputs[0]
        content, calls, reason = request.reply(c.text, c.finish_reason)
        replies.append(ToolReply(content, calls, reason, list(c.token_ids)))
    return replies


def call_problems(reply: ToolReply, tools: list[dict], named: str | None = None) -> list[str]:
    """Why a reply's calls are not valid (empty: every call names a tool, its arguments parse as JSON and
    validate against that tool's parameters with ``jsonschema``; a call cut by max_tokens, unfinished, is
    allowed only as the last call of a reply that ended with "length", and only its name is checked)."""
    from hydragen.bench import import_optional

    jsonschema = import_optional("jsonschema")

    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    problems = []
    for i, call in enumerate(reply.calls):
        if call.name not in schemas or (named is not None and call.name != named):
            problems.append(f"unexpected function {call.name!r}")
            continue
        if not call.complete:
            if reply.finish_reason != "length" or i != len(reply.calls) - 1:
                problems.append(
                    f"{call.name}: unfinished call in a reply that ended with {reply.finish_reason}"
                )
            continue
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            problems.append(f"{call.name}({call.arguments}): {str(e).splitlines()[0]}")
    return problems


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_STR = {"type": "string"}
REAL_TOOLS = [
    _fn(
        "get_weather",
        "The current weather in a city",
        {"city": _STR, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    _fn(
        "search_web",
        "Search the web",
        {"query": _STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        ["query"],
    ),
    _fn("get_stock_price", "The latest price of a stock", {"ticker": _STR}, ["ticker"]),
    _fn(
        "send_email", "Send an email", {"to": _STR, "subject": _STR, "body": _STR}, ["to", "subject", "body"]
    ),
    _fn(
        "create_event",
        "Add an event to the calendar",
        {"title": _STR, "date": _STR, "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600}},
        ["title", "date"],
    ),
    _fn(
        "convert_currency",
        "Convert an amount of money",
        {"amount": {"type": "number"}, "from_currency": _STR, "to_currency": _STR},
        ["amount", "from_currency", "to_currency"],
    ),
    _fn("get_time", "The current time in a time zone", {"timezone": _STR}, ["timezone"]),
    _fn(
        "translate", "Translate a text", {"text": _STR, "target_language": _STR}, ["text", "target_language"]
    ),
]
# (request, the function it calls for, or None when it needs none)
ASKS = [
    ("What is the weather like in Paris today?", "get_weather"),
    ("Search the web for the best hiking trails near Denver.", "search_web"),
    ("What is Apple's stock price right now?", "get_stock_price"),
    ("Email bob@example.com that the meeting moved to 3 pm.", "send_email"),
    ("Put a dentist appointment on my calendar for 2025-03-14.", "create_event"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("What time is it in Tokyo?", "get_time"),
    ("Translate 'good morning' into Spanish.", "translate"),
    ("Tell me a short joke about cats.", None),
    ("What is the capital of Italy?", None),
    ("Write one sentence about the sea.", None),
    ("What is 12 times 12?", None),
]


def real_jobs(llm, count: int, tool_choice="required", parallel: bool = False, needing_tools: bool = True):
    """``count`` (conversation, ToolRequest, expected function) jobs over REAL_TOOLS, asks in turn (only the
    ones that need a tool unless ``needing_tools`` is False)."""
    from hydragen.tools.request import ToolRequest

    asks = [a for a in ASKS if a[1] is not None or not needing_tools]
    jobs = []
    for i in range(count):
        text, expected = asks[i % len(asks)]
        request = ToolRequest.build(REAL_TOOLS, tool_choice, parallel, llm.tool_format)
        jobs.append(([{"role": "user", "content": text}], request, expected))
    return jobs


def speed_rows(llm, batches: list[int], requests: int, serial: int, max_tokens: int, repeats: int) -> dict:
    """``hydragen bench structured --workload tools``: tool-call output (tool_choice "required", one call,
    eight functions), forced text sampled token by token (no_jump) vs jump-forward (jump), at each batch
    size. The same columns as the extraction workload; validity is "every call parses and validates"."""
    from hydragen import SamplingParams
    from hydragen.bench.structured.timed_requests import timed

    structured = llm.engine.structured
    jobs = real_jobs(llm, requests)
    base = SamplingParams(temperature=0, max_tokens=max_tokens)
    prepared = []
    for conversation, request, _ in jobs:
        constraint = request.constraint(structured.compiler.ll_tokenizer, structured.literal_json_schema)
        prepared.append(
            (request.prompt_ids(llm.tokenizer, conversation), request.sampling_params(base, constraint))
        )
    timed(llm, prepared[:2], 2)  # warm-up: compiled op, tokenizer view, grammar
    rows, texts = [], {}
    for batch in batches:
        some = prepared if batch > 1 else prepared[:serial]
        best: dict[str, dict] = {}
        for _ in range(repeats):
            for mode in ("no_jump", "jump"):
                structured.jump_forward = mode == "jump"
                r = timed(llm, some, batch)
                print(json.dumps({"batch": batch, "mode": mode, "time_s": r["time_s"]}), flush=True)
                if mode not in best or r["time_s"] < best[mode]["time_s"]:
                    best[mode] = r
        for mode in ("no_jump", "jump"):
            r = dict(best[mode])
            outs = r.pop("outputs")
            replies = []
            for o, (_, request, _) in zip(outs, jobs, strict=False):
                content, calls, reason = request.reply(o.text, o.finish_reason)
                replies.append(ToolReply(content, calls, reason, list(o.token_ids)))
            finished = [rep for rep in replies if rep.finish_reason == "tool_calls"]
            valid = [not call_problems(rep, REAL_TOOLS) for rep in finished]
            right = [any(c.name == j[2] for c in rep.calls) for rep, j in zip(replies, jobs, strict=False)]
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "requests": len(outs),
                    **r,
                    "finished_rate": len(finished) / len(replies),  # the call ended within max_tokens
                    "valid_rate": sum(valid) / len(valid) if valid else float("nan"),  # of those
                    "right_function": sum(right) / len(right),  # called the function the request asked for
                }
            )
            texts[(batch, mode)] = [o.text for o in outs]
            print(json.dumps(rows[-1]), flush=True)
        jump = next(x for x in rows if x["batch"] == batch and x["mode"] == "jump")
        plain = next(x for x in rows if x["batch"] == batch and x["mode"] == "no_jump")
        same = [a == b for a, b in zip(texts[(batch, "jump")], texts[(batch, "no_jump")], strict=True)]
        jump["same_as_no_jump"] = sum(same) / len(same)
        jump["speedup_vs_no_jump"] = jump["tokens_per_s"] / plain["tokens_per_s"]
        jump["cpu_speedup_vs_no_jump"] = jump["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
    structured.jump_forward = True
    samples = {f"{b}/{m}": t[:3] for (b, m), t in texts.items()}
    return {"rows": rows, "compile_ms": {}, "samples": samples}
