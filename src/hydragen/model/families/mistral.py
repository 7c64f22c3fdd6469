"""Mistral 7B and its kin saved as ``MistralForCausalLM``: Llama's layer, with a sliding window over the
last ``sliding_window`` tokens in every layer when the config turns it on.

Until the kernels bound attention by a window, a windowed Mistral's context is capped at the window, which
keeps it exact. llama.cpp writes Mistral GGUFs as ``llama``."""

from __future__ import annotations

from typing import Any

from hydragen.model.family import Family


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True):
        return {"max_position_embeddings": min(int(hf.get("max_position_embeddings", 4096)), int(window))}
    return {}


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    gguf_architecture=None,  # llama.cpp converts Mistral to its "llama" architecture
    gguf_family="llama",  # and so does the writer
    fused_stack=True,
    config=_config,
)
