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
  bench/peers/peer_process.py; a llama.cpp that crashes is reported in the table, and the run goes on);
* ``memory``: resident memory after load, and the peak while loading, against the file's size, in a fresh
  process per model; the fixed runtime (Python, torch, the ops, a tiny model) measured first and subtracted;
* ``real``: a random-weights GGUF of a real shape (``--real-size llama-3.1-8b:Q4_K_M``, written once to
  hydragen's cache, never into the repository): its memory and decode at n = 1 and 16 against llama.cpp.

Both engines sample from the same distribution, by default the issue's temperature 0.8, top_p 0.95
(``--temperature/--top-p/--top-k/--min-p``; temperature 0: greedy): hydragen with its sampler, llama.cpp with
its sampler chain per sequence, as its batched example does. Decode-only rate: n (T - 1) / (t(T) - t(1));
rounds alternate the engines, and each point's best rate takes its fastest t(1) and fastest t(T) over the
rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydragen.bench.core.common import code_commit, machine_description, matmul_rate, say_quick, write_table
from hydragen.bench.core.plots import Panel, plot, plot_lines
from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess, in_peer
from hydragen.bench.quant import accuracy, kernels, memory

RESULT_NAME = "quant"
PARTS = ("kernels", "accuracy", "decode", "memory", "real")
# (n, prompt tokens): n completions of one prompt, the three points; (n, prompt tokens, True): n
# distinct prompts, one completion each (what a server's separate users send: nothing shared)
DECODE_POINTS = ((1, 512), (8, 512), (64, 2048), (8, 512, True))
SAMPLING = dict(temperature=0.8, top_p=0.95)  # the settings, and what chat clients commonly send
MODES = (
    "hydragen",
    "hydragen-kv32",
    "hydragen-per-op",
    "hydragen-int8",
    "hydragen-fp32",
    "hydragen-4k",
    "llamacpp",
)
# Every hydragen engine but kv32 and fp32 has a float16 KV cache, the default for a GGUF kept quantized.
MODE_LABELS = {
    "hydragen": "hydragen (GGUF kept quantized)",
    "hydragen-kv32": "hydragen, float32 KV cache (--kv-cache-dtype float32)",
    "hydragen-per-op": "hydragen, per-op layers (HYDRAGEN_FUSED_LAYERS=0)",
    "hydragen-int8": "hydragen, int8 activations, llama.cpp's numerics (HYDRAGEN_QUANT_ACT_BITS=8)",
    "hydragen-fp32": "hydragen, dequantized to float32 (before)",
    "hydragen-4k": "hydragen, packed weights on 4 KiB pages (HYDRAGEN_HUGE_PAGES=0)",
    "llamacpp": "llama.cpp",
}


def _say(message: str) -> None:
    print(f"[quant] {message}", file=sys.stderr, flush=True)


# ---- decode, side by side ---------------------------------------------------------------------------
def _per_op(timer):
    """``timer`` with the layers run one op at a time from Python (model/layer_stack.py off): the path every
    model took before the one-call loop, timed in the same run."""

    def timed(*args) -> float:
        with accuracy.env_setting("HYDRAGEN_FUSED_LAYERS", "0"):
            return timer(*args)

    return timed


def _engine(model, mode: str, kv_tokens: int):
    from hydragen import LLM

    kv_dtype = "float32" if mode == "hydragen-kv32" else "auto"
    if mode == "hydragen-4k":  # the weights are packed at load: the setting matters only there
        with accuracy.env_setting("HYDRAGEN_HUGE_PAGES", "0"):
            return _engine(model, "hydragen", kv_tokens)
    if mode == "hydragen-int8":
        return accuracy.llm_with_act_bits(model, 8, kv_tokens, kv_cache_dtype=kv_dtype)
    return LLM(model, dequantize=mode == "hydragen-fp32", kv_cache_tokens=kv_tokens, kv_cache_dtype=kv_dtype)


def _point(point) -> tuple[int, int, bool]:
    """(n, prompt tokens, distinct): (n, p) is n completions of one p-token prompt; (n, p, True) n distinct
    p-token prompts, one completion each (a server's separate requests: nothing to share)."""
    n, p, *distinct = point
    return n, p, bool(distinct and distinct[0]) and n > 1


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gguf_sizes(path: Path) -> tuple[int, int] | None:
    """(weight elements, K and V elements one cached token stores) from a GGUF's header, read as the loader
    reads it, or None for a file it would refuse."""
    from hydragen.model.config import ModelConfig
    from hydragen.model.gguf import open_gguf_tensors

    try:
        config, tensors = open_gguf_tensors(path)
        return tensors.elements(), ModelConfig.from_hf(config).kv_bytes_per_token_per_elem
    except (KeyError, ValueError, TypeError):  # ModelFileError is a ValueError
        return None


def _check_memory(path: Path, modes, kv_tokens: int, peer_cells: int) -> None:
    """Every engine stays loaded for the alternating rounds: refuse up front, naming the way out, when their
    weights and KV caches would not fit in 90 % of the available memory (the real part's four engines of the
    8B Q4_K_M file need ~25 GiB), rather than swap or be killed. GGUF files only (the engines' own)."""
    available = _available_bytes()
    sizes = _gguf_sizes(path) if path.suffix == ".gguf" and path.is_file() else None
    if available is None or sizes is None:
        return
    from hydragen.bench.peers import llamacpp_peer

    elements, kv_per_token = sizes
    file_bytes = path.stat().st_size
    need = 0.0
    for mode in modes:
        if mode == "llamacpp":
            if llamacpp_peer.unavailable(path, False) is None:  # skipped otherwise
                need += file_bytes + peer_cells * kv_per_token * 2  # the mapped file, an f16 cache
            continue
        # resident weights: at most 1.06x the file measured, float32 ones 4 bytes a weight
        need += 4 * elements if mode == "hydragen-fp32" else 1.1 * file_bytes
        need += kv_tokens * kv_per_token * (4 if mode in ("hydragen-kv32", "hydragen-fp32") else 2)
    if need > 0.9 * available:
        raise SystemExit(
            f"hydragen bench quant: {len(modes)} engines of {path.name} ({file_bytes / 2**30:.1f} GiB) "
            f"stay loaded together and need about {need / 2**30:.1f} GiB with their KV caches, more than "
            f"90 % of the {available / 2**30:.1f} GiB available; pass fewer with --engines "
            "(e.g. --engines hydragen,llamacpp)"
        )


def decode_rows(
    model, points, new_tokens: int, rounds: int, modes=MODES, sampling=None, skipped: dict | None = None
) -> list[dict]:
    """Decode tok/s per (mode, point), the best of ``rounds`` alternating rounds; every engine samples with
    ``sampling`` (SamplingParams' names; default SAMPLING). llama.cpp runs in a process of its own: if it
    crashes, its rows are left out and the rounds go on. ``skipped`` gets why each asked-for peer did not
    run (not installed, or crashed)."""
    from hydragen.bench.e2e import decode_throughput
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.model.loader import resolve_model_path

    sampling = dict(SAMPLING if sampling is None else sampling)
    decode_throughput.ENGINE_SAMPLING.clear()
    decode_throughput.ENGINE_SAMPLING.update(sampling)
    path = resolve_model_path(model) if not isinstance(model, Path) else model
    points = [_point(pt) for pt in points]
    # KV tokens a point holds at its end: the shared prompt once, or each distinct prompt
    cells = max((n if distinct else 1) * p + n * new_tokens for n, p, distinct in points)
    _check_memory(path, modes, cells + 64 * new_tokens, cells + 64)
    vocab = None
    skipped = {} if skipped is None else skipped
    runners = {}  # mode -> (runner, timer for one prompt's n completions, timer for distinct prompts)

    def crashed(mode: str, e: PeerCrashed) -> None:
        skipped[mode] = str(e)
        _say(f"{e}; the run goes on without it")
        runners.pop(mode, None)

    for mode in modes:
        if mode == "llamacpp":
            why = llamacpp_peer.unavailable(path, False)
            if why:
                skipped[mode] = why
                _say(f"llama.cpp skipped: {why}")
                continue
            longest, most = max(p for _, p, _ in points), max(n for n, _, _ in points)
            try:
                peer = PeerProcess(
                    "llama.cpp",
                    llamacpp_peer.Peer,
                    path,
                    longest,
                    new_tokens,
                    most,
                    cells=cells + 64,
                    sampling=sampling,
                )
                vocab = vocab or peer.call(getattr, "vocab")
            except PeerCrashed as e:
                crashed(mode, e)
                continue
            runners[mode] = (peer, in_peer(llamacpp_peer.timer), in_peer(llamacpp_peer.timer_prompts))
        else:
            llm = _engine(path, mode, cells + 64 * new_tokens)
            vocab = llm.config.vocab_size
            timers = (decode_throughput.time_engine, decode_throughput.time_engine_prompts)
            runners[mode] = (llm, *(map(_per_op, timers) if mode == "hydragen-per-op" else timers))

    def run(runner, shared, distinct_timer, n: int, p: int, distinct: bool, tokens: int) -> float:
        if distinct:  # seeds 1..n: prompts that share no prefix (seed 0 is the shared points' prompt)
            prompts = [decode_throughput.synthetic_prompt(vocab, p, seed=1 + i) for i in range(n)]
            return distinct_timer(runner, prompts, tokens)
        return shared(runner, decode_throughput.synthetic_prompt(vocab, p), n, tokens)

    best: dict[tuple, tuple[float, float]] = {}
    per_round: dict[tuple, list[float]] = {}  # each round's rate, in round order
    for mode, (runner, *timers) in list(runners.items()):  # untimed: first touches, lazy set-up
        try:
            for point in points:
                run(runner, *timers, *point, 2)
        except PeerCrashed as e:
            crashed(mode, e)
    for r in range(rounds):
        for mode, (runner, *timers) in list(runners.items()):
            try:
                for n, p, distinct in points:
                    t1, tt = (run(runner, *timers, n, p, distinct, t) for t in (1, new_tokens))
                    key = (mode, n, p, distinct)
                    old = best.get(key, (float("inf"), float("inf")))
                    best[key] = (min(old[0], t1), min(old[1], tt))
                    per_round.setdefault(key, []).append(decode_throughput.decode_rate(n, new_tokens, t1, tt))
                    what = f"n={n:3d} P={p}" + (" distinct" if distinct else "")
                    _say(f"round {r + 1}: {mode:13s} {what}: decode {per_round[key][-1]:7.1f} tok/s")
            except PeerCrashed as e:
                crashed(mode, e)
    for runner, *_ in runners.values():
        if isinstance(runner, PeerProcess):
            runner.close()
    rows = []
    for (mode, n, p, distinct), (t1, tt) in best.items():
        if mode in skipped:  # crashed in a later round: none of its rounds are reported
            continue
        rows.append(
            {
                "engine": MODE_LABELS[mode],
                "mode": mode,
                "n": n,
                "prompts": n if distinct else 1,
                "prompt": p,
                "new_tokens": new_tokens,
                "decode tok/s": decode_throughput.decode_rate(n, new_tokens, t1, tt),
                "t(1) s": t1,
                "t(T) s": tt,
            }
        )
    for row in rows:
        peer = next((x for x in rows if x["mode"] == "llamacpp" and _key(x) == _key(row)), None)
        row["vs llama.cpp"] = row["decode tok/s"] / peer["decode tok/s"] if peer else float("nan")
        key, peer_key = (row["mode"], *_key(row)), ("llamacpp", *_key(row))
        row["vs llama.cpp, paired"] = paired_ratio(per_round.get(key, []), per_round.get(peer_key, []))
    return rows


def _key(row: dict) -> tuple[int, int, bool]:
    return row["n"], row["prompt"], row["prompts"] > 1


def paired_ratio(ours: list[float], peer: list[float]) -> float:
    """The median over rounds of the rate ratio within each round. The engines run back to back in a round,
    so a slow phase of the machine (this VM's speed drifts 20-30 % within minutes) slows both: the ratio of
    each engine's best round can pair a fast moment of one with a slow moment of the other."""
    ratios = sorted(a / b for a, b in zip(ours, peer, strict=False) if b > 0)
    if not ratios:
        return float("nan")
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


# ---- the run ----------------------------------------------------------------------------------------
DECODE_COLUMNS = [
    "engine", "n", "prompts", "prompt", "new_tokens", "decode tok/s", "vs llama.cpp", "vs llama.cpp, paired",
    "t(1) s", "t(T) s",
]  # fmt: skip


def _kernels(a, quick: bool) -> tuple[list[dict], dict, str]:
    bw, gemm = kernels.read_bandwidth(64 if quick else 512), matmul_rate(512 if quick else 2048)
    _say(f"read bandwidth {bw / 1e9:.1f} GB/s, float32 GEMM {gemm / 1e9:.0f} GFLOP/s")
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
    rows = accuracy.run(a.model, 8 if quick else a.prompts, tokens, _say, skipped)
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
        f"prompts of that length, one completion each; {_sampling_words(sampling)}. Decode-only "
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


def _settings(sampling: dict) -> str | None:
    """'temperature 0.8, top_p 0.95' for sampled settings, None for greedy ones."""
    if sampling.get("temperature", 1.0) == 0:
        return None
    return ", ".join(f"{k} {v:g}" for k, v in sampling.items())


def _sampling_words(sampling: dict) -> str:
    if (words := _settings(sampling)) is None:
        return "both engines pick greedily"
    return (f"both engines sample at {words} (llama.cpp through its sampler chain, one draw per sequence and "
            "step, as its batched example)")  # fmt: skip


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
        f"engines; one 256-token prompt, n completions, as the decode table; {_sampling_words(sampling)}."
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
        _say(f"part {part}")
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


KERNEL_PANELS = {
    "32-weight blocks": ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
    "256-weight K-quants": ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    "16-bit, and torch's candidates": (
        "F16",
        "BF16",
        "torch float32 (before)",
        "torch int4 op, bf16 activations",
        "torch bf16, bf16 activations",
    ),
    "15-bit (default) against int8 activations": tuple(
        f + w for f in ("Q4_1", "Q8_0", "Q4_K", "Q6_K") for w in ("", ", int8 activations")
    ),
}


def _kernel_label(row: dict) -> str:
    if row["kernel"].startswith("hydragen"):
        return row["format"] + row["kernel"].removeprefix("hydragen")
    return row["kernel"]


def plots(data: dict, out: Path) -> list[Path]:
    paths = []
    quick = data.get("quick", False)
    if data.get("kernels"):
        for key, name, ylabel, ref in (
            ("GB/s", "quant_kernels_bandwidth.png", "weight bytes read, GB/s", "measured read bandwidth"),
            ("GFLOP/s", "quant_kernels_gflops.png", "GFLOP/s", "float32 GEMM rate"),
        ):
            measured = data["runs"]["kernels"]["params"]
            level = measured["bandwidth GB/s"] if key == "GB/s" else measured["fp32 GEMM GFLOP/s"]
            panels = []
            for title, labels in KERNEL_PANELS.items():
                series: dict[str, tuple[list, list]] = {}
                for r in data["kernels"]:
                    if _kernel_label(r) in labels:
                        xs, ys = series.setdefault(_kernel_label(r), ([], []))
                        xs.append(r["M"])
                        ys.append(r[key])
                panels.append(Panel(series, title=title, hline=(level, ref)))
            paths.append(
                plot(
                    panels,
                    out / name,
                    "Quantized matmul by weight format (hydragen's kernels unless named)",
                    "activation rows M",
                    ylabel,
                    logx=True,
                    logy=True,
                    quick=quick,
                )
            )
    if data.get("decode"):
        series = {}
        for r in data["decode"]:
            if r.get("prompts", 1) > 1:  # distinct prompts: a point of their own, in the table only
                continue
            xs, ys = series.setdefault(r["engine"], ([], []))
            xs.append(r["n"])
            ys.append(r["decode tok/s"])
        title = f"Decode, same GGUF, side by side ({_plot_words(data['runs']['decode'])})"
        paths.append(
            plot_lines(series, out / "quant_decode.png", title, _points_label(data["decode"]),
                       "decode tokens/s", logx=True, logy=True, quick=quick)
        )  # fmt: skip
    if data.get("real"):
        series = {}
        for r in data["real"]:
            name = f"{r.get('model', data['runs']['real']['params'].get('real_size'))}: {r['engine']}"
            xs, ys = series.setdefault(name, ([], []))
            xs.append(r["n"])
            ys.append(r["decode tok/s"])
        title = f"Real-size random models ({_plot_words(data['runs']['real'])})"
        paths.append(
            plot_lines(series, out / "quant_real.png", title, "completions n of one 256-token prompt",
                       "decode tokens/s", logx=True, logy=True, quick=quick)
        )  # fmt: skip
    return paths


def _points_label(rows: list[dict]) -> str:
    """The decode plot's x label from the points it shows, e.g. 'completions n of one prompt (n = 1, 8: 512
    tokens; 64: 2,048)'."""
    by_prompt: dict[int, list[int]] = {}
    for r in rows:
        if r.get("prompts", 1) == 1 and r["n"] not in by_prompt.setdefault(r["prompt"], []):
            by_prompt[r["prompt"]].append(r["n"])
    parts = [f"{', '.join(map(str, sorted(ns)))}: {p:,} tokens" for p, ns in sorted(by_prompt.items())]
    return f"completions n of one prompt (n = {'; '.join(parts)})"


def _plot_words(run: dict) -> str:
    """The sampling a part's plot shows, for its title (results from before the peer sampled: greedy)."""
    sampling = run.get("params", {}).get("sampling")
    if sampling is None:
        return "llama.cpp greedy"
    words = _settings(sampling)
    return "both greedy" if words is None else f"both at {words}"


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
