"""``hydragen bench quant``: GGUF weights computed in their own format, measured.

Five parts, each a table (Markdown + JSON) and where it helps a plot:
* ``kernels``: every format at M = 1, 8, 64, 512 against the measured memory bandwidth and float32 GEMM
  rate, beside torch's candidates (bench/quant_kernels.py);
* ``accuracy``: hydragen (15-bit and int8 activations) and llama.cpp against the float32-dequantized model
  over 128 chat prompts (bench/quant_accuracy.py);
* ``decode``: side by side in one run on the same GGUF, decode tokens/s at n = 1 and 8 (one 512-token
  prompt) and 64 (one shared 2,048-token prompt): hydragen as it runs, hydragen on the dequantized float32
  weights (what it ran before), llama.cpp (its ``batched`` example's scheme: bench/llamacpp_peer.py);
* ``memory``: resident memory after load against the file's size, in a fresh process per model; the fixed
  runtime (Python, torch, the ops, a tiny model) measured first and subtracted;
* ``real``: a random-weights GGUF of a real shape (``--real-size llama-3.1-8b:Q4_K_M``, written once to
  hydragen's cache, never into the repository): its memory and decode at n = 1 and 16 against llama.cpp.

hydragen samples at temperature 0.8, top_p 0.95; llama.cpp picks greedily from its logits (its sampling is
not what is measured). Decode-only rate: n (T - 1) / (t(T) - t(1)); rounds alternate the engines and each
point keeps its best round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hydragen.bench import quant_accuracy, quant_kernels
from hydragen.bench.common import code_commit, machine_description, matmul_rate, say_quick, write_table
from hydragen.bench.plots import Panel, plot, plot_lines

RESULT_NAME = "quant"
PARTS = ("kernels", "accuracy", "decode", "memory")
# (n, prompt tokens, one shared prompt): the three points
DECODE_POINTS = ((1, 512), (8, 512), (64, 2048))
MODES = ("hydragen", "hydragen-fp32", "llamacpp")
MODE_LABELS = {
    "hydragen": "hydragen (GGUF kept quantized)",
    "hydragen-fp32": "hydragen, dequantized to float32 (before)",
    "llamacpp": "llama.cpp",
}


def _say(message: str) -> None:
    print(f"[quant] {message}", file=sys.stderr, flush=True)


# ---- decode, side by side ---------------------------------------------------------------------------
def _engine(model, mode: str, kv_tokens: int):
    from hydragen import LLM

    return LLM(model, dequantize=mode == "hydragen-fp32", kv_cache_tokens=kv_tokens)


def decode_rows(model, points, new_tokens: int, rounds: int, modes=MODES) -> list[dict]:
    """Decode tok/s per (mode, n, prompt), the best of ``rounds`` alternating rounds."""
    from hydragen.bench import e2e, llamacpp_peer
    from hydragen.model.loader import resolve_model_path

    e2e.ENGINE_SAMPLING.update(temperature=0.8, top_p=0.95)
    path = resolve_model_path(model) if not isinstance(model, Path) else model
    vocab = None
    runners = {}
    for mode in modes:
        if mode == "llamacpp":
            why = llamacpp_peer.unavailable(path, False)
            if why:
                _say(f"llama.cpp skipped: {why}")
                continue
            runners[mode] = (
                llamacpp_peer.Peer(path, max(p for _, p in points), new_tokens, max(n for n, _ in points)),
                llamacpp_peer.timer,
            )
        else:
            kv = max(p + n * new_tokens for n, p in points) + 64 * new_tokens
            llm = _engine(path, mode, kv)
            vocab = llm.config.vocab_size
            runners[mode] = (llm, e2e.time_engine)
    best: dict[tuple[str, int, int], tuple[float, float]] = {}
    for r in range(rounds):
        for mode, (runner, timer) in runners.items():
            for n, p in points:
                prompt = e2e.synthetic_prompt(vocab, p)
                t1, tt = timer(runner, prompt, n, 1), timer(runner, prompt, n, new_tokens)
                key = (mode, n, p)
                old = best.get(key, (float("inf"), float("inf")))
                best[key] = (min(old[0], t1), min(old[1], tt))
                _say(
                    f"round {r + 1}: {mode:13s} n={n:3d} P={p}: "
                    f"decode {e2e.decode_rate(n, new_tokens, t1, tt):7.1f} tok/s"
                )
    rows = []
    for (mode, n, p), (t1, tt) in best.items():
        rows.append(
            {
                "engine": MODE_LABELS[mode],
                "mode": mode,
                "n": n,
                "prompt": p,
                "new_tokens": new_tokens,
                "decode tok/s": e2e.decode_rate(n, new_tokens, t1, tt),
                "t(1) s": t1,
                "t(T) s": tt,
            }
        )
    for row in rows:
        peer = next(
            (
                x
                for x in rows
                if x["mode"] == "llamacpp" and (x["n"], x["prompt"]) == (row["n"], row["prompt"])
            ),
            None,
        )
        row["vs llama.cpp"] = row["decode tok/s"] / peer["decode tok/s"] if peer else float("nan")
    return rows


# ---- memory -----------------------------------------------------------------------------------------
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_probe(model: str, runtime_model: str) -> dict:
    """In this (fresh) process: RSS with the runtime loaded (imports, ops, a tiny model run once), then RSS
    after loading ``model`` (no KV cache: ``load_model``)."""
    from hydragen.bench.quant_accuracy import plain_attention
    from hydragen.model.loader import load_model

    cpu = torch.device("cpu")

    def run_once(net):
        net.logits(net(torch.tensor([1, 2, 3]), torch.arange(3), plain_attention))

    tiny, _, _ = load_model(runtime_model, cpu, torch.float32)
    run_once(tiny)
    runtime = _rss_mb()
    t0 = time.perf_counter()
    net, _, path = load_model(model, cpu, torch.float32)
    load_s = time.perf_counter() - t0
    run_once(net)
    return {"runtime MB": runtime, "after load MB": _rss_mb(), "load s": load_s, "path": str(path)}


def memory_row(model, label: str) -> dict:
    from hydragen.model.config import ModelConfig
    from hydragen.model.gguf_write import random_maker, write_llama_gguf
    from hydragen.model.loader import resolve_model_path

    path = resolve_model_path(model)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = ModelConfig.from_hf(
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
                max_position_embeddings=256,
            )
        )
        runtime_model = write_llama_gguf(Path(tmp) / "runtime.gguf", tiny, "Q4_K_M", random_maker())
        probe = f"q.rss_probe({str(path)!r}, {str(runtime_model)!r})"
        code = f"import json, hydragen.bench.quant as q; print(json.dumps({probe}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    file_mb = path.stat().st_size / 2**20
    model_mb = probe["after load MB"] - probe["runtime MB"]
    return {
        "model": label,
        "file MB": file_mb,
        "runtime MB": probe["runtime MB"],
        "resident after load MB": probe["after load MB"],
        "model MB (resident - runtime)": model_mb,
        "model / file": model_mb / file_mb,
        "load s": probe["load s"],
    }


# ---- the run ----------------------------------------------------------------------------------------
def run(
    model=None,
    parts=PARTS,
    real_size: str | None = None,
    new_tokens: int = 64,
    rounds: int = 2,
    prompts: int = 128,
    kernel_shape: tuple[int, int] = (4096, 4096),
    out: Path = Path("bench-out"),
    quick: bool = False,
) -> dict:
    if quick:
        say_quick("quant")
    out.mkdir(parents=True, exist_ok=True)
    data: dict = {"machine": machine_description(), "commit": code_commit(), "quick": quick, "params": {}}
    data["params"] = dict(
        model=str(model or "embedded SmolLM2-135M"),
        parts=list(parts),
        real_size=real_size,
        new_tokens=new_tokens,
        rounds=rounds,
        prompts=prompts,
        kernel_shape=list(kernel_shape),
    )
    tables = []
    common = dict(quick=quick, params=data["params"])
    if "kernels" in parts:
        bw, gemm = quant_kernels.read_bandwidth(64 if quick else 512), matmul_rate(512 if quick else 2048)
        _say(f"read bandwidth {bw / 1e9:.1f} GB/s, float32 GEMM {gemm / 1e9:.0f} GFLOP/s")
        rows_m = (1, 8) if quick else quant_kernels.ROWS
        data["kernels"] = quant_kernels.kernel_table(*kernel_shape, rows_m, 2 if quick else 5, bw, gemm)
        data["bandwidth GB/s"], data["fp32 GEMM GFLOP/s"] = bw / 1e9, gemm / 1e9
        tables.append(
            write_table(
                data["kernels"],
                quant_kernels.KERNEL_COLUMNS,
                out,
                "quant-kernels",
                f"Kernels: {kernel_shape[0]} x {kernel_shape[1]} weights, read from memory (cycled copies)",
                f"Measured here: read bandwidth {bw / 1e9:.1f} GB/s (a sum over 512 MB, every thread), "
                f"float32 GEMM {gemm / 1e9:.0f} GFLOP/s (2,048^3). GB/s counts the weight bytes a call "
                "reads; GFLOP/s 2 M N K.",
                **common,
            )
        )
    if "accuracy" in parts:
        data["accuracy"] = quant_accuracy.run(model, 8 if quick else prompts, 8 if quick else 32, _say)
        tables.append(
            write_table(
                data["accuracy"],
                list(data["accuracy"][0]),
                out,
                "quant-accuracy",
                "Accuracy against the same file dequantized to float32",
                "KL(float32 || model) of the next-token distribution, teacher-forced on the float32 model's "
                "tokens.",
                **common,
            )
        )
    if "decode" in parts:
        points = ((1, 64), (4, 64)) if quick else DECODE_POINTS
        data["decode"] = decode_rows(model, points, 4 if quick else new_tokens, 1 if quick else rounds)
        tables.append(
            write_table(
                data["decode"],
                ["engine", "n", "prompt", "decode tok/s", "vs llama.cpp", "t(1) s", "t(T) s"],
                out,
                "quant-decode",
                "Decode side by side, same GGUF, one run",
                "n completions of one prompt (its KV shared by every engine); hydragen at temperature 0.8, "
                "top_p 0.95.",
                **common,
            )
        )
    if "memory" in parts:
        data["memory"] = [memory_row(model, str(model or "embedded SmolLM2-135M Q4_1"))]
        if real_size:
            data["memory"].append(memory_row(_real_file(real_size), real_size))
        tables.append(
            write_table(
                data["memory"],
                list(data["memory"][0]),
                out,
                "quant-memory",
                "Resident memory after load",
                "Fresh process per model; runtime = RSS after importing hydragen, loading the ops and "
                "running a tiny model once; model = RSS after loading the model (no KV cache) minus the "
                "runtime.",
                **common,
            )
        )
    if real_size:
        path = _real_file(real_size)
        data["real"] = decode_rows(
            path,
            ((1, 256), (16, 256)),
            4 if quick else 32,
            1 if quick else rounds,
            modes=("hydragen", "llamacpp"),
        )
        tables.append(
            write_table(
                data["real"],
                ["engine", "n", "prompt", "decode tok/s", "vs llama.cpp", "t(1) s", "t(T) s"],
                out,
                "quant-real",
                f"A model of real size: random {real_size}, side by side",
                "",
                **common,
            )
        )
    (out / f"{RESULT_NAME}.json").write_text(json.dumps(data, indent=2))
    plots(data, out)
    md = "\n".join(tables)
    (out / f"{RESULT_NAME}.md").write_text(md)
    print(md)
    return data


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
}


def _kernel_label(row: dict) -> str:
    return row["format"] if row["kernel"] == "hydragen" else row["kernel"]


def plots(data: dict, out: Path) -> list[Path]:
    paths = []
    quick = data.get("quick", False)
    if data.get("kernels"):
        for key, name, ylabel, ref in (
            ("GB/s", "quant_kernels_bandwidth.png", "weight bytes read, GB/s", "measured read bandwidth"),
            ("GFLOP/s", "quant_kernels_gflops.png", "GFLOP/s", "float32 GEMM rate"),
        ):
            level = data["bandwidth GB/s"] if key == "GB/s" else data["fp32 GEMM GFLOP/s"]
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
            xs, ys = series.setdefault(r["engine"], ([], []))
            xs.append(r["n"])
            ys.append(r["decode tok/s"])
        paths.append(
            plot_lines(series, out / "quant_decode.png", "Decode throughput, same GGUF, side by side",
                       "completions n (n = 1, 8: one 512-token prompt; 64: one shared 2,048-token prompt)",
                       "decode tokens/s", logx=True, logy=True, quick=quick)
        )  # fmt: skip
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument(
        "--real-size",
        default=None,
        metavar="PRESET:SCHEME",
        help="also a random GGUF of a real shape, e.g. llama-3.1-8b:Q4_K_M (written once, ~5 GB)",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="T, tokens per completion (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds, best kept (default 2)")
    p.add_argument("--prompts", type=int, default=128, help="accuracy prompts (default 128)")
    p.add_argument("--kernel-shape", type=int, nargs=2, default=(4096, 4096), metavar=("N", "K"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    shape = (256, 512) if a.quick else tuple(a.kernel_shape)
    run(a.model, parts, a.real_size, a.new_tokens, a.rounds, a.prompts, shape, a.out, a.quick)


if __name__ == "__main__":
    main()
