"""The decode part of ``hydragen bench quant`` (and its real-size part): engines side by side on one GGUF,
each decoding n completions of a prompt (or n distinct prompts), in alternating rounds.

llama.cpp runs in a process of its own (bench/peers/): a crash leaves its rows out and the rounds go on.
Every engine stays loaded for the rounds, so engines that would not fit in memory together are refused
before anything loads.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess, in_peer
from hydragen.bench.quant import accuracy

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
DECODE_COLUMNS = [
    "engine", "n", "prompts", "prompt", "new_tokens", "decode tok/s", "vs llama.cpp", "vs llama.cpp, paired",
    "t(1) s", "t(T) s",
]  # fmt: skip


def say(message: str) -> None:
    print(f"[quant] {message}", file=sys.stderr, flush=True)


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
        say(f"{e}; the run goes on without it")
        runners.pop(mode, None)

    for mode in modes:
        if mode == "llamacpp":
            why = llamacpp_peer.unavailable(path, False)
            if why:
                skipped[mode] = why
                say(f"llama.cpp skipped: {why}")
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
                    say(f"round {r + 1}: {mode:13s} {what}: decode {per_round[key][-1]:7.1f} tok/s")
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
    ratios = [a / b for a, b in zip(ours, peer, strict=False) if b > 0]
    return statistics.median(ratios) if ratios else float("nan")


def sampled_settings(sampling: dict) -> str | None:
    """'temperature 0.8, top_p 0.95' for sampled settings, None for greedy ones."""
    if sampling.get("temperature", 1.0) == 0:
        return None
    return ", ".join(f"{k} {v:g}" for k, v in sampling.items())


def sampling_words(sampling: dict) -> str:
    if (words := sampled_settings(sampling)) is None:
        return "both engines pick greedily"
    return (f"both engines sample at {words} (llama.cpp through its sampler chain, one draw per sequence and "
            "step, as its batched example)")  # fmt: skip
