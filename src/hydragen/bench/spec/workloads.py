"""``hydragen bench spec``: speculative decoding on the embedded model, workload by workload, on and off.

The embedded SmolLM2-135M is a real model, so what it accepts is real. Workloads (the prompts are built
from hydragen's own source and docs, so every run has the same text):

* ``code``: a ~150-line Python file and an instruction whose answer is mostly the file;
* ``extract``: a ~2,000-token document and a question answered by quoting it;
* ``agent``: an agent loop's context, re-sent with a tool's JSON result to report from;
* ``json``: a JSON object under a schema (structured outputs: speculation stays off for constrained
  sequences, jump-forward already appends what the grammar forces);
* ``chat``: open-ended chat, which should gain nothing and must lose nothing;
* ``samples``: n = 8 samples of one prompt (siblings are a draft source), at batch 1, 4 and 8 requests.

For each workload, batch (distinct prompts of the workload at once) and sampling setting (greedy, and
temperature 0.8 / top_p 0.95 seeded), it times ``generate`` of ``--tokens`` new tokens with the prompts
already in the prefix cache, speculation off and on (the cost rule on), paired in alternating rounds, and
reports tok/s, the ratio, the acceptance and whether the tokens were identical. The peer is llama.cpp with
its own prompt lookup (llama-cpp-python's ``LlamaPromptLookupDecoding``) on the same file and prompts, one
sequence at a time (``--peer``).

Usage: hydragen bench spec [--workloads code,extract,...] [--batches 1,4,16,64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hydragen.bench.core.common import publish, say_quick
from hydragen.bench.core.plots import Panel, plot

RESULT_NAME = "spec"
WORKLOADS = ("code", "extract", "agent", "json", "chat", "samples")
SETTINGS = {"greedy": dict(temperature=0.0), "t0.8": dict(temperature=0.8, top_p=0.95)}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def say(message: str) -> None:
    print(f"[spec] {message}", file=sys.stderr, flush=True)


def _source(i: int, lines: int = 150) -> str:
    """~``lines`` lines of one of hydragen's own modules (the i-th, cycling)."""
    import hydragen

    root = Path(hydragen.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if len(p.read_text().splitlines()) >= lines)
    text = files[i % len(files)].read_text().splitlines()
    return "\n".join(text[:lines])


def _document(words: int = 1500) -> str:
    """~2,000 tokens of hydragen's design notes."""
    import hydragen

    root = Path(hydragen.__file__).resolve().parents[2]
    doc = root / "docs" / "design.md"
    text = doc.read_text() if doc.exists() else _source(0, 400)
    return " ".join(text.split()[:words])


QUESTIONS = [
    "What does the KV manager own?", "How are pages shared?", "What is a shared run?",
    "How does attention decompose?", "What is the cost rule?", "How is the prefix tree keyed?",
    "What does the scheduler do?", "How are sliding windows handled?",
]  # fmt: skip
TOPICS = ["a lighthouse keeper", "a lost robot", "a city garden", "a chess match", "the first snow",
          "a night train", "an old map", "a quiet library"]  # fmt: skip


def prompts_of(workload: str, batch: int) -> list:
    """``batch`` chat conversations of one workload (``samples``: one conversation)."""
    if workload == "code":
        return [
            [
                {
                    "role": "user",
                    "content": "Add a one-line comment at the top of this file, then repeat the whole "
                    f"file unchanged:\n\n```python\n{_source(i)}\n```",
                }
            ]  # fmt: skip
            for i in range(batch)
        ]
    if workload == "extract":
        doc = _document()
        return [
            [
                {
                    "role": "user",
                    "content": f"Document:\n{doc}\n\nQuote the sentences of the document that answer: "
                    f"{QUESTIONS[i % len(QUESTIONS)]}",
                }
            ]  # fmt: skip
            for i in range(batch)
        ]
    if workload == "agent":
        out = []
        for i in range(batch):
            days = [{"day": d, "high_c": 10 + d + i, "low_c": d, "rain_mm": d * 2} for d in range(1, 8)]
            result = {"city": f"City {i}", "forecast": days, "source": "weather-service", "units": "metric"}
            out.append([
                {"role": "system", "content": "You are an agent. Report tool results exactly as JSON."},
                {"role": "user", "content": f"What is the weather in City {i} this week?"},
                {"role": "assistant", "content": f'get_forecast({{"city": "City {i}", "days": 7}})'},
                {"role": "user", "content": f"Tool result:\n{json.dumps(result)}\n\nRepeat the tool result "
                 "as JSON, then summarise it."},
            ])  # fmt: skip
        return out
    if workload == "json":
        return [
            [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}]
            for i in range(batch)
        ]
    if workload == "chat":
        return [
            [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(batch)
        ]
    if workload == "samples":
        ask = "Write a Python function that checks whether a number is prime."
        return [[{"role": "user", "content": ask}] for _ in range(batch)]
    raise ValueError(f"unknown workload {workload!r}")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "summary": {"type": "string"}, "tags": {"type": "array",
                   "items": {"type": "string"}}},
    "required": ["name", "summary", "tags"],
}  # fmt: skip


