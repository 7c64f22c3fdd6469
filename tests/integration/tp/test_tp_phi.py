"""Tensor parallelism on the Phi-3 family (fused q/k/v and gate/up read as their parts by each rank,
LongRoPE, Phi-4-mini's partial rotary): two spawned ranks give one process's greedy tokens, which are
transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydragen import LLM, SamplingParams
from hydragen.native import quant
from tests.unit.engine.test_engine_tiny import PROMPTS, T, hf_greedy

GREEDY = SamplingParams(n=2, temperature=0, max_tokens=T, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_phi4_mini_on_two_ranks_gives_transformers_tokens(tiny_models) -> None:
    """4 heads and 2 KV heads: two heads and one KV head a rank, 64 MLP columns of gate and of up each."""
    path = tiny_models["phi4_mini"]
    want = [t for t in hf_greedy(path, PROMPTS, T) for _ in range(2)]
    with LLM(path, kv_cache_tokens=4096, tensor_parallel_size=2) as two:
        assert two.parallel.shard.heads == 2 and two.parallel.shard.kv_heads == 1
        assert _tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


@pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")
def test_a_quantized_phi3_gguf_on_two_ranks_gives_one_ranks_tokens(tiny_models, tmp_path) -> None:
    """The GGUF in llama.cpp's layout (Q8_0 attn_qkv, F16 fused ffn_up): each rank's slices of the fused
    tensors stay in their blocks."""
    from tests.unit.model.test_phi3 import _types, write_phi3_gguf

    path = write_phi3_gguf(Path(tiny_models["phi3"]), tmp_path / "phi3.gguf", _types(2))
    one = _tokens(LLM(path, kv_cache_tokens=4096).generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(path, kv_cache_tokens=4096, tensor_parallel_size=2) as two:
        assert _tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False)) == one
