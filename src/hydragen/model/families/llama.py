"""Llama 1-3 (and every checkpoint saved as ``LlamaForCausalLM``: SmolLM, CodeLlama, DeepSeek-R1's Llama
distills): the plain decoder, RMSNorm before attention and before a SwiGLU MLP, full attention in every
layer. llama.cpp's converter permutes q/k rows for its GPT-J-style RoPE; the reader puts them back."""

from __future__ import annotations

from hydragen.model.family import Family

FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    gguf_architecture="llama",
    gguf_permuted_qk=True,
    fused_stack=True,  # native/csrc/quant_layers.cpp computes exactly this layer
)
