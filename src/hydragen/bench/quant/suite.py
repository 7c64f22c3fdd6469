"""``hydragen bench quant``: GGUF weights computed in their own format, measured.

Five parts, each a table (Markdown + JSON) and where it helps a plot:
* ``kernels``: every format at M = 1, 8, 64, 512 against the measured memory bandwidth and float32 GEMM
  rate, beside torch's candidates (bench/quant/kernels.py);
* ``accuracy``: hydragen (15-bit and int8 activations) and llama.cpp against the float32-dequantized model
  over 128 chat prompts (bench/quant/accuracy.py);
* ``decode``: side by side in one run on the same GGUF, decode tokens/s at n = 1 and 8 (one 512-token
  prompt) and 64 (one shared 2,048-token prompt): hydragen as it runs, with its layers run one op at a time
  from Python (``HYDRAGEN_FUSED_LAYERS=0``), on the dequantized float32 weights (what it ran before),
  llama.cpp (its ``batched`` example's scheme: bench/peers/llamacpp_peer.py, in a process of its own:
  bench/peers/peer_process.py; a llama.cpp that crashes is reported in the table, and the run goes on)
  (bench/quant/decode.py);
* ``memory``: resident memory after load, and the peak while loading, against the file's size, in a fresh
  process per model; the fixed runtime (Python, torch, the ops, a tiny model) measured first and subtracted
  (bench/quant/memory.py);
* ``real``: a random-weights GGUF of a real shape (``--real-size llama-3.1-8b:Q4_K_M``, written once to
  hydragen's cache, never into the repository): its memory and decode at n = 1 and 16 against llama.cpp.

This module runs the parts and combines their tables; the plots are bench/quant/plots.py.

Both engines sample from the same distribution, by default the issue's temperature 0.8, top_p 0.95
(``--temperature/--top-p/--top-k/--min-p``; temperature 0: greedy): hydragen with its sampler, llama.cpp with
its sampler chain per sequence, as its batched example does. Decode-only rate: n (T - 1) / (t(T) - t(1));
rounds alternate the engines, and each point's best rate takes its fastest t(1) and fastest t(T) over the
rounds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hydragen.bench.core.common import code_commit, machine_description, matmul_rate, say_quick, write_table
from hydragen.bench.quant import accuracy, kernels, memory
from hydragen.bench.quant.decode import (
    DECODE_COLUMNS,
    DECODE_POINTS,
    MODES,
    SAMPLING,
    decode_rows,
    sampling_words,
    say,
)
from hydragen.bench.quant.plots import plots

RESULT_NAME = "quant"
PARTS = ("kernels", "accuracy", "decode", "memory", "real")


# ---- the run ----------------------------------------------------------------------------------------
def _kernels(a, quick: bool) -> tuple[list[dict], dict, str]:
    bw, gemm = kernels.read_bandwidth(64 if quick else 512), matmul_rate(512 if quick else 2048)
    say(f"read bandwidth {bw / 1e9:.1f} GB/s, float32 GEMM {gemm / 1e9:.0f} GFLOP/s")
    n, k = a.kernel_shape
    rows = kernels.kernel_table(n, k, (1, 8) if quick else kernels.ROWS, 2 if quick else 5, bw, gemm)
    extra = {"bandwidth GB/s": bw / 1e9, "fp32 GEMM GFLOP/s": gemm / 1e9, "shape": [n, k]}
    notes = (
        f"{n} x {k} weights, read from memory (copies cycled through more than the last-level cache). "
        f"Measured here: read bandwidth {bw / 1e9:.1f} GB/s (a sum over 512 MB, every thread), float32 GEMM "
        f"{gemm / 1e9:.0f} GFLOP/s (2,048^3, oneDNN). GB/s counts the weight bytes a call reads; GFLOP/s "
        "2 M N K. hydragen's kernels run with their default 15-bit activations unless the row says int8."
    )
    return rows, extra, notes


def _accuracy(a, quick: bool) -> tuple[list[dict], dict, str]:
    tokens = 8 if quick else 32
    skipped: dict[str, str] = {}
    rows = accuracy.run(a.model, 8 if quick else a.prompts, tokens, say, skipped)
    notes = (
        "Each model is fed the reference's tokens (teacher forcing); KL(reference || model) of the "
        f"next-token distribution, top-1 agreement, then {tokens} greedy tokens each. Reference: the same "
        "file dequantized to float32 and run by hydragen (float64 KL), or llama.cpp's logits where named."
    )
    if "llamacpp" in skipped:
        notes += f" llama.cpp did not run here ({skipped['llamacpp']}): no rows against it."
    return rows, {"greedy tokens": tokens}, notes


def _decode(a, quick: bool) -> tuple[list[dict], dict, str]:
    points = ((1, 64), (4, 64), (4, 64, True)) if quick else a.points or DECODE_POINTS
    new_tokens = 4 if quick else a.new_tokens
    rounds = 1 if quick else a.rounds
    sampling = _sampling(a)
    skipped: dict[str, str] = {}
    rows = decode_rows(a.model, points, new_tokens, rounds, a.engines or MODES, sampling, skipped)
    notes = (
        "n completions of one prompt (its KV shared by every engine), or, where 'prompts' is n, n distinct "
        f"prompts of that length, one completion each; {sampling_words(sampling)}. Decode-only "
        f"rate n (T - 1) / (t(T) - t(1)); best of {rounds} alternating rounds. 'vs llama.cpp' divides the "
        "two best rates; 'paired' is the median over rounds of the ratio within a round (the engines run "
        "back to back in each round)." + _skipped_peer(a.model, rows, skipped)
    )
    extra = {"points": points, "new_tokens": new_tokens, "engines": _engines_run(rows)}
    return rows, {**extra, "sampling": sampling}, notes


def _engines_run(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in rows))


def _skipped_peer(model, rows: list[dict], skipped: dict[str, str]) -> str:
    """A table's word on a llama.cpp peer that did not run (its ratios then read n/a): not installed, not
    asked for, or crashed (``skipped``: decode_rows' reasons)."""
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.model.loader import resolve_model_path

    if any(r["mode"] == "llamacpp" for r in rows):
        return ""
    why = skipped.get("llamacpp") or llamacpp_peer.unavailable(
        model if isinstance(model, Path) else resolve_model_path(model), False
    )
    return f" llama.cpp did not run here ({why or 'not asked for'}): 'vs llama.cpp' is n/a."


def _sampling(a: argparse.Namespace) -> dict:
    """Both engines' sampling settings from the command line (SamplingParams' names; only those set)."""
    settings = dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p)
    return {k: v for k, v in settings.items() if v != {"top_p": 1.0, "top_k": 0, "min_p": 0.0}.get(k)}


