"""What a model family declares: the one place that says how a family's checkpoints map onto the decoder.

Every family hydragen runs is the same decoder (``model/decoder.py``) with a few switches: norms on q and k,
norms after attention and after the MLP, the MLP's activation, partial rotary, an embedding scale, a final
logit soft-cap, and per-layer attention (sliding windows, soft-caps, scales). A family module
(``model/families/``) declares which switches it sets, the names its tensors have in Hugging Face
checkpoints and in llama.cpp's GGUF files, how to read its config, and whether the fused C++ layer stack
computes it exactly. ``model/registry.py`` lists the families: adding one is its module plus one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A layer's tensors as the decoder names them (role) -> the suffix after "model.layers.{i}." in a Hugging
# Face checkpoint. Each family starts from Llama's names and replaces or adds its own.
LLAMA_LAYER_TENSORS: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "attn_norm": "input_layernorm",  # before attention
    "mlp_norm": "post_attention_layernorm",  # before the MLP (Llama's name for it)
}

# llama.cpp's block tensor names (``blk.{i}.NAME.weight``) -> the decoder's roles, for the tensors every
# family shares; a family adds its own in ``Family.gguf_layer_tensors``.
GGUF_LAYER_ROLES: dict[str, str] = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
}

# ConfigFn(hf_config) -> the family's ModelConfig fields beyond the common ones (model/config.py)
ConfigFn = Callable[[dict[str, Any]], dict[str, Any]]
# GGUFConfigFn(metadata getter, arch) -> Hugging Face config fields beyond the ones every family's GGUF has
GGUFConfigFn = Callable[[Callable[..., Any], str], dict[str, Any]]


def _no_fields(_: Any, *__: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family, as data. The fields name what differs between families; the decoder reads the
    resulting ``ModelConfig`` and never the family's name."""

    name: str
    hf_architectures: tuple[str, ...]  # config.json "architectures" this family loads
    gguf_architecture: str | None  # llama.cpp's general.architecture (None: no GGUF form)
    # Roles -> HF suffixes; defaults to Llama's (see LLAMA_LAYER_TENSORS).
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_TENSORS))
    # llama.cpp block names -> roles, beyond GGUF_LAYER_ROLES (e.g. "attn_q_norm": "q_norm").
    gguf_layer_tensors: dict[str, str] = field(default_factory=dict)
    # Tensors a checkpoint stores fused: a role whose tensor holds other roles' rows stacked, in this order
    # (Phi-3's "qkv": ("q", "k", "v")). The loader reads each part as a row range of it under the part's own
    # name (model/fused.py), so packing and tensor parallelism see separate tensors. The fused role needs a
    # name in ``layer_tensors`` (and ``gguf_layer_tensors``), the parts keep theirs.
    fused_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Whether llama.cpp's converter permuted attn_q/attn_k rows for its GPT-J-style RoPE (Llama, Mistral).
    gguf_permuted_qk: bool = False
    # Whether the fused C++ layer stack (model/layer_stack.py) computes this family exactly. Only a family
    # that says so runs it; every other runs the per-op path.
    fused_stack: bool = False
    # Norm weights in a Hugging Face checkpoint are stored as w with the norm computing x * (1 + w)
    # (Gemma): the loader adds this to them, so the decoder always computes x * w (llama.cpp's GGUF already
    # holds 1 + w). Such norms multiply in float32 and round once, so their weights stay float32.
    hf_norm_offset: float = 0.0
    config: ConfigFn = _no_fields  # HF config -> family ModelConfig fields (norms, activation, specs, ...)
    gguf_config: GGUFConfigFn = _no_fields  # GGUF metadata -> HF config fields this family adds
    model_type: str = ""  # the HF model_type a GGUF of this family reads as (default: the family name)
    # HF architectures of this family's kin that hydragen refuses -> the one line that says why and what to
    # load instead (Gemma 3's vision-language checkpoint).
    hf_refused: dict[str, str] = field(default_factory=dict)

    def hf_tensor(self, role: str) -> str:
        return self.layer_tensors[role]

    def gguf_roles(self) -> dict[str, str]:
        return {**GGUF_LAYER_ROLES, **self.gguf_layer_tensors}
