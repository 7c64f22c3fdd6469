"""Qwen3 (dense): Llama's layer with an RMSNorm over each head of q and of k before RoPE ("QK-norm"), an
explicit head size (``head_dim`` 128 whatever the hidden size), no biases.

Its thinking switch is the chat template's (``enable_thinking`` through ``chat_template_kwargs``, and the
``/think`` and ``/no_think`` soft switches in a user message, which the model itself obeys); the reply's
``<think>`` block is separated into ``reasoning_content``. The fused C++ stack computes QK-norm in the
projection's epilogue (``hq::QkvEpilogue``), the same function the per-op path calls.

In a GGUF (llama.cpp's ``qwen3``) the QK-norms are ``attn_q_norm``/``attn_k_norm``, float32 in every
quantization; q/k rows are not permuted, and llama-quantize has no Qwen3 shape it treats as 70B."""

from __future__ import annotations

from typing import Any

from hydragen.model.family import LLAMA_LAYER_TENSORS, Family


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise ValueError("Qwen3 with use_sliding_window is not supported (no released Qwen3 model uses it)")
    return {"qk_norm": True}


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_architecture="qwen3",
    layer_tensors={**LLAMA_LAYER_TENSORS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    gguf_layer_tensors={"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"},
    fused_stack=True,
    config=_config,
)
