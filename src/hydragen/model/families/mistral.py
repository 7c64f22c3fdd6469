"""Mistral 7B and its kin saved as ``MistralForCausalLM``: Llama's layer, with a sliding window over the
last ``sliding_window`` tokens in every layer when the config turns it on (Mistral 7B v0.1: 4,096 over a
32,768 context; later versions set none). Every layer attends exactly through the window, over the whole
context (``sliding_everywhere``). llama.cpp writes Mistral GGUFs as ``llama``; a ``llama`` GGUF that declares
``llama.attention.sliding_window`` gets the same (families/llama.py)."""

from __future__ import annotations

from typing import Any

from hydragen.model.family import Family, sliding_everywhere


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    if not hf.get("use_sliding_window", True):
        return {}
    return sliding_everywhere(hf, hf.get("sliding_window"))


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    gguf_architecture=None,  # llama.cpp converts Mistral to its "llama" architecture
    gguf_family="llama",  # and so does the writer
    fused_stack=True,
    config=_config,
)
