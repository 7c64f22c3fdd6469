"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini (all saved as ``Phi3ForCausalLM``; llama.cpp's "phi3"): Llama's
layer (RMSNorm, SwiGLU, no biases) stored differently, with LongRoPE and, on Phi-4-mini, partial rotary.

* **Fused tensors.** q, k and v are one ``self_attn.qkv_proj`` and gate and up one ``mlp.gate_up_proj``
  (llama.cpp: ``attn_qkv`` and a fused ``ffn_up``). They are read as their parts (model/fused.py), so
  packing, quantized weights and tensor parallelism treat them as Llama's.
* **LongRoPE** (``rope_scaling`` type "su" or "longrope": short and long factor lists,
  ``original_max_position_embeddings``; llama.cpp's ``rope_factors_short``/``rope_factors_long`` tensors).
  One factor set for the whole model, chosen by its context: the long set when the context exceeds the
  original length (Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini: 131,072 over 4,096), cos and sin scaled
  by transformers' attention factor. Exact against transformers for a model whose context is within the
  original length, and for prompts longer than it; transformers gives shorter sequences of a long-context
  model the short set (model/rope.py, ``longrope_scaling``, has the why).
* **Partial rotary** (Phi-4-mini: ``partial_rotary_factor`` 0.75, RoPE on 96 of each head's 128 dims): q and
  k are rotated in the projection's epilogue (``hq::QkvEpilogue``: each head's leading 96 columns), in the
  fused C++ layer stack and on the per-op path alike.
* **Sliding window** (Phi-3-mini-4k: 2,047 tokens in every layer over a 4,096 context): every layer attends
  exactly through it, over the whole context (``sliding_everywhere``). Phi-3.5-mini and Phi-4-mini declare
  262,144, beyond their context: nothing changes.
* Tied embeddings (Phi-4-mini) as any family; no biases (transformers' Phi-3 has none, whatever the config's
  ``attention_bias`` says).

Not this family, refused by the registry with the list of what is supported: PhiMoE (``PhiMoEForCausalLM``),
Phi-3-small (``Phi3SmallForCausalLM``: blocksparse attention, GEGELU), Phi-1/2 (``PhiForCausalLM``) and the
multimodal Phi-3/4 checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydragen.model.family import LLAMA_LAYER_TENSORS, Family, sliding_everywhere


def _partial_rotary_factor(hf: dict[str, Any]) -> float:
    """transformers' precedence: the rope parameters' own value, then the config's top-level one."""
    for rope in (hf.get("rope_parameters"), hf.get("rope_scaling")):
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            return float(rope["partial_rotary_factor"])
    return float(hf.get("partial_rotary_factor") or 1.0)


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"attention_bias": False}
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    factor = _partial_rotary_factor(hf)
    if factor != 1.0:
        rotary = int(round(head_dim * factor, 6))  # transformers' int(); rounded against 95.99999 for 96
        if rotary <= 0 or rotary > head_dim or rotary % 2:
            raise ValueError(
                f"partial_rotary_factor {factor} gives {rotary} rotary dims of {head_dim}: it needs an even "
                "number between 2 and the head size"
            )
        fields["rotary_dim"] = rotary
    fields.update(sliding_everywhere(hf, hf.get("sliding_window")))
    return fields


def _gguf_config(meta: Callable[..., Any], arch: str) -> dict[str, Any]:
    """llama.cpp's phi3 metadata: no key length (a head is embedding / heads), ``rope.dimension_count`` the
    rotated dims (partial rotary), the window (0: none) and LongRoPE's original context."""
    hidden, heads = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.attention.head_count"))
    head_dim = int(meta(f"{arch}.attention.key_length", 0) or hidden // heads)
    out: dict[str, Any] = {"head_dim": head_dim}
    rotary = int(meta(f"{arch}.rope.dimension_count", 0) or head_dim)
    if rotary != head_dim:
        out["partial_rotary_factor"] = rotary / head_dim
    if orig := meta(f"{arch}.rope.scaling.original_context_length"):
        out["original_max_position_embeddings"] = int(orig)
    if window := meta(f"{arch}.attention.sliding_window"):
        out["sliding_window"] = int(window)
    return out


def _gguf_metadata(cfg: Any) -> dict[str, Any]:
    """What convert_hf_to_gguf.py's Phi3MiniModel writes beyond every architecture's keys: the rotated dims,
    the window when one is shorter than the context, and for LongRoPE the original context and the
    attention factor."""
    out: dict[str, Any] = {"rope.dimension_count": cfg.rotary_dims}
    if cfg.layer_specs and cfg.layer_specs[0].window:
        out["attention.sliding_window"] = int(cfg.layer_specs[0].window)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "longrope":
        orig = cfg.rope_scaling["original_max_position_embeddings"]
        out["rope.scaling.original_context_length"] = int(orig)
        out["rope.scaling.attn_factor"] = float(cfg.rope_scaling["attention_factor"])
    return out


def _gguf_extra_tensors(cfg: Any) -> dict[str, Any]:
    """LongRoPE's two factor sets as llama.cpp's tensors (rotary dims / 2 each)."""
    if not cfg.rope_scaling or cfg.rope_scaling["rope_type"] != "longrope":
        return {}
    return {
        "rope_factors_long.weight": list(cfg.rope_scaling["long_factor"]),
        "rope_factors_short.weight": list(cfg.rope_scaling["short_factor"]),
    }


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architecture="phi3",
    layer_tensors={**LLAMA_LAYER_TENSORS, "qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"},
    gguf_layer_tensors={"attn_qkv": "qkv", "ffn_up": "gate_up"},  # phi3's ffn_up holds gate and up
    fused_tensors={"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")},
    fused_stack=True,
    config=_config,
    gguf_config=_gguf_config,
    gguf_metadata=_gguf_metadata,
    gguf_extra_tensors=_gguf_extra_tensors,
)
