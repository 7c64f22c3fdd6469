"""Gemma 2: Llama's attention and gated MLP with four RMSNorms a layer (before and after attention, before
and after the MLP: "sandwich" norms), GeGLU (``gelu_pytorch_tanh`` on the gate), token embeddings scaled by
sqrt(hidden), scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
(``attn_logit_softcapping``), a sliding window on alternate layers (layer 0 first), the final logits
soft-capped (``final_logit_softcapping``) and tied embeddings.

Its norms compute x * (1 + w): a Hugging Face checkpoint holds w (the loader adds 1), llama.cpp's GGUF
holds 1 + w. llama.cpp's files keep no ``query_pre_attn_scalar``: llama.cpp scales the 27B's scores by
(hidden / heads) ** -0.5 and every other size's by head_dim ** -0.5, which are the released configs'
values, and so does the reader. The one-call C++ layer stack runs it when its weights are packed: the
sandwich norms and GeGLU are the stack's functions, which the per-op path calls too (``rms_norm_rows``,
``geglu_rows``), so the two agree bit for bit.

The writer (``model/gguf_write.py``) lays a Gemma 2 out as convert_hf_to_gguf.py's Gemma2Model does: the
four norms as ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` and ``post_ffw_norm``, stored as 1 + w;
no ``output`` (tied); the window and both soft-caps in the metadata, and, where the layers do not alternate
as llama.cpp assumes (windowed, full, ...), the pattern as a flag per layer. A model llama.cpp cannot hold
(a score scale it would not derive, no soft-cap) is refused rather than written as another model.
llama-quantize has no Gemma rule: its types are every family's, by tensor category.

The helpers here are Gemma 3's too (``model/families/gemma3.py``), whose layer is this one with QK-norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydragen.attention.layer_spec import AttentionSpec
from hydragen.kv.layout import window_groups
from hydragen.model.family import LLAMA_LAYER_TENSORS, Family

# Gemma's four norms: HF's post_attention_layernorm is the norm on the attention output (Llama's name for
# the norm before the MLP), and pre_feedforward_layernorm the one before the MLP.
GEMMA_LAYER_TENSORS: dict[str, str] = {
    **LLAMA_LAYER_TENSORS,
    "mlp_norm": "pre_feedforward_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}
# llama.cpp's names for them (ffn_norm, the norm before the MLP, is every family's "mlp_norm").
GEMMA_GGUF_TENSORS: dict[str, str] = {
    "post_attention_norm": "post_attn_norm",
    "post_ffw_norm": "post_mlp_norm",
}

# Their shapes, for the writer (every norm of a layer is a hidden-sized vector).
GEMMA_ROLE_SHAPES = {
    "post_attn_norm": lambda c: (c.hidden_size,),
    "post_mlp_norm": lambda c: (c.hidden_size,),
}

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"


def sliding_layers(hf: dict[str, Any], pattern: int) -> list[bool]:
    """Which layers attend through the sliding window: the config's ``layer_types``, else every layer but
    each ``sliding_window_pattern``-th (``pattern`` when the config has none): Gemma 2's 2 (layer 0
    windowed), Gemma 3's 6 (five local layers, then a global one)."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types:
        if len(types) != n or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types should name {SLIDING!r} or {FULL!r} for each of the {n} layers")
        return [t == SLIDING for t in types]
    every = int(hf.get("sliding_window_pattern") or pattern)
    return [bool((i + 1) % every) for i in range(n)]