def _memory(a, quick: bool) -> tuple[list[dict], dict, str]:
    rows = [memory.memory_row(a.model, str(a.model or "embedded SmolLM2-135M Q4_1"))]
    for spec in _specs(a.real_size):
        rows.append(memory.memory_row(_real_file(spec), spec))
    notes = (
        "Fresh process per model; runtime = resident memory after importing hydragen, loading the C++ ops "
        "and running a tiny one-layer model once; model = resident memory after loading the model (weights "
        "only, no KV cache) and running it once, minus the runtime. Peak during load: in another fresh "
        "process that loads the model alone, its VmHWM after the load (the file's mapped pages included); "
        "peak / file counts it over 'imported', the resident memory after importing hydragen and loading "
        "the C++ ops."
    )
    return rows, {}, notes


def _real(a, quick: bool) -> tuple[list[dict], dict, str]:
    points = ((1, 256), (16, 256))
    new_tokens = 4 if quick else a.real_tokens
    rows = []
    sampling, engines, specs = _sampling(a), a.engines or REAL_MODES, _specs(a.real_size)
    peer_notes = []
    for spec in specs:
        rounds = 1 if quick else a.rounds
        skipped: dict[str, str] = {}
        spec_rows = decode_rows(_real_file(spec), points, new_tokens, rounds, engines, sampling, skipped)
        rows += [{"model": spec, **row} for row in spec_rows]
        if spec_rows:
            peer_notes.append(_skipped_peer(_real_file(spec), spec_rows, skipped))
    notes = (
        "Random-weights GGUFs (model/gguf_write.py: llama-quantize's type mix), the same file for both "
        f"engines; one 256-token prompt, n completions, as the decode table; {sampling_words(sampling)}."
    )
    notes += "".join(dict.fromkeys(peer_notes))  # once for every model it did not run on for one reason
    extra = {"points": points, "new_tokens": new_tokens, "engines": _engines_run(rows)}
    return rows, {**extra, "sampling": sampling}, notes


REAL_MODES = ("hydragen", "hydragen-kv32", "hydragen-int8", "llamacpp")
# part -> (measure, table title, columns or None for every column of the first row)
MEASURES = {
    "kernels": (_kernels, "Kernels: every format at M activation rows", kernels.KERNEL_COLUMNS),
    "accuracy": (
        _accuracy,
        "Accuracy: computing in the file's format against its float32 dequantization",
        None,
    ),
    "decode": (_decode, "Decode side by side, same GGUF, one run", DECODE_COLUMNS),
    "memory": (_memory, "Resident memory after load, and the peak while loading", None),
    "real": (_real, "A model of real size (random weights), side by side", ["model", *DECODE_COLUMNS]),
}


