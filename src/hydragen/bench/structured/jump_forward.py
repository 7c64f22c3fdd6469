"""``hydragen bench structured``: JSON extraction with and without jump-forward.

The workload: a passage about an entity (a movie, a company or a person, made up from a seed), and a
request to fill a JSON Schema about it: schema-heavy output, where keys, quotes and braces are forced
and only the values are the model's. Three ways to run it, side by side, at batch 1 (requests one
after another) and batch 32 (all at once):

* ``unconstrained``: the same prompts, no schema (the model writes what it likes, up to max_tokens);
* ``no_jump``: the schema enforced by masks, every token sampled (forced text token by token);
* ``jump``: the schema enforced, forced text appended by jump-forward (one forced append per run).

Reported: output tokens/s, mean and p99 request latency, the fraction of output tokens forced, grammar
mask time per token (mean, p99), compile time per schema (cold), the validity rate (parses and
validates with ``jsonschema``) and answer quality (fields equal to the passage's facts; jump vs
no_jump outputs identical). A second pair of runs measures the cost of masking alone: a fixed-length
free-text generation, unconstrained vs under a grammar that forces nothing (``free`` / ``free_masked``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from hydragen.bench.core.common import machine_description, say_quick, write_table
from hydragen.bench.structured.jump_forward_plots import plots
from hydragen.bench.structured.modes import FREE_MODES, MODES
from hydragen.bench.structured.timed_requests import timed

RESULT_NAME = "structured"
# Nothing is forced (any character may come next) and the grammar cannot end before max_tokens, so both
# free runs write exactly max_tokens tokens per request.
NOTHING_FORCED_REGEX = r"[\s\S]{4000}"

_TEXT = {"type": "string", "maxLength": 40}
_GENRES = ["drama", "comedy", "action", "documentary"]
_OCCUPATIONS = ["teacher", "engineer", "farmer", "doctor", "painter"]


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = {
    "movie": _obj(
        {
            "title": _TEXT,
            "release_year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": _GENRES},
            "director": _obj({"first_name": _TEXT, "last_name": _TEXT}),
            "rating_out_of_five": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
    "company": _obj(
        {
            "company_name": _TEXT,
            "founded_year": {"type": "integer", "minimum": 1800, "maximum": 2030},
            "headquarters": _obj({"city": _TEXT, "country": _TEXT}),
            "is_publicly_traded": {"type": "boolean"},
            "number_of_employees": {"type": "integer", "minimum": 1, "maximum": 1000000},
        }
    ),
    "person": _obj(
        {
            "full_name": _TEXT,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "occupation": {"enum": _OCCUPATIONS},
            "home_city": _TEXT,
            "has_children": {"type": "boolean"},
        }
    ),
}

_FIRST = ["Anna", "Marco", "Lena", "Tomas", "Ines", "Paul", "Sara", "Omar", "Julia", "Ravi"]
_LAST = ["Berg", "Costa", "Novak", "Silva", "Weber", "Moreau", "Khan", "Olsen", "Rossi", "Sato"]
_CITIES = [
    ("Lyon", "France"),
    ("Porto", "Portugal"),
    ("Graz", "Austria"),
    ("Osaka", "Japan"),
    ("Quito", "Ecuador"),
]
_TITLES = ["Silent Harbor", "The Glass River", "Night Train", "Paper Moons", "Iron Garden", "Blue Hour"]
_COMPANIES = ["Northwind Tools", "Aster Labs", "Kestrel Foods", "Lumen Freight", "Orchid Systems"]


def make_task(kind: str, rng: random.Random) -> tuple[str, dict]:
    """(passage, the facts it states, as the schema's JSON)."""
    if kind == "movie":
        facts = {
            "title": rng.choice(_TITLES),
            "release_year": rng.randint(1950, 2023),
            "genre": rng.choice(_GENRES),
            "director": {"first_name": rng.choice(_FIRST), "last_name": rng.choice(_LAST)},
            "rating_out_of_five": rng.randint(1, 5),
        }
        d = facts["director"]
        text = (
            f"{facts['title']} is a {facts['genre']} film released in {facts['release_year']}. "
            f"It was directed by {d['first_name']} {d['last_name']}, and critics gave it "
            f"{facts['rating_out_of_five']} stars out of five."
        )
    elif kind == "company":
        city, country = rng.choice(_CITIES)
        facts = {
            "company_name": rng.choice(_COMPANIES),
            "founded_year": rng.randint(1850, 2020),
            "headquarters": {"city": city, "country": country},
            "is_publicly_traded": rng.random() < 0.5,
            "number_of_employees": rng.randint(10, 50000),
        }
        text = (
            f"{facts['company_name']} was founded in {facts['founded_year']} and has its headquarters in "
            f"{city}, {country}. It employs {facts['number_of_employees']} people and its shares "
            f"{'are' if facts['is_publicly_traded'] else 'are not'} traded on a stock exchange."
        )
    else:
        city, _ = rng.choice(_CITIES)
        facts = {
            "full_name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "age": rng.randint(20, 80),
            "occupation": rng.choice(_OCCUPATIONS),
            "home_city": city,
            "has_children": rng.random() < 0.5,
        }
        text = (
            f"{facts['full_name']} is a {facts['age']}-year-old {facts['occupation']} who lives in {city}. "
            f"{'They have children.' if facts['has_children'] else 'They have no children.'}"
        )
    return text, facts


def make_prompts(llm, count: int, seed: int) -> list[tuple[str, list[int], dict]]:
    """(schema name, prompt token ids, facts) per request, kinds in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = list(SCHEMAS)[i % len(SCHEMAS)]
        passage, facts = make_task(kind, rng)
        keys = ", ".join(SCHEMAS[kind]["properties"])
        conv = [
            {"role": "system", "content": "You extract facts from text and answer with JSON only."},
            {"role": "user", "content": f"Passage: {passage}\n\nGive a JSON object with the keys: {keys}."},
        ]
        out.append((kind, llm.tokenizer.apply_chat_template(conv), facts))
    return out


def _leaves(value, prefix="") -> dict:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value}


def field_accuracy(text: str, facts: dict) -> float | None:
    """Fraction of the facts' fields the output states exactly (None when it is not a JSON object)."""
    try:
        got = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(got, dict):
        return None
    want, have = _leaves(facts), _leaves(got)
    return sum(have.get(k) == v for k, v in want.items()) / len(want)


def is_valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    from hydragen.bench import import_optional

    jsonschema = import_optional("jsonschema")  # validity needs the validator: missing, it says so
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def compile_times(llm) -> dict[str, float]:
    """Cold compile time (ms) per schema, in a fresh compiler (its tokenizer view built beforehand)."""
    from hydragen.structured.compiler import GrammarCompiler
    from hydragen.structured.params import StructuredOutputsParams

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.cfg.vocab_size, set(engine.tokenizer.eos_token_ids))
    t0 = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018  built once per engine, timed on its own
    times = {"(tokenizer view, once per engine)": 1e3 * (time.perf_counter() - t0)}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times[name] = 1e3 * (time.perf_counter() - t0)
    return times


