"""End-to-end decoding, the Hydragen paper's synthetic setting: one prompt of P tokens, n completions of
T tokens. Decode-only throughput follows the paper: n * (T - 1) / (time(T tokens) - time(1 token)).

Modes: hydragen (prefix sharing), nosharing (every sequence its own KV copy), noattn (attention skipped:
the ceiling), hf (transformers generate with num_return_sequences, if installed).
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

from hydragen.bench.common import machine_description, matmul_rate, write_table

MODES = ("hydragen", "nosharing", "noattn", "hf")


def synthetic_prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]


def _engine_llm(model, mode: str, kv_tokens: int):
    from hydragen import LLM

    return LLM(
        model,
        prefix_sharing=mode != "nosharing",
        attention="none" if mode == "noattn" else "auto",
        kv_cache_tokens=kv_tokens,
    )


def time_engine(llm, prompt: list[int], n: int, tokens: int) -> float:
    from hydragen import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(c.token_ids) == tokens for c in outs[0].outputs)
    return elapsed


def time_hf(hf, prompt: list[int], n: int, tokens: int) -> float:
    ids = torch.tensor([prompt])
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
    return time.perf_counter() - t0


def step_floor_seconds(cfg, n: int, prompt_len: int, rate: float) -> float:
    """Arithmetic floor of one decode step: model FLOPs + attention over the shared prompt once."""
    c = cfg
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # qkv
    per_layer += c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + lm_head
    attn = 4 * n * c.num_heads * prompt_len * c.head_dim * c.num_layers
    return (2 * params * n + attn) / rate


def run(model, prompt_len: int, ns: list[int], new_tokens: int, modes: list[str], out: Path) -> list[dict]:
    rate = matmul_rate()
    print(f"[e2e] {machine_description()}; matmul {rate / 1e9:.1f} GFLOP/s", file=sys.stderr)
    rows: list[dict] = []
    cfg = None
    for mode in modes:
        if mode == "hf":
            if importlib.util.find_spec("transformers") is None:
                print("[e2e] transformers not installed: skipping hf", file=sys.stderr)
                continue
            runner = _hf_model(model)
            timer = time_hf
        else:
            longest = max(prompt_len, 64)  # the warm-up prompt is 64 tokens
            kv = max(*ns, 2) * (longest + new_tokens + 2) + longest + 64
            runner = _engine_llm(model, mode, kv)
            cfg = runner.config
            timer = time_engine
            timer(runner, synthetic_prompt(cfg.vocab_size, 64), 2, 2)  # warm-up
        vocab = cfg.vocab_size if cfg is not None else runner.config.vocab_size
        prompt = synthetic_prompt(vocab, prompt_len)
        for n in ns:
            t1 = timer(runner, prompt, n, 1)
            tt = timer(runner, prompt, n, new_tokens)
            decode_tps = n * (new_tokens - 1) / max(tt - t1, 1e-9)
            row = dict(
                mode=mode,
                n=n,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                time_1=t1,
                time_T=tt,
                decode_tok_s=decode_tps,
                e2e_tok_s=n * new_tokens / tt,
            )
            if cfg is not None:
                floor = step_floor_seconds(cfg, n, prompt_len, rate)
                row["step_ms"] = 1e3 * (tt - t1) / (new_tokens - 1)
                row["floor_step_ms"] = 1e3 * floor
            rows.append(row)
            print(
                f"[e2e] {mode:9s} n={n:4d} P={prompt_len}: decode {decode_tps:8.1f} tok/s, "
                f"end-to-end {tt:7.2f} s",
                file=sys.stderr,
            )
        del runner
        gc.collect()
    cols = [
        "mode",
        "n",
        "prompt_len",
        "new_tokens",
        "decode_tok_s",
        "time_T",
        "time_1",
        "step_ms",
        "floor_step_ms",
    ]
    md = write_table(
        rows,
        cols,
        out,
        "e2e",
        f"End-to-end decoding (P={prompt_len}, T={new_tokens})",
        f"matmul rate {rate / 1e9:.1f} GFLOP/s (fp32, 2048^3)",
    )
    print(md)
    return rows


def _hf_model(model):
    from transformers import AutoModelForCausalLM

    from hydragen.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog=f"hydragen bench {__name__.rsplit('.', 1)[-1]}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--n", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--modes", default="hydragen,nosharing,noattn,hf")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    run(a.model, a.prompt_len, a.n, a.new_tokens, a.modes.split(","), a.out)


if __name__ == "__main__":
    main()
