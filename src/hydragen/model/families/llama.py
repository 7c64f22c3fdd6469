"""Llama 1-3 (and every checkpoint saved as ``LlamaForCausalLM``: SmolLM, CodeLlama, DeepSeek-R1's Llama
distills): the plain decoder, RMSNorm before attention and before a SwiGLU MLP, full attention in every
layer. llama.cpp's converter permutes q/k rows for its GPT-J-style RoPE; the reader puts them back. A file
declaring ``llama.attention.sliding_window`` (Mistral 7B v0.1 written as ``llama``) attends through it in
every layer, not in full."""

from __future__ import annotations

from typing import Any

from hydragen.model.family import Family, ModelConfig, sliding_everywhere


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    return sliding_everywhere(hf, hf.get("sliding_window"))  # none in a Llama config; a GGUF may say one


def _gguf_config(meta, arch: str) -> dict[str, Any]:
    window = meta(f"{arch}.attention.sliding_window")
    return {"sliding_window": int(window)} if window else {}


def _gguf_metadata(cfg: ModelConfig) -> dict[str, Any]:
    # convert_hf_to_gguf.py's LlamaModel adds these to every architecture's keys
    return {"vocab_size": cfg.vocab_size, "rope.dimension_count": cfg.rotary_dims}


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    gguf_architecture="llama",
    gguf_permuted_qk=True,
    fused_stack=True,  # native/csrc/quant_layers.cpp computes exactly this layer
    config=_config,
    gguf_config=_gguf_config,
    gguf_metadata=_gguf_metadata,
    gguf_quant_70b=lambda layers, gqa: layers == 80 and gqa > 1,  # src/models/llama.cpp: 80 layers, KV groups
)