def gemma_fields(hf: dict[str, Any], pattern: int, attn_cap: float | None, final_cap: float | None) -> dict:
    """The ModelConfig fields Gemma 2 and 3 share: the switches, and per layer its attention (scale, the
    window on sliding layers, the soft-cap) and its KV group (sliding layers apart from full ones).
    ``attn_cap``/``final_cap``: the soft-caps transformers assumes when the config omits them."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ValueError(f"Gemma's MLP activation should be {GELU_TANH!r}, got {act!r}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model's attention) is not supported")
    sliding = sliding_layers(hf, pattern)
    window = hf.get("sliding_window")
    if not window:  # no window: every layer attends to everything (llama.cpp reads such a file the same way)
        sliding = [False] * len(sliding)
    scale = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
    cap = hf.get("attn_logit_softcapping", attn_cap)
    specs = tuple(
        AttentionSpec(scale=scale, window=int(window) if s else None, soft_cap=float(cap) if cap else None)
        for s in sliding
    )
    final = hf.get("final_logit_softcapping", final_cap)
    return {
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "embed_scale": float(hf["hidden_size"]) ** 0.5,
        "final_logit_softcap": float(final) if final else None,
        "layer_specs": specs,
        "kv_groups": window_groups(sliding),
    }


def _config(hf: dict[str, Any]) -> dict[str, Any]:
    return gemma_fields(hf, pattern=2, attn_cap=50.0, final_cap=30.0)


def gguf_gemma_fields(meta: Callable[..., Any], arch: str, big_layers: int, pattern: int) -> dict[str, Any]:
    """The HF config fields a Gemma GGUF holds as llama.cpp writes and reads it: the window and its
    pattern (a count or a flag per layer), the soft-caps, and ``query_pre_attn_scalar`` as llama.cpp
    derives it (the 27B, the model with ``big_layers`` layers: hidden / heads; else head_dim)."""
    layers = int(meta(f"{arch}.block_count"))
    hidden, heads = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.attention.head_count"))
    head_dim = int(meta(f"{arch}.attention.key_length", 0) or hidden // heads)
    every = meta(f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(every, list):  # a flag per layer
        sliding = [bool(x) for x in every]
    else:  # llama.cpp: layer i is windowed unless i % n == n - 1 (n = 0: every layer)
        sliding = [int(every) == 0 or i % int(every) < int(every) - 1 for i in range(layers)]
    return {
        "layer_types": [SLIDING if s else FULL for s in sliding],
        "query_pre_attn_scalar": hidden // heads if layers == big_layers else head_dim,
        "hidden_activation": GELU_TANH,
    }


def _gguf_config(meta: Callable[..., Any], arch: str) -> dict[str, Any]:
    return {
        **gguf_gemma_fields(meta, arch, big_layers=46, pattern=2),
        "sliding_window": int(meta(f"{arch}.attention.sliding_window", 4096)),  # llama.cpp's default
        "attn_logit_softcapping": float(meta(f"{arch}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta(f"{arch}.final_logit_softcapping", 30.0)),
    }


def llama_cpp_scale(cfg: Any, big_layers: int) -> float:
    """The score scale llama.cpp derives for a Gemma of ``cfg``'s shape (its files keep none): the model with
    ``big_layers`` layers (the 27B) scales by (hidden / heads) ** -0.5, every other by head_dim ** -0.5."""
    return float(cfg.hidden_size // cfg.num_heads if cfg.num_layers == big_layers else cfg.head_dim) ** -0.5


def gemma_gguf_metadata(cfg: Any, big_layers: int, pattern: int) -> dict[str, Any]:
    """The metadata Gemma 2 and 3 files share: the window (when a layer has one) and, when the windowed layers
    are not llama.cpp's default for the architecture (every layer but each ``pattern``-th), a flag per layer
    (``attention.sliding_window_pattern``, which llama.cpp reads as an array as well as a count). ValueError
    for a score scale llama.cpp would not derive (``query_pre_attn_scalar``, which its files lack)."""
    scale = llama_cpp_scale(cfg, big_layers)
    if any(s.scale != scale for s in cfg.layer_specs):
        raise ValueError(
            f"llama.cpp scales this shape's scores by {scale:.6g} (query_pre_attn_scalar "
            f"{round(scale**-2)}), and its GGUF keeps no other: this config's query_pre_attn_scalar "
            "cannot be written"
        )
    sliding = [s.window is not None for s in cfg.layer_specs]
    out: dict[str, Any] = {}
    windows = {s.window for s in cfg.layer_specs if s.window is not None}
    if len(windows) > 1:
        raise ValueError(f"llama.cpp's GGUF holds one sliding window, not {sorted(windows)}")
    if windows:
        out["attention.sliding_window"] = int(windows.pop())
    if sliding != [i % pattern < pattern - 1 for i in range(cfg.num_layers)]:
        out["attention.sliding_window_pattern"] = sliding
    return out


def _gguf_metadata(cfg: Any) -> dict[str, Any]:
    """convert_hf_to_gguf.py's Gemma2Model keys beyond every architecture's: the window and the soft-caps
    (it writes no pattern: llama.cpp's default, alternate layers from layer 0, is every release's)."""
    caps = {s.soft_cap for s in cfg.layer_specs}
    if len(caps) != 1 or None in caps or not cfg.final_logit_softcap:
        raise ValueError(
            "llama.cpp's gemma2 soft-caps every layer's scores and the final logits (50 and 30 when its file "
            "gives none): a Gemma 2 without both soft-caps, or with a cap per layer, cannot be written"
        )
    return {
        **gemma_gguf_metadata(cfg, big_layers=46, pattern=2),
        "attn_logit_softcapping": float(caps.pop()),
        "final_logit_softcapping": float(cfg.final_logit_softcap),
    }


FAMILY = Family(
    name="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architecture="gemma2",
    layer_tensors=dict(GEMMA_LAYER_TENSORS),
    gguf_layer_tensors=dict(GEMMA_GGUF_TENSORS),
    role_shapes=dict(GEMMA_ROLE_SHAPES),
    hf_norm_offset=1.0,
    fused_stack=True,  # sandwich norms and GeGLU in the stack, soft-caps per layer
    config=_config,
    gguf_config=_gguf_config,
    gguf_metadata=_gguf_metadata,
)
