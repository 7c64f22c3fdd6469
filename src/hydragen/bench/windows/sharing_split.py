"""Where prefix sharing's decode speedup comes from on a model with windowed and full layers (Gemma 3): the
engine's decode steps of n completions of one P-token prompt, sharing on and off, with each layer's
attention call timed by kind (windowed or full).

Gemma 3 1B has 22 windowed layers (512 keys) and 4 full ones (all P keys). With sharing, a step reads the
shared prompt's keys once per layer for all n queries; without, once per sequence. The full layers read P
keys a sequence, the windowed ones W, so at P = 2,048 a full layer reads 4x a windowed one's keys, and the
4 full layers read 8,192 keys a sequence where the 22 windowed read 11,264: the two kinds' shares of the
saving are measured here, not assumed.

Only the model's forward is timed (the per-op path: Gemma does not run the one-call layer stack, so each
layer's attention is its own call); a decode step is a forward of exactly n rows. The attention time of a
kind is the sum over its layers, per step; ``rest`` is the forward's other work (projections, norms, the
KV writes inside the attention callback are counted as attention).

Usage:
  PYTHONPATH=src python -m hydragen.bench.windows.sharing_split --model GGUF [--n 64] [--prompt 2048]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hydragen.bench.core.common import write_table
from hydragen.bench.e2e.decode_throughput import synthetic_prompt

RESULT_NAME = "sharing_split"


def measure(model: str, n: int, prompt_len: int, tokens: int, sharing: bool) -> dict:
    """Per decode step, ms: the forward, the windowed layers' attention, the full layers' attention."""
    from hydragen import LLM, SamplingParams

    kv_tokens = n * (prompt_len + tokens + 2) + prompt_len + 64  # as the e2e benchmark sizes it
    llm = LLM(model, prefix_sharing=sharing, kv_cache_tokens=kv_tokens)
    net = llm.engine.runner.model
    specs = net.cfg.layer_specs
    windowed = [bool(specs) and specs[i].window is not None for i in range(net.cfg.num_layers)]
    sums = {"forward": 0.0, "windowed": 0.0, "full": 0.0, "steps": 0}
    plain = net.forward

    def forward(input_ids, positions, attention, layers=None, final_norm=True):
        if input_ids.shape[0] != n:  # prefill, or a step that is not all n sequences decoding
            return plain(input_ids, positions, attention, layers=layers, final_norm=final_norm)

        def timed(layer, q, k, v):
            t0 = time.perf_counter()
            out = attention(layer, q, k, v)
            sums["windowed" if windowed[layer] else "full"] += time.perf_counter() - t0
            return out

        t0 = time.perf_counter()
        out = plain(input_ids, positions, timed, layers=layers, final_norm=final_norm)
        sums["forward"] += time.perf_counter() - t0
        sums["steps"] += 1
        return out

    net.forward = forward
    prompt = synthetic_prompt(net.cfg.vocab_size, prompt_len)
    params = SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, seed=0, temperature=0.8, top_p=0.95)
    llm.generate([prompt[:32]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    for k in ("forward", "windowed", "full", "steps"):
        sums[k] = 0
    llm.generate([prompt], params, use_tqdm=False)
    steps = max(1, sums["steps"])
    row = {k: 1e3 * sums[k] / steps for k in ("forward", "windowed", "full")}
    row["rest"] = row["forward"] - row["windowed"] - row["full"]
    row["steps"] = sums["steps"]
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF or model directory with windowed and full layers")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16, help="tokens per completion (decode steps timed)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for sharing in (False, True):
        row = measure(a.model, a.n, a.prompt, a.tokens, sharing)
        rows.append({"sharing": "on" if sharing else "off", **row})
        print(f"[split] sharing {'on' if sharing else 'off'}: {row}", flush=True)
    off, on = rows
    saved = {k: off[k] - on[k] for k in ("forward", "windowed", "full", "rest")}
    for r in rows:
        r["speedup (forward)"] = off["forward"] / r["forward"]
    total = saved["windowed"] + saved["full"]
    notes = (
        f"{Path(a.model).name}: n = {a.n} completions of one {a.prompt}-token prompt, {a.tokens} tokens "
        "each; "
        "ms per decode step (forwards of exactly n rows), each kind's attention summed over its layers. "
        f"Sharing saves {saved['forward']:.1f} ms a step: {saved['full']:.1f} ms in the full layers' "
        "attention "
        f"({saved['full'] / total:.0%} of the attention saving), {saved['windowed']:.1f} ms in the windowed "
        f"layers' ({saved['windowed'] / total:.0%}), {saved['rest']:.1f} ms elsewhere."
    )
    cols = ["sharing", "forward", "windowed", "full", "rest", "steps", "speedup (forward)"]
    write_table(rows, cols, a.out, RESULT_NAME, "Sharing's decode saving by layer kind", notes)
    print(notes)


if __name__ == "__main__":
    main()
