"""Model configuration, normalised from a Hugging Face config (old and new RoPE layouts) or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydragen.attention.layer_spec import AttentionSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs name LongRoPE "su"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # How each layer attends (window, soft-cap, sinks, scale); empty: full attention scaled by
    # head_dim ** -0.5 in every layer. A family declares it (attention/layer_spec.py).
    layer_specs: tuple[AttentionSpec, ...] = ()
    # Each layer's KV page group (kv/layout.py); empty: one group. Sliding-window layers get their own.
    kv_groups: tuple[int, ...] = ()
    # The decoder's switches, set by the model's family (model/families/): the defaults are Llama's.
    family: str = "llama"
    qk_norm: bool = False  # RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # also a norm on the attention output and on the MLP output (Gemma)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    rotary_dim: int = 0  # leading dimensions of each head that RoPE rotates (0: all of them)
    embed_scale: float = 1.0  # the token embeddings are multiplied by this (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits become cap * tanh(logits / cap) (Gemma 2)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        from hydragen.model.registry import family_for_hf

        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else str(cfg.get("model_type", "unknown"))
        family = family_for_hf(arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        # Rope: new layout keeps everything in `rope_parameters`; old layout uses rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = params or cfg.get("rope_scaling") or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
                )
            scaling["rope_type"] = rope_type
            if rope_type == "yarn":
                key = "original_max_position_embeddings"
                orig = scaling.get(key) or cfg.get(key)
                if not orig:
                    raise ValueError("yarn rope scaling needs original_max_position_embeddings")
                scaling["original_max_position_embeddings"] = int(orig)
                if scaling.get("factor") is None:  # DeepSeek's configs give the two lengths instead
                    scaling["factor"] = int(cfg.get("max_position_embeddings", orig)) / int(orig)
            if rope_type == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family.name,
        )
        fields = {**common, **family.config(cfg)}
        if fields["rope_scaling"] is not None and fields["rope_scaling"]["rope_type"] == "longrope":
            from hydragen.model.rope import longrope_scaling

            rotary = fields.get("rotary_dim") or fields["head_dim"]
            context = fields["max_position_embeddings"]  # the family's (a window may cap it)
            fields["rope_scaling"] = longrope_scaling(fields["rope_scaling"], cfg, context, rotary)
        return cls(**fields)

    @property
    def rotary_dims(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """Number of K and V elements one token stores across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
