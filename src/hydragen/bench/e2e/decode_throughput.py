"""End-to-end decoding, the Hydragen paper's synthetic setting: one prompt of P tokens, n completions of
T tokens each. Decode-only throughput follows the paper: n * (T - 1) / (time(T tokens) - time(1 token)),
so prefill is excluded; end-to-end wall time is reported as well.

Modes: hydragen (prefix sharing), nosharing (same engine, every sequence its own KV copy), noattn (the
engine with attention skipped: the ceiling), and peers when installed: hf (transformers generate with
num_return_sequences) and llamacpp (llama-cpp-python, the prompt evaluated once and its KV cells shared
by every sequence, as llama.cpp's batched example does; GGUF models only). Each peer runs in a process of its
own (bench/peers/peer_process.py), timing itself there: a peer that crashes is reported and the run goes on.

Two sweeps, as the paper's figures: throughput vs n at one prompt length (Figure 1) and throughput vs
prompt length at one n (Figure 4). ``--random-weights CONFIG`` measures any Llama shape (a preset such as
codellama-7b, or a config.json) without downloading weights.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

from hydragen.bench.core.common import machine_description, matmul_rate, publish, say_quick, touch_kv_pool
from hydragen.bench.core.plots import Missing, label, plot_lines
from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess, in_peer

RESULT_NAME = "e2e"  # e2e.json, e2e.md
MODES = ("hydragen", "nosharing", "noattn", "hf", "llamacpp")
ENGINE_MODES = ("hydragen", "nosharing", "noattn")


def synthetic_prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]


def _engine_llm(
    model, mode: str, kv_tokens: int, random_weights: bool, device: str, dtype: str, page_size: int = 16
):
    from hydragen import LLM

    return LLM(
        model,
        device=device,
        dtype=dtype,
        prefix_sharing=mode != "nosharing",
        attention="none" if mode == "noattn" else "auto",
        kv_cache_tokens=kv_tokens,
        random_weights=random_weights,
        page_size=page_size,
    )


# Sampling settings of hydragen's runs and llama.cpp's sampler chain (--temperature/--top-p/--top-k; the hf
# peer samples at its own defaults): real clients send top_p.
ENGINE_SAMPLING: dict = dict(temperature=1.0)


def time_engine(llm, prompt: list[int], n: int, tokens: int) -> float:
    return _time_generate(llm, [prompt], n, tokens)


def time_engine_prompts(llm, prompts: list[list[int]], tokens: int) -> float:
    """``time_engine`` for one completion of each of several prompts (a server's distinct requests)."""
    return _time_generate(llm, prompts, 1, tokens)


def _time_generate(llm, prompts: list[list[int]], n: int, tokens: int) -> float:
    """Seconds for n completions of ``tokens`` tokens of each prompt, from an empty prefix cache."""
    from hydragen import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, seed=0, **ENGINE_SAMPLING)
    _sync(llm.engine.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(llm.engine.device)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs) == n and all(len(c.token_ids) == tokens for c in o.outputs) for o in outs)
    return elapsed


def time_hf(hf, prompt: list[int], n: int, tokens: int) -> float:
    ids = torch.tensor([prompt], device=hf.device)
    _sync(hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            num_return_sequences=n,
            pad_token_id=0,
        )
    _sync(hf.device)
    return time.perf_counter() - t0


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_rate(n: int, new_tokens: int, t1: float, tt: float) -> float:
    """The paper's decode-only rate n (T - 1) / (t(T) - t(1)), or NaN when it is not measurable.

    It is a difference of two runs. When prefill dominates (peers that prefill every sequence; n = 1),
    run-to-run noise can swamp the decode part: below 5 % of the run, no rate is reported.
    """
    if tt - t1 <= 0.05 * tt:
        return float("nan")
    return n * (new_tokens - 1) / (tt - t1)


def step_floor_seconds(cfg, n: int, prompt_len: int, rate: float) -> float:
    """Arithmetic floor of one decode step: model FLOPs + attention over the shared prompt once."""
    c = cfg
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # qkv
    per_layer += c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + lm_head
    attn = 4 * n * c.num_heads * prompt_len * c.head_dim * c.num_layers
    return (2 * params * n + attn) / rate


