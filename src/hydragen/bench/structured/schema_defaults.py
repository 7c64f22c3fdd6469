"""``hydragen bench schema-defaults``: how often constrained outputs end by themselves when schemas do not
say ``additionalProperties``, read the peers' way (only the named properties, hydragen's default) and
literally (any extra keys, JSON Schema's semantics, ``literal_json_schema=True``).

The workload: the project's 33-schema set (``hydragen/structured/schemas.py``) with every
``additionalProperties: false`` removed, which is how most schemas arrive from users; each asked for
through the chat template, greedy and sampled. Reported per reading: the fraction of outputs that end
by themselves (the grammar completes) before ``max_tokens``, the output length, and validity of those
that end (``jsonschema`` against the schema as sent).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hydragen.bench.core.common import publish, say_quick

RESULT_NAME = "schema_defaults"
COLUMNS = [
    "reading",
    "temperature",
    "outputs",
    "ended_by_itself",
    "mean_tokens",
    "valid_of_ended",
    "with_extra_keys",
]


def open_schema(schema):
    """``schema`` without any ``additionalProperties: false`` (a copy)."""
    if isinstance(schema, dict):
        return {
            k: open_schema(v) for k, v in schema.items() if not (k == "additionalProperties" and v is False)
        }
    if isinstance(schema, list):
        return [open_schema(v) for v in schema]
    return schema


def closed_everywhere(schema):
    """``schema`` with every object that names properties closed, allOf parts included (a copy): an output
    that it refuses while the schema as sent accepts has keys that no schema names."""
    if isinstance(schema, dict):
        out = {k: closed_everywhere(v) for k, v in schema.items()}
        if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed_everywhere(v) for v in schema]
    return schema


def run(llm, names: list[str], samples: int, max_tokens: int, seed: int) -> list[dict]:
    from hydragen import SamplingParams, StructuredOutputsParams
    from hydragen.bench import import_optional
    from hydragen.structured.schemas import SCHEMAS

    jsonschema = import_optional("jsonschema")

    rows = []
    for literal in (False, True):
        for temperature in (0.0, 1.0):
            n = 1 if temperature == 0 else samples
            prompts, params, schemas = [], [], []
            for name in names:
                schema = open_schema(SCHEMAS[name])
                ask = f"Fill in a {name.replace('_', ' ')} record. Answer with JSON only."
                prompts.append([{"role": "user", "content": ask}])
                so = StructuredOutputsParams(json=schema, literal_json_schema=literal)
                params.append(
                    SamplingParams(
                        n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so
                    )
                )
                schemas.append(schema)
            outs = llm.chat(prompts, params, use_tqdm=False)
            ended, lengths, valid, extra = 0, [], 0, 0
            for out, schema in zip(outs, schemas, strict=True):
                closed = jsonschema.Draft202012Validator(closed_everywhere(schema))
                for c in out.outputs:
                    lengths.append(len(c.token_ids))
                    if c.finish_reason != "stop":
                        continue
                    ended += 1
                    value = json.loads(c.text)
                    valid += jsonschema.Draft202012Validator(schema).is_valid(value)
                    extra += not closed.is_valid(value)
            total = len(lengths)
            rows.append(
                {
                    "reading": "literal (any extra keys)"
                    if literal
                    else "peers' default (named properties only)",
                    "temperature": temperature,
                    "outputs": total,
                    "ended_by_itself": ended / total,
                    "mean_tokens": statistics.fmean(lengths),
                    "valid_of_ended": valid / ended if ended else float("nan"),
                    "with_extra_keys": extra / ended if ended else float("nan"),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    from hydragen.bench.core.plots import QUICK_TITLE, pyplot

    plt = pyplot()

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    temps = sorted({r["temperature"] for r in rows})
    for j, reading in enumerate(dict.fromkeys(r["reading"] for r in rows)):
        values = [
            next(r["ended_by_itself"] for r in rows if r["reading"] == reading and r["temperature"] == t)
            for t in temps
        ]
        bars = ax.bar(
            [i + (j - 0.5) * 0.4 for i in range(len(temps))], values, 0.4, label=reading, color=f"C{j}"
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(temps)), [f"temperature {t:g}" for t in temps])
    ax.set_ylabel("outputs that end by themselves")
    ax.set_ylim(0, 1.15)
    title = "Schemas without additionalProperties: outputs that end within max_tokens"
    ax.set_title(QUICK_TITLE + "\n" + title if data.get("quick") else title)
    ax.legend(fontsize=8, loc="upper left")
    path = out / "schema_defaults.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench schema-defaults", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint with a chat template (default: embedded model)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the run works")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--samples", type=int, default=4, help="samples per schema at temperature 1 (default 4)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per output (default 256)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from hydragen import LLM
    from hydragen.structured.schemas import SCHEMAS

    names = list(SCHEMAS)
    if args.quick:
        say_quick("schema-defaults")
        names, args.samples, args.max_tokens = names[:3], 2, 48
    llm = LLM(args.model, kv_cache_tokens=65536)
    rows = run(llm, names, args.samples, args.max_tokens, args.seed)
    params = {k: v for k, v in vars(args).items() if k != "out"}
    params["model"] = args.model or "embedded SmolLM2-135M-Instruct"
    notes = (
        f"Model: {params['model']}. {len(names)} schemas of the project's set with additionalProperties: "
        f"false removed; greedy (1 output each) and temperature 1 ({args.samples} each); max_tokens "
        f"{args.max_tokens}. "
        "with_extra_keys: of the outputs that ended, those holding a key that no schema object names."
    )
    paths = publish(
        rows,
        COLUMNS,
        args.out,
        RESULT_NAME,
        "Schema defaults",
        notes,
        plots=plots,
        quick=args.quick,
        params=params,
    )
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
