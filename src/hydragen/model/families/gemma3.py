"""Gemma 3 (text): Gemma 2's layer (``model/families/gemma2.py``: sandwich norms, GeGLU, scaled embeddings,
``query_pre_attn_scalar``) with QK-norm, no soft-caps, and five local layers to one global: local layers
attend through a sliding window and rotate by their own RoPE (``rope_local_base_freq``, 10,000, unscaled),
global layers by ``rope_theta`` with ``rope_scaling`` (linear, factor 8, on the 4B and larger).

Runs from a ``Gemma3ForCausalLM`` checkpoint (1B, or a text model saved alone) or llama.cpp's ``gemma3``
GGUF, which its converter also writes for the text part of ``Gemma3ForConditionalGeneration`` (the vision
tower goes to a separate mmproj file). The vision-language checkpoint itself, and an mmproj file, are
refused: hydragen runs text only.

The writer (``model/gguf_write.py``) lays it out as convert_hf_to_gguf.py's Gemma3Model does: Gemma 2's
tensors plus ``attn_q_norm``/``attn_k_norm`` (every norm stored as 1 + w), no ``output`` (tied); the
window (only when a layer has one: llama.cpp then runs no window at all), the local layers' RoPE base
(``rope.freq_base_swa``), the final soft-cap when there is one, the global layers' linear RoPE factor
(every architecture's ``rope.scaling.*``). The converter writes no pattern, so llama.cpp assumes five local
layers to one global; a model whose layers differ is written with a flag per layer, which llama.cpp reads.
What llama.cpp cannot hold is refused: a score scale it would not derive, a scaled local RoPE, a score
soft-cap (llama.cpp's gemma3 has none)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydragen.model.families.gemma2 import (
    FULL,
    GEMMA_GGUF_TENSORS,
    GEMMA_LAYER_TENSORS,
    GEMMA_ROLE_SHAPES,
    SLIDING,
    gemma_fields,
    gemma_gguf_metadata,
    gguf_gemma_fields,
)
from hydragen.model.family import Family
from hydragen.model.rope import parse_rope

VISION = (
    "Gemma3ForConditionalGeneration is Gemma 3 with its vision tower, which hydragen does not run: convert "
    "its text part (llama.cpp's convert_hf_to_gguf.py writes it as a gemma3 GGUF) or load a "
    "Gemma3ForCausalLM checkpoint"
)


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    fields = gemma_fields(hf, pattern=6, attn_cap=None, final_cap=None)
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # the new layout: one rope dict per layer type
        lengths = {k: v for k, v in hf.items() if k.endswith("max_position_embeddings")}  # for YaRN
        theta, scaling = parse_rope(params.get(FULL) or {}, {**lengths, "rope_theta": 1_000_000.0})
        local = params.get(SLIDING) or {}
        local_theta, local_scaling = parse_rope(local, {**lengths, "rope_theta": 10_000.0})
    else:  # the old: rope_theta and rope_scaling for global layers, rope_local_base_freq for local ones
        theta, scaling = parse_rope(params, {"rope_theta": 1_000_000.0, **hf})
        local_theta, local_scaling = float(hf.get("rope_local_base_freq", 10_000.0)), None
    return {
        **fields,
        "qk_norm": True,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "local_rope_theta": local_theta,
        "local_rope_scaling": local_scaling,
    }


def _gguf_config(meta: Callable[..., Any], arch: str) -> dict[str, Any]:
    final = meta(f"{arch}.final_logit_softcapping")
    return {
        **gguf_gemma_fields(meta, arch, big_layers=62, pattern=6),
        "sliding_window": int(meta(f"{arch}.attention.sliding_window", 0)) or None,  # none: no window
        "rope_local_base_freq": float(meta(f"{arch}.rope.freq_base_swa", 10_000.0)),
        "final_logit_softcapping": float(final) if final else None,
    }


def _gguf_metadata(cfg: Any) -> dict[str, Any]:
    """convert_hf_to_gguf.py's Gemma3Model keys beyond every architecture's (``gemma_gguf_metadata``'s window
    and pattern, the local RoPE base, the final soft-cap)."""
    if any(s.soft_cap for s in cfg.layer_specs):
        raise ValueError("llama.cpp's gemma3 has no attention soft-cap: a Gemma 3 with one cannot be written")
    if cfg.local_rope_scaling is not None:
        raise ValueError(
            "llama.cpp's gemma3 rotates its local layers unscaled: local rope scaling cannot be written"
        )
    out = gemma_gguf_metadata(cfg, big_layers=62, pattern=6)
    if cfg.local_rope_theta is not None:
        out["rope.freq_base_swa"] = float(cfg.local_rope_theta)
    if cfg.final_logit_softcap:
        out["final_logit_softcapping"] = float(cfg.final_logit_softcap)
    return out


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architecture="gemma3",
    layer_tensors={**GEMMA_LAYER_TENSORS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    gguf_layer_tensors={**GEMMA_GGUF_TENSORS, "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"},
    role_shapes=dict(GEMMA_ROLE_SHAPES),
    hf_norm_offset=1.0,
    fused_stack=True,  # and QK-norm, and the local layers' own rotary table
    config=_config,
    gguf_config=_gguf_config,
    gguf_metadata=_gguf_metadata,
    model_type="gemma3_text",
    hf_refused={"Gemma3ForConditionalGeneration": VISION},
)