def sweep_points(prompt_len: int, ns: list[int], p_sweep: list[int], p_sweep_n: int) -> list[tuple[int, int]]:
    """(P, n) points: the n sweep at prompt_len (Figure 1), then the P sweep at p_sweep_n (Figure 4)."""
    points = [(prompt_len, n) for n in ns]
    points += [(p, p_sweep_n) for p in p_sweep if (p, p_sweep_n) not in points]
    return points


def run(
    model=None,
    prompt_len: int = 2048,
    ns: list[int] = (1, 4, 16, 64),
    new_tokens: int = 32,
    modes: list[str] = ("hydragen", "nosharing", "noattn", "hf"),
    out: Path = Path("bench-out"),
    p_sweep: list[int] = (),
    p_sweep_n: int | None = None,
    peer_max_n: int = 4,
    random_weights: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    quick: bool = False,
    page_size: int = 16,
) -> list[dict]:
    """Run every mode over the sweep points; write e2e.{json,md} and the two plots under ``out``."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (decode-only time is time(T) - time(1))")
    ns = list(ns)
    p_sweep_n = p_sweep_n or max(ns)
    points = sweep_points(prompt_len, ns, list(p_sweep), p_sweep_n)
    if quick:
        say_quick("e2e")
    rate = matmul_rate(device=device)
    print(f"[e2e] {machine_description()}; matmul {rate / 1e9:.1f} GFLOP/s", file=sys.stderr)
    rows: list[dict] = []
    skipped: dict[str, str] = {}  # mode -> why it did not run
    cfg = None
    for mode in modes:
        try:
            runner, timer, vocab, why = _runner(
                mode, model, points, new_tokens, random_weights, device, dtype, peer_max_n, page_size
            )
        except PeerCrashed as e:
            runner, why = None, str(e)
            print(f"[e2e] {e}; the run goes on without it", file=sys.stderr)
        if runner is None:
            skipped[mode] = why
            continue
        if mode in ENGINE_MODES:
            cfg = runner.config
        for p, n in points:
            if mode in ("hf", "llamacpp") and n > peer_max_n:
                continue  # peers are slow here: measured up to --peer-max-n
            prompt = synthetic_prompt(vocab, p)
            try:
                t1 = timer(runner, prompt, n, 1)
                tt = timer(runner, prompt, n, new_tokens)
            except PeerCrashed as e:
                skipped[mode] = str(e)
                print(f"[e2e] {e}; the run goes on without it", file=sys.stderr)
                rows = [r for r in rows if r["mode"] != mode]  # none of its points are reported
                break
            decode_tps = decode_rate(n, new_tokens, t1, tt)
            if decode_tps != decode_tps:
                print(
                    f"[e2e] {mode} n={n} P={p}: decode time is within timing noise; rate not reported",
                    file=sys.stderr,
                )
            row = dict(
                mode=mode,
                n=n,
                prompt_len=p,
                new_tokens=new_tokens,
                time_1=t1,
                time_T=tt,
                decode_tok_s=decode_tps,
                e2e_tok_s=n * new_tokens / tt,
                # the same difference as the rate: noise when the rate is (never a negative step time)
                step_ms=1e3 * (tt - t1) / (new_tokens - 1) if decode_tps == decode_tps else float("nan"),
            )
            if cfg is not None:
                row["floor_step_ms"] = 1e3 * step_floor_seconds(cfg, n, p, rate)
            rows.append(row)
            print(
                f"[e2e] {mode:9s} n={n:4d} P={p:6d}: decode {decode_tps:8.1f} tok/s, end-to-end {tt:7.2f} s",
                file=sys.stderr,
            )
        if isinstance(runner, PeerProcess):
            runner.close()
        del runner
        gc.collect()
    for r in rows:  # ratios against the engine's own baselines at the same point
        same = {x["mode"]: x for x in rows if (x["prompt_len"], x["n"]) == (r["prompt_len"], r["n"])}
        if "nosharing" in same:
            r["vs_nosharing"] = r["decode_tok_s"] / same["nosharing"]["decode_tok_s"]
        if "noattn" in same:
            r["of_ceiling"] = r["decode_tok_s"] / same["noattn"]["decode_tok_s"]
    name = str(model or "embedded SmolLM2-135M")
    cols = ["mode", "n", "prompt_len", "new_tokens", "decode_tok_s", "vs_nosharing", "of_ceiling"]
    cols += ["time_T", "time_1", "step_ms", "floor_step_ms"]
    params = dict(
        model=name,
        random_weights=random_weights,
        prompt_len=prompt_len,
        ns=ns,
        p_sweep=list(p_sweep),
        p_sweep_n=p_sweep_n,
        new_tokens=new_tokens,
        peer_max_n=peer_max_n,
        skipped=skipped,
    )
    publish(
        rows,
        cols,
        out,
        RESULT_NAME,
        f"End-to-end decoding ({name}{', random weights' if random_weights else ''}, T={new_tokens})",
        f"device {device}, {dtype}; matmul rate {rate / 1e9:.1f} GFLOP/s; decode_tok_s = n(T-1)/(t_T - t_1); "
        "vs_nosharing and of_ceiling compare decode throughput with sharing off and with attention skipped.",
        quick=quick,
        quick_note=(
            "with a 64-token prompt and 4 new tokens a step is mostly fixed cost, and each rate rests on "
            "3 steps: ratios between modes (vs_nosharing below 1, of_ceiling above 1) are noise here; the "
            "full run decodes 64 tokens after a 2,048-token prompt."
        ),
        plots=plots,
        params=params,
    )
    return rows


def _runner(mode, model, points, new_tokens, random_weights, device, dtype, peer_max_n, page_size=16):
    """(runner, timer, vocab size, why not): runner None, with the reason, when a peer is not installed or
    does not apply."""

    def skip(why: str):
        print(f"[e2e] {mode}: {why}; skipped", file=sys.stderr)
        return None, None, 0, why

    if mode == "hf":
        if random_weights or importlib.util.find_spec("transformers") is None:
            return skip("needs transformers and real weights")
        hf = PeerProcess("transformers", _hf_model, model, device, dtype)
        return hf, in_peer(time_hf), hf.call(_vocab_size), ""
    if mode == "llamacpp":
        if device != "cpu":
            return skip("measured on CPU only")
        from hydragen.bench.peers import llamacpp_peer

        why = llamacpp_peer.unavailable(model, random_weights)
        if why:
            return skip(why)
        longest, most = max(p for p, _ in points), min(max(n for _, n in points), peer_max_n)
        peer = PeerProcess(
            "llama.cpp", llamacpp_peer.Peer, model, longest, new_tokens, most, sampling=ENGINE_SAMPLING
        )
        timer, vocab = in_peer(llamacpp_peer.timer), peer.call(getattr, "vocab")
        timer(peer, synthetic_prompt(vocab, 64), 2, 2)  # warm-up
        return peer, timer, vocab, ""
    longest = max(max(p for p, _ in points), 64)  # the warm-up prompt is 64 tokens
    kv = max(max(n for _, n in points), 2) * (longest + new_tokens + 2) + longest + 64
    llm = _engine_llm(model, mode, kv, random_weights, device, dtype, page_size)
    touch_kv_pool(llm)
    time_engine(llm, synthetic_prompt(llm.config.vocab_size, 64), 2, 2)  # warm-up
    return llm, time_engine, llm.config.vocab_size, ""


def _most_common(values: list[int]) -> int:
    return max(sorted(set(values)), key=values.count)


def plots(data: dict, out: Path) -> list[Path]:
    """Throughput vs n (the README's headline: how much faster is decoding with a shared prompt?) and
    throughput vs prompt length, from a run's saved results (its rows and parameters)."""
    rows, params, quick = data["rows"], data.get("params", {}), data.get("quick", False)
    # Older result files carry no parameters: the n sweep is the prompt length with the most n values.
    prompt_len = params.get("prompt_len") or _most_common([r["prompt_len"] for r in rows])
    sweep_n = params.get("p_sweep_n") or _most_common(
        [r["n"] for r in rows if r["prompt_len"] != prompt_len] or [0]
    )
    peers = [r["n"] for r in rows if r["mode"] in ("hf", "llamacpp")]
    peer_max = params.get("peer_max_n") or (max(peers) if peers else None)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    ns = sorted({r["n"] for r in rows if r["prompt_len"] == prompt_len})

    def curve(mode: str, key: str, fixed: str, value: int) -> tuple[list[int], list[float]]:
        pts = sorted((r[key], r["decode_tok_s"]) for r in rows if r["mode"] == mode and r[fixed] == value)
        return [x for x, _ in pts], [y for _, y in pts]

    series = {label(m): curve(m, "n", "prompt_len", prompt_len) for m in modes}
    missing = [
        Missing(label(m), n, f"peers were run up to n = {peer_max} only, to keep the run short")
        for m in modes
        for n in ns
        if n not in series[label(m)][0]
    ]
    skipped = params.get("skipped", {})
    footnote = "; ".join(f"{label(m)} not run: {why}" for m, why in skipped.items())
    by_n = {(r["mode"], r["n"]): r["decode_tok_s"] for r in rows if r["prompt_len"] == prompt_len}
    top = max(ns) if ns else 0
    on, off = by_n.get(("hydragen", top), float("nan")), by_n.get(("nosharing", top), float("nan"))
    title = f"Decode throughput vs number of completions (one {prompt_len:,}-token prompt)"
    notes = []
    if on == on and off == off and off > 0 and not quick:  # a quick run's ratio is noise: no claim
        ratio = on / off
        how = f"{ratio:.1f}x faster than" if ratio >= 1.05 else f"at {ratio:.2f}x the speed of"
        title = (
            f"One {prompt_len:,}-token prompt, n completions: sharing decodes {how} sharing off at n = {top}"
        )
        notes.append((top, off, on, f"{ratio:.1f}x"))
    paths = [
        plot_lines(
            series,
            out / "e2e_throughput_vs_n.png",
            title,
            "completions n (batch size)",
            "decode tokens/s, all completions together",
            logx=True,
            missing=missing,
            brackets=notes,
            quick=quick,
            footnote=footnote,
            ylim_zero=True,
        )
    ]
    series = {label(m): curve(m, "prompt_len", "n", sweep_n) for m in modes}
    series = {k: v for k, v in series.items() if len(v[0]) > 1}
    if series:
        paths.append(
            plot_lines(
                series,
                out / "e2e_throughput_vs_prompt.png",
                f"Decode throughput vs length of the shared prompt ({sweep_n} completions)",
                "prompt length (tokens)",
                "decode tokens/s, all completions together",
                logx=True,
                quick=quick,
                ylim_zero=True,
            )
        )
    return paths


def _vocab_size(hf) -> int:
    return hf.config.vocab_size


def _hf_model(model, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    from hydragen.model.loader import resolve_dtype, resolve_model_path

    path, dt = resolve_model_path(model), resolve_dtype(dtype)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dt)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    return hf.to(device).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--random-weights",
        metavar="CONFIG",
        default=None,
        help="a preset (smollm2-135m, codellama-7b, codellama-13b, codellama-34b), config.json or model "
        "directory: that shape with random weights",
    )
    p.add_argument("--prompt-len", type=int, default=2048, help="P of the n sweep (default 2048)")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64], help="completions to sweep")
    p.add_argument("--p-sweep", type=int, nargs="*", default=[256, 1024], help="prompt lengths to sweep")
    p.add_argument("--p-sweep-n", type=int, default=None, help="n of the P sweep (default: largest --n)")
    p.add_argument("--new-tokens", type=int, default=32, help="T, tokens per completion (default 32)")
    p.add_argument("--modes", default="hydragen,nosharing,noattn,hf,llamacpp")
    p.add_argument("--peer-max-n", type=int, default=4, help="largest n run for hf/llamacpp (default 4)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--temperature", type=float, default=1.0, help="hydragen's and llama.cpp's temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="their nucleus mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="their top-k (0 = off)")
    p.add_argument("--page-size", type=int, default=16, help="hydragen's KV page size in tokens (16)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    ENGINE_SAMPLING.clear()
    ENGINE_SAMPLING.update(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.random_weights and a.model:
        p.error("give either --model or --random-weights, not both")
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.quick:
        a.prompt_len, a.n, a.p_sweep, a.new_tokens = 64, [1, 4], [32], 4
    run(
        a.random_weights or a.model,
        a.prompt_len,
        a.n,
        a.new_tokens,
        a.modes.split(","),
        a.out,
        a.p_sweep,
        a.p_sweep_n,
        a.peer_max_n,
        random_weights=a.random_weights is not None,
        device=a.device,
        dtype=dtype,
        quick=a.quick,
        page_size=a.page_size,
    )


if __name__ == "__main__":
    main()
