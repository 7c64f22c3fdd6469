"""A 16-bit KV cache under float32 compute (``kv_cache_dtype``; a GGUF model kept quantized gets float16 by
default): half the bytes per cached token, the same tokens as the float32 cache on the embedded model, the
one-call layers still bit-identical to the per-op path, and the option refused where it cannot hold."""

from __future__ import annotations

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.cli.parser import build_parser
from hydragen.engine.config_flags import engine_config
from hydragen.model.loader import resolve_kv_dtype

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land of shared prefixes,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)


def run(llm: LLM, params: SamplingParams = GREEDY) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        for o in outs
        for c in o.outputs
    ]


def test_a_quantized_gguf_gets_a_float16_cache_with_a_float32_caches_tokens(embedded_llm, embedded_llm_kv32):
    """ "auto" caches a model kept in GGUF blocks in float16, as llama.cpp does: half the bytes per token, and
    the float32 cache's tokens. Measured: all 72 greedy tokens identical, log-probabilities within 0.003
    (bfloat16: the first divergence after 6 tokens, which is why float16 is the one this test holds to)."""
    assert embedded_llm.engine.pool.k.dtype == torch.float16
    assert embedded_llm_kv32.engine.pool.k.dtype == torch.float32
    assert embedded_llm.engine.pool.bytes_per_token * 2 == embedded_llm_kv32.engine.pool.bytes_per_token
    for (want, want_lp), (got, got_lp) in zip(run(embedded_llm_kv32), run(embedded_llm), strict=True):
        assert got == want
        assert max(abs(a - b) for a, b in zip(want_lp, got_lp, strict=True)) < 0.02


def test_auto_keeps_the_models_dtype_for_float_weights(embedded_llm_fp32, tiny_models):
    """The dequantized reference and a float checkpoint keep float32 K/V: "auto" only narrows the cache of a
    model computing from quantized blocks."""
    assert embedded_llm_fp32.engine.pool.k.dtype == torch.float32
    assert LLM(tiny_models["llama"], kv_cache_tokens=256).engine.pool.k.dtype == torch.float32
    assert resolve_kv_dtype("auto", torch.float32, quantized_weights=True) == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16, quantized_weights=True) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32, quantized_weights=True) == torch.float32


def test_one_call_layers_equal_the_per_op_path_with_a_float16_cache(embedded_llm, monkeypatch):
    fused = run(embedded_llm)
    monkeypatch.setenv("HYDRAGEN_FUSED_LAYERS", "0")
    embedded_llm.reset_prefix_cache()
    assert run(embedded_llm) == fused  # bit for bit: the same writes, rounding and reads


def test_the_kv_cache_dtype_is_checked_before_anything_loads():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="must be one of auto, float32, bfloat16, float16, got 'int8'"):
        LLM(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs float32 compute"):
        LLM(dtype="bfloat16", kv_cache_dtype="float16")
    for command in (["generate", "x"], ["serve"], ["chat"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "bfloat16"])
        assert args.kv_cache_dtype == "bfloat16"
        assert engine_config(build_parser().parse_args(command)).kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    ("flags", "kv_dtype", "bytes_per_elem"),
    [
        ([], "float16", 2),
        (["--dequantize"], "float32", 4),
        (["--kv-cache-dtype", "float32"], "float32", 4),
        (["--kv-cache-dtype", "bfloat16"], "bfloat16", 2),
    ],
)
def test_data_parallel_budgets_each_replica_for_the_cache_it_will_get(
    flags, kv_dtype, bytes_per_elem, monkeypatch
):
    """serve --data-parallel-size sizes the replicas' KV budget before any replica loads the model: from the
    GGUF header it resolves "auto" as a replica would (float16 for blocks kept quantized) and hands the
    replicas that dtype by name, so a replica's cache is the one its budget was sized for (a float32 cache
    would take twice the memory planned)."""
    import hydragen.llm as llm_module
    from hydragen.cli.common import engine_config_of
    from hydragen.dp import launch
    from hydragen.tp.checkpoint import read_config

    seen = []
    monkeypatch.setattr(llm_module, "default_kv_cache_tokens", lambda b, *a, **k: seen.append(b) or 1024)
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", *flags])
    engine = engine_config_of(args)
    config, _, _ = read_config(engine.model)
    kv_cache = launch.replica_kv_cache(engine, config, args.data_parallel_size)
    assert kv_cache == (1024, kv_dtype)
    replica = launch.replica_args(args, engine, 1, kv_cache, "info")
    assert replica.count("--kv-cache-dtype") == 1
    assert replica[replica.index("--kv-cache-dtype") + 1] == kv_dtype
    assert replica[replica.index("--kv-cache-tokens") + 1] == "1024"
    assert seen == [config.kv_bytes_per_token_per_elem * bytes_per_elem]
