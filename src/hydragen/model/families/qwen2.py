"""Qwen2 and Qwen2.5 (and DeepSeek-R1's Qwen distills): Llama's layer with biases on q, k and v.

The biases are added between the projection and the rotary, in the projection's epilogue
(``hq::QkvEpilogue``), which the fused C++ stack and the per-op path share."""

from __future__ import annotations

from typing import Any

from hydragen.model.family import Family


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True}  # Qwen2's q/k/v always carry biases (its config has no switch)


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_architecture="qwen2",
    fused_stack=True,
    config=_config,
    gguf_quant_70b=lambda layers, gqa: layers == 80,  # llama.cpp's src/models/qwen2.cpp
)
