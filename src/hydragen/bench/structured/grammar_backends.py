"""Measure the candidate grammar engines (llguidance, XGrammar) on this CPU with a model's tokenizer.

For every schema of :data:`hydragen.structured.schemas.SCHEMAS`: compile time (a cold compile, the
backend's cache cleared), then a random walk through the grammar (each step: compute the mask, draw
an allowed token at random, consume it) timing every mask; and whether the schema compiled at all
(coverage). ``python -m hydragen.bench.structured.grammar_backends [--model M] [--out DIR]``; the numbers
behind the backend choice in docs/structured_outputs.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from hydragen.bench.core.stats import percentile
from hydragen.structured.schemas import SCHEMAS


def _walk(fill, bits, consume, done, vocab: int, rng: random.Random, max_steps: int) -> list[float]:
    """Mask times (s) along one random walk of allowed tokens (``fill`` writes the bitmask ``bits``)."""
    times = []
    for _ in range(max_steps):
        if done():
            break
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        allowed = _unpack(bits[0], vocab).nonzero().flatten().tolist()
        if not allowed:
            break
        consume(rng.choice(allowed))
    return times


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).flatten()[:vocab].bool()


def measure_llguidance(hf_tokenizer, vocab: int, steps: int, seed: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        if matcher.is_error():
            out[name] = {"compiled": False, "error": matcher.get_error()[:200]}
            continue
        bits = lt.allocate_token_bitmask(1, vocab)
        fill = lambda m=matcher, b=bits: lt.fill_next_token_bitmask(m, b, 0)  # noqa: E731
        times = _walk(
            fill, bits, matcher.consume_token, matcher.is_stopped, vocab, random.Random(seed), steps
        )
        out[name] = {"compiled": True, "compile_s": compile_s, "mask_s": times}
    return out


def measure_xgrammar(hf_tokenizer, vocab: int, steps: int, seed: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as e:  # noqa: BLE001  an unsupported schema counts against coverage
            out[name] = {"compiled": False, "error": str(e)[:200]}
            continue
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(1, vocab)
        fill = lambda m=matcher, b=bits: m.fill_next_token_bitmask(b, 0)  # noqa: E731
        times = _walk(
            fill, bits, matcher.accept_token, matcher.is_terminated, vocab, random.Random(seed), steps
        )
        out[name] = {"compiled": True, "compile_s": compile_s, "mask_s": times}
    return out


def summarize(per_schema: dict) -> dict:
    ok = [r for r in per_schema.values() if r["compiled"]]
    masks = [t for r in ok for t in r["mask_s"]]
    compiles = [r["compile_s"] for r in ok]
    return {
        "schemas": len(per_schema),
        "compiled": len(ok),
        "failed": sorted(k for k, r in per_schema.items() if not r["compiled"]),
        "compile_ms_mean": 1e3 * statistics.fmean(compiles) if compiles else None,
        "compile_ms_max": 1e3 * max(compiles) if compiles else None,
        "mask_us_mean": 1e6 * statistics.fmean(masks) if masks else None,
        "mask_us_p99": 1e6 * percentile(masks, 99) if masks else None,
        "masks_timed": len(masks),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hydragen.bench.structured.grammar_backends")
    ap.add_argument("--model", default=None, help="model whose tokenizer is used (default: embedded)")
    ap.add_argument("--steps", type=int, default=200, help="most tokens per random walk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the per-backend summary JSON here")
    args = ap.parse_args(argv)
    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer

    path = Path(args.model) if args.model else default_model_path()
    hf = load_tokenizer(path)._tok
    vocab = len(hf)
    results = {}
    for name, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        per_schema = fn(hf, vocab, args.steps, args.seed)
        results[name] = summarize(per_schema)
        print(name, json.dumps(results[name]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grammar_backends.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