def run(
    llm,
    batches: list[int],
    requests: int,
    serial: int,
    max_tokens: int,
    free_tokens: int,
    seed: int,
    repeats: int = 1,
) -> dict:
    """Every mode at every batch size; batch 1 runs the first ``serial`` requests (one at a time)."""
    from hydragen import SamplingParams, StructuredOutputsParams

    tasks = make_prompts(llm, requests, seed)
    so = {k: StructuredOutputsParams(json=s) for k, s in SCHEMAS.items()}
    plain = SamplingParams(temperature=0, max_tokens=max_tokens)
    constrained = {
        k: SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=p) for k, p in so.items()
    }
    free = SamplingParams(temperature=0, max_tokens=free_tokens, ignore_eos=True)
    free_masked = SamplingParams(
        temperature=0,
        max_tokens=free_tokens,
        structured_outputs=StructuredOutputsParams(regex=NOTHING_FORCED_REGEX),
    )
    # Warm-up: the compiled attention op, the grammar engine's tokenizer view and every schema.
    llm.engine.structured.jump_forward = True
    timed(llm, [(tasks[0][1], constrained[tasks[0][0]]), (tasks[0][1], plain), (tasks[0][1], free_masked)], 4)
    rows, texts = [], {}
    for batch in batches:
        some = tasks if batch > 1 else tasks[:serial]
        best: dict[str, dict] = {}
        # Modes interleaved, each run `repeats` times; the fastest run of each counts (greedy: the
        # outputs are the same every time), so load from other work hits every mode alike.
        for _ in range(repeats):
            for mode in MODES + FREE_MODES:
                llm.engine.structured.jump_forward = mode != "no_jump"
                if mode in MODES:
                    reqs = [(ids, plain if mode == "unconstrained" else constrained[k]) for k, ids, _ in some]
                else:
                    reqs = [(ids, free if mode == "free" else free_masked) for _, ids, _ in some]
                r = timed(llm, reqs, batch)
                print(json.dumps({"batch": batch, "mode": mode, "time_s": r["time_s"]}), flush=True)
                if mode not in best or r["time_s"] < best[mode]["time_s"]:
                    best[mode] = r
        for mode in MODES + FREE_MODES:
            r = dict(best[mode])
            outs = r.pop("outputs")
            row = {"batch": batch, "mode": mode, "requests": len(outs), **r}
            if mode in MODES:
                row["valid_rate"] = statistics.fmean(
                    is_valid(o.text, SCHEMAS[k]) for o, (k, _, _) in zip(outs, some, strict=True)
                )
                # Outputs stopped by max_tokens before the JSON closed: invalid for that reason alone.
                row["cut"] = statistics.fmean(o.finish_reason == "length" for o in outs)
                acc = [field_accuracy(o.text, f) for o, (_, _, f) in zip(outs, some, strict=True)]
                row["field_accuracy"] = statistics.fmean(a or 0.0 for a in acc)
                texts[(batch, mode)] = [o.text for o in outs]
            rows.append(row)
            print(json.dumps(row), flush=True)
    llm.engine.structured.jump_forward = True
    for batch in batches:
        same = [a == b for a, b in zip(texts[(batch, "jump")], texts[(batch, "no_jump")], strict=True)]
        for row in rows:
            if row["batch"] == batch and row["mode"] == "jump":
                row["same_as_no_jump"] = sum(same) / len(same)
                base = next(r for r in rows if r["batch"] == batch and r["mode"] == "no_jump")
                row["speedup_vs_no_jump"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["cpu_speedup_vs_no_jump"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
            if row["batch"] == batch and row["mode"] == "free_masked":
                base = next(r for r in rows if r["batch"] == batch and r["mode"] == "free")
                row["speed_vs_unconstrained"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["cpu_speed_vs_unconstrained"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    samples = {f"{b}/{m}": t[:3] for (b, m), t in texts.items()}
    return {"rows": rows, "compile_ms": compile_times(llm), "samples": samples}


COLUMNS = [
    "batch",
    "mode",
    "tokens_per_s",
    "tokens_per_cpu_s",
    "latency_mean_s",
    "latency_p99_s",
    "output_tokens",
    "decode_steps",
    "forced_fraction",
    "mask_us_per_token_mean",
    "mask_us_per_token_p99",
    "valid_rate",
    "cut",
    "field_accuracy",
    "same_as_no_jump",
    "speedup_vs_no_jump",
    "cpu_speedup_vs_no_jump",
    "speed_vs_unconstrained",
    "cpu_speed_vs_unconstrained",
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint with a tokenizer (default: embedded model)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the run works (seconds)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes (default 1 32)")
    p.add_argument("--requests", type=int, default=32, help="requests per batched run (default 32)")
    p.add_argument("--serial", type=int, default=8, help="requests run one at a time at batch 1 (default 8)")
    p.add_argument("--max-tokens", type=int, default=160, help="most output tokens per request (default 160)")
    p.add_argument("--free-tokens", type=int, default=64, help="tokens per free-text request (default 64)")
    p.add_argument("--seed", type=int, default=0, help="passage seed (default 0)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved; the fastest counts")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--workload",
        choices=["extraction", "tools"],
        default="extraction",
        help="extraction: JSON extraction (default); tools: tool-call output (tool_choice required, eight "
        "functions; then the defaults are batches 1 16, 16 requests, max tokens 96)",
    )
    args = p.parse_args(argv)
    if args.workload == "tools":
        defaults = {"batches": [1, 32], "requests": 32, "max_tokens": 160}
        for key, value in {"batches": [1, 16], "requests": 16, "max_tokens": 96}.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.quick:
        say_quick("structured")
        args.batches, args.requests, args.serial, args.max_tokens, args.free_tokens = [1, 4], 4, 2, 48, 8
        args.repeats = 1
    import torch

    from hydragen import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, kv_cache_tokens=65536)
    if llm.tokenizer is None:
        raise SystemExit(f"bench structured needs a model with a tokenizer; {llm.model_path} has none")
    if args.workload == "tools":
        from hydragen.bench.structured.tool_workloads import speed_rows

        result = speed_rows(llm, args.batches, args.requests, args.serial, args.max_tokens, args.repeats)
    else:
        result = run(
            llm,
            args.batches,
            args.requests,
            args.serial,
            args.max_tokens,
            args.free_tokens,
            args.seed,
            args.repeats,
        )
    out = args.out
    params = {k: v for k, v in vars(args).items() if k != "out"}
    params["model"] = args.model or "embedded SmolLM2-135M-Instruct"
    compile_lines = ", ".join(f"{k} {v:.1f} ms" for k, v in result["compile_ms"].items())
    columns = COLUMNS
    if args.workload == "tools":
        columns = [c for c in COLUMNS if "unconstrained" not in c and c != "field_accuracy"]
        columns.insert(columns.index("valid_rate"), "finished_rate")
        columns.insert(columns.index("valid_rate") + 1, "right_function")
        compile_lines = "see hydragen bench tools"
    notes = (
        f"Model: {params['model']}. {args.requests} requests per batched run ({args.serial} at batch 1, one "
        f"after another), greedy, max_tokens {args.max_tokens}; modes interleaved, fastest of "
        f"{args.repeats} runs each; torch threads {torch.get_num_threads()}. "
        f"Cold compile time per schema: {compile_lines}. "
        + (
            f"free / free_masked: {args.free_tokens} tokens per request, unconstrained vs a grammar that "
            "forces nothing."
            if args.workload == "extraction"
            else "Tool calls: tool_choice required, one call, eight functions; finished_rate: the call ended "
            "within max_tokens; valid_rate: of those, the call parses and validates; right_function: it "
            "calls the function the request asks for."
        )
    )
    md = write_table(
        result["rows"],
        columns,
        out,
        RESULT_NAME,
        "Structured outputs: tool calls"
        if args.workload == "tools"
        else "Structured outputs: JSON extraction",
        notes,
        quick=args.quick,
        quick_note=(
            f"max_tokens is {args.max_tokens} here, shorter than most of these JSON objects: an output cut "
            "there is not valid JSON (the cut column counts them), so valid_rate and field_accuracy are low "
            "for that reason alone; the full run allows 160 tokens."
        ),
        params=params,
    )
    data = json.loads((out / f"{RESULT_NAME}.json").read_text())
    data.update(compile_ms=result["compile_ms"], samples=result["samples"], machine=machine_description())
    (out / f"{RESULT_NAME}.json").write_text(json.dumps(data, indent=2))
    print(md)
    for path in plots(data, out):
        print(path)


if __name__ == "__main__":
    main()
