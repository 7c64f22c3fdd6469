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
    validate against that tool's parameters with ``jsonschema``)."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    problems = []
    for call in reply.calls:
        if call.name not in schemas or (named is not None and call.name != named):
            problems.append(f"unexpected function {call.name!r}")
            continue
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            problems.append(f"{call.name}({call.arguments}): {str(e).splitlines()[0]}")
    return problems