def params_of(workload: str, setting: str, tokens: int):
    from hydragen import SamplingParams
    from hydragen.structured.params import StructuredOutputsParams

    extra = {}
    if workload == "json":
        extra["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
    if workload == "samples":
        extra["n"] = 8
    seed = 1 if setting != "greedy" else None
    return SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed, **SETTINGS[setting], **extra)


def _ids(llm, conversations: list) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]


def time_one(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    """Seconds of one ``generate`` and its outputs' token ids."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [c.token_ids for o in outs for c in o.outputs]


def measure(workloads, batches, settings, tokens: int, rounds: int) -> list[dict]:
    from hydragen import LLM, SamplingParams

    off = LLM(kv_cache_tokens=262144)
    on = LLM(kv_cache_tokens=262144, speculative_config=SPEC)
    rows = []
    for workload in workloads:
        for batch in batches if workload != "samples" else [b for b in (1, 4, 8) if b <= max(batches)]:
            prompts = _ids(off, prompts_of(workload, batch))
            for setting in settings:
                params = params_of(workload, setting, tokens)
                for llm in (off, on):  # the prompts into each prefix cache first
                    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
                spec = on.engine.scheduler.speculator
                before = spec.metrics.copy()
                best = {"off": float("inf"), "on": float("inf")}
                same = True
                for _ in range(rounds):
                    t_off, a = time_one(off, prompts, params)
                    t_on, b = time_one(on, prompts, params)
                    best["off"], best["on"] = min(best["off"], t_off), min(best["on"], t_on)
                    same = same and a == b
                m = spec.metrics.since(before)
                produced = sum(len(t) for t in a)
                row = {
                    "workload": workload, "batch": batch, "sampling": setting,
                    "off tok/s": produced / best["off"], "on tok/s": produced / best["on"],
                    "on / off": best["off"] / best["on"],
                    "acceptance": m.acceptance_rate, "tokens per verification": m.mean_accepted_length,
                    "steps speculated": m.speculated_steps / max(m.steps, 1),
                    "identical tokens": "yes" if same else "no",
                }  # fmt: skip
                rows.append(row)
                say(
                    f"{workload} batch {batch} {setting}: off {row['off tok/s']:.1f} tok/s, on "
                    f"{row['on tok/s']:.1f} ({row['on / off']:.2f}x), acceptance {m.acceptance_rate:.2f}, "
                    f"identical {row['identical tokens']}"
                )
    off.close()
    on.close()
    return rows


EXACT_SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t0.8 seeded": dict(temperature=0.8, top_p=0.95, seed=7),
    "t0.8 n=2": dict(temperature=0.8, top_p=0.95, seed=7, n=2),
    "stop strings": dict(temperature=0.8, top_p=0.95, seed=3, stop=["\n\n", "."]),
}


def exactness(workloads, prompts_per: int, tokens: int, batch: int) -> list[dict]:
    """``prompts_per`` prompts of each workload, ``batch`` at a time, through speculation off and on (every
    draft found verified: no cost rule, the most drafts): sequences whose tokens, finish reason and text
    are identical, and the largest log-probability gap among sequences with the same tokens."""
    from hydragen import LLM, SamplingParams

    off = LLM(kv_cache_tokens=262144)
    on = LLM(kv_cache_tokens=262144, speculative_config={**SPEC, "cost_rule": False})
    rows = []
    for workload in workloads:
        if workload == "samples":
            continue  # its prompts are one prompt: "t0.8 n=2" covers sisters
        prompts = _ids(off, prompts_of(workload, prompts_per))
        for name, setting in EXACT_SETTINGS.items():
            extra = {"structured_outputs": params_of(workload, "greedy", 1).structured_outputs}
            params = SamplingParams(max_tokens=tokens, logprobs=1, **setting, **extra)
            spec = on.engine.scheduler.speculator
            before = spec.metrics.copy()
            same = total = 0
            gap = 0.0
            for i in range(0, len(prompts), batch):
                a = off.generate(prompts[i : i + batch], params, use_tqdm=False)
                b = on.generate(prompts[i : i + batch], params, use_tqdm=False)
                for x, y in zip(a, b, strict=True):
                    for c, d in zip(x.outputs, y.outputs, strict=True):
                        total += 1
                        if (c.token_ids, c.finish_reason, c.text) != (d.token_ids, d.finish_reason, d.text):
                            continue
                        same += 1
                        for u, v, t in zip(c.logprobs, d.logprobs, c.token_ids, strict=True):
                            gap = max(gap, abs(u[t] - v[t]) if u[t] is not None else 0.0)
            m = spec.metrics.since(before)
            rows.append({"workload": workload, "sampling": name, "sequences": total, "identical": same,
                         "largest logprob gap": gap, "drafts accepted": m.accepted_tokens})  # fmt: skip
            say(f"exactness {workload} {name}: {same} of {total} identical, logprob gap {gap:.2e}, "
                f"{m.accepted_tokens} drafts accepted")  # fmt: skip
    off.close()
    on.close()
    return rows


def peer_rows(workloads, settings, tokens: int) -> list[dict]:
    """llama.cpp with prompt lookup, one sequence at a time, on the embedded file (batch 1 rows)."""
    from hydragen.bench.peers import llamacpp_lookup
    from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess, in_peer
    from hydragen.model.default_model import default_model_path

    rows = []
    try:
        peer = PeerProcess("llama.cpp", llamacpp_lookup.LookupPeer, str(default_model_path()), 8192, 4)
    except PeerCrashed as e:
        say(f"llama.cpp left out: {e}")
        return rows
    from hydragen import LLM

    tok = LLM(kv_cache_tokens=4096)
    run = in_peer(llamacpp_lookup.timed)
    for workload in workloads:
        if workload in ("json", "samples"):
            continue  # a grammar and n > 1 are not what its lookup decoding serves
        (prompt,) = _ids(tok, prompts_of(workload, 1))
        for setting in settings:
            s = SETTINGS[setting]
            try:
                plain = run(peer, prompt, tokens, s.get("temperature", 0.0), s.get("top_p", 1.0), False)
                lookup = run(peer, prompt, tokens, s.get("temperature", 0.0), s.get("top_p", 1.0), True)
            except PeerCrashed as e:
                say(f"llama.cpp crashed: {e}")
                return rows
            except Exception as e:  # noqa: BLE001  the peer's own error: its rows are left out, ours stand
                say(f"llama.cpp failed on {workload} {setting}: {type(e).__name__}: {e}")
                continue
            rows.append({"workload": workload, "sampling": setting, "llama.cpp tok/s": plain,
                         "llama.cpp lookup tok/s": lookup})  # fmt: skip
            say(f"llama.cpp {workload} {setting}: {plain:.1f} tok/s, with prompt lookup {lookup:.1f}")
    peer.close()
    tok.close()
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    panels = []
    for setting in SETTINGS:
        series: dict[str, tuple[list, list]] = {}
        for r in data["rows"]:
            if r.get("sampling") != setting or "on / off" not in r:
                continue
            xs, ys = series.setdefault(r["workload"], ([], []))
            xs.append(r["batch"])
            ys.append(r["on / off"])
        if series:
            panels.append(Panel(series, title=setting, hline=(1.0, "speculation off")))
    if not panels:
        return []
    return [
        plot(panels, out / "spec.png", "Speculative decoding (n-gram, cost rule on), embedded model",
             "batch (requests at once)", "tok/s on / tok/s off", logx=True, quick=data.get("quick", False))
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--settings", default="greedy,t0.8")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per sequence (default 128)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="llama.cpp's lookup")
    p.add_argument("--quick", action="store_true", help="code and chat at batch 1, 16 tokens, no peer")
    p.add_argument(
        "--exactness", type=int, default=0, metavar="N",
        help="instead: N prompts per workload, on against off, counting identical sequences",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    workloads = [w for w in a.workloads.split(",") if w]
    batches = [int(b) for b in a.batches.split(",") if b]
    settings = [s for s in a.settings.split(",") if s]
    if a.quick:
        say_quick("spec")
        workloads, batches, settings, a.tokens, a.rounds, a.peer = (
            ["code", "chat"],
            [1],
            ["greedy"],
            16,
            1,
            False,
        )
    for name in workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if a.exactness:
        tokens = 64 if a.tokens == 128 else a.tokens
        rows = exactness(workloads, a.exactness, tokens, 16)
        notes = (
            f"{a.exactness} prompts per workload, 16 at a time, {tokens} new tokens, logprobs=1; speculation "
            "off "
            "against on with every draft found verified (cost_rule false). 'identical': token ids, finish "
            "reason and text equal; the logprob gap is over the identical sequences' chosen tokens."
        )
        columns = ["workload", "sampling", "sequences", "identical", "largest logprob gap", "drafts accepted"]
        publish(rows, columns, a.out, "spec_exactness", "Speculation on against off: identical outputs",
                notes, plots=lambda data, out: [], params={"prompts": a.exactness})  # fmt: skip
        return
    rows = measure(workloads, batches, settings, a.tokens, a.rounds)
    if a.peer:
        rows += peer_rows(workloads, settings, a.tokens)
    columns = ["workload", "batch", "sampling", "off tok/s", "on tok/s", "on / off", "acceptance",
               "tokens per verification", "steps speculated", "identical tokens", "llama.cpp tok/s",
               "llama.cpp lookup tok/s"]  # fmt: skip
    notes = (
        f"Embedded SmolLM2-135M Q4_1; {a.tokens} new tokens a sequence (ignore_eos), prompts already cached; "
        f"speculative_config {json.dumps(SPEC)} with the cost rule on; the fastest of {a.rounds} paired "
        "rounds. "
        "'identical tokens': every sequence's tokens equal with speculation on and off. llama.cpp rows: one "
        "sequence, its LlamaPromptLookupDecoding(num_pred_tokens=4) against none."
    )
    params = {"workloads": workloads, "batches": batches, "tokens": a.tokens}
    publish(rows, columns, a.out, RESULT_NAME, "Speculative decoding on the embedded model", notes,
            plots=plots, quick=a.quick, params=params)  # fmt: skip


if __name__ == "__main__":
    main()