def run(a: argparse.Namespace) -> dict:
    """Measure ``a.parts`` (each its own quant-PART.json/.md in ``a.out``), then rebuild quant.json/.md and
    the plots from every part's results in ``a.out`` of the same kind (quick or not): parts can be measured
    in separate runs, each under its own lock."""
    if a.quick:
        say_quick("quant")
    for part in a.parts:
        measure, title, columns = MEASURES[part]
        say(f"part {part}")
        rows, extra, notes = measure(a, a.quick)
        params = dict(model=str(a.model or "embedded SmolLM2-135M"), real_size=a.real_size, **extra)
        write_table(rows, columns or list(rows[0]), a.out, f"{RESULT_NAME}-{part}", title, notes,
                    quick=a.quick, params=params)  # fmt: skip
    data = combine(a.out, a.quick)
    print((a.out / f"{RESULT_NAME}.md").read_text())
    return data


def combine(out: Path, quick: bool) -> dict:
    """quant.json ({part: rows}, and per part its machine, commit and parameters), quant.md and the plots
    from the quant-PART.json files in ``out`` whose quick flag is ``quick``."""
    data: dict = {"machine": machine_description(), "commit": code_commit(), "quick": quick, "runs": {}}
    md = []
    for part in PARTS:
        path = out / f"{RESULT_NAME}-{part}.json"
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        if saved.get("quick", False) != quick:
            continue
        data[part] = saved.pop("rows")
        data["runs"][part] = saved
        md.append((out / f"{RESULT_NAME}-{part}.md").read_text())
    (out / f"{RESULT_NAME}.json").write_text(json.dumps(data, indent=2))
    (out / f"{RESULT_NAME}.md").write_text("\n".join(md))
    plots(data, out)
    return data


def _specs(real_size: str | None) -> list[str]:
    return [x.strip() for x in (real_size or "").split(",") if x.strip()]


def _real_file(spec: str) -> Path:
    from hydragen.model.gguf_write import random_gguf_file

    return random_gguf_file(spec)


def _points(text: str) -> tuple[tuple, ...]:
    """'1:512,8:512:distinct' -> ((1, 512), (8, 512, True)); anything else is an argparse error naming the
    bad item."""
    out = []
    for item in text.split(","):
        n, _, rest = item.strip().partition(":")
        prompt, _, kind = rest.partition(":")
        counts = n.isdigit() and prompt.isdigit() and int(n) > 0 and int(prompt) > 0
        if not counts or kind not in ("", "distinct"):
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not COMPLETIONS:PROMPT_TOKENS[:distinct], e.g. 1:512 or 8:512:distinct"
            )
        out.append((int(n), int(prompt), True) if kind else (int(n), int(prompt)))
    return tuple(out)


def _engines(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in MODES]
    if bad or not names:
        name = bad[0] if bad else text
        raise argparse.ArgumentTypeError(f"unknown engine {name!r}; choose from {', '.join(MODES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--parts", default=None, help=f"comma-separated, of {', '.join(PARTS)} (default: all; "
                   "'real' only with --real-size)")  # fmt: skip
    p.add_argument(
        "--real-size",
        default=None,
        metavar="PRESET:SCHEME",
        help="random GGUFs of real shapes, comma-separated, e.g. llama-3.2-1b:Q4_K_M,llama-3.1-8b:Q4_K_M "
        "(written once to the cache): their memory, and decode at n = 1 and 16 (part 'real')",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="T, tokens per completion (default 64)")
    p.add_argument("--real-tokens", type=int, default=32, help="T for the real-size model (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds, best kept (default 2)")
    p.add_argument(
        "--points",
        type=_points,
        default=None,
        metavar="N:PROMPT,...",
        help="decode points, completions:prompt tokens, ':distinct' for that many distinct prompts of one "
        "completion each (default 1:512,8:512,64:2048,8:512:distinct)",
    )
    p.add_argument(
        "--engines",
        type=_engines,
        default=None,
        help=f"engines of the decode and real parts, comma-separated, of {', '.join(MODES)} (default: all; "
        f"the real part: {', '.join(REAL_MODES)})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=SAMPLING["temperature"],
        help="both engines' temperature (default 0.8; 0: greedy), decode and real parts",
    )
    p.add_argument("--top-p", type=float, default=SAMPLING["top_p"], help="their top_p (default 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="their top_k (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="their min_p (default 0: off)")
    p.add_argument("--prompts", type=int, default=128, help="accuracy prompts (default 128)")
    p.add_argument("--kernel-shape", type=int, nargs=2, default=(4096, 4096), metavar=("N", "K"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    if a.parts is None:
        a.parts = [x for x in PARTS if x != "real" or a.real_size]
    else:
        a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    if "real" in a.parts and not a.real_size:
        p.error("the part 'real' needs --real-size PRESET:SCHEME")
    if a.quick:
        a.kernel_shape = (256, 512)
    a.out.mkdir(parents=True, exist_ok=True)
    run(a)


if __name__ == "__main__":
    main()
