"""What a model family declares: the one place that says how a family's checkpoints map onto the decoder.

Every family hydragen runs is the same decoder (``model/decoder.py``) with a few switches: norms on q and k,
norms after attention and after the MLP, the MLP's activation, partial rotary, an embedding scale, a final
logit soft-cap, and per-layer attention (sliding windows, soft-caps, scales). A family module
(``model/families/``) declares which switches it sets, the names its tensors have in Hugging Face
checkpoints and in llama.cpp's GGUF files, how to read its config, and whether the fused C++ layer stack
computes it exactly. ``model/registry.py`` lists the families: adding one is its module plus one line there.

What a family provides, and who reads it:

* its roles and their Hugging Face names (``layer_tensors``): the safetensors loader and the decoder;
* llama.cpp's block names for its roles (``GGUF_LAYER_ROLES`` plus ``gguf_layer_tensors``) and whether q/k
  rows are permuted (``gguf_permuted_qk``): the GGUF reader (``model/gguf.py``) and the GGUF writer
  (``model/gguf_write.py``) both, through ``Family.hf_name`` and ``Family.gguf_tensors``, so a file the
  writer lays out is the file the reader expects. A fused tensor (``fused_tensors``: Phi-3's ``attn_qkv``) is
  written whole, its parts' rows stacked; a role whose shape is not in ``ROLE_SHAPES`` (a norm of the
  family's own) gives its shape in ``role_shapes``; norms that llama.cpp stores as ``1 + w``
  say so with ``hf_norm_offset`` (the writer adds it to a checkpoint's norms, the loader to those it reads);
* the GGUF metadata beyond what every architecture has (``gguf_metadata``: ``{arch}.KEY`` values such as
  Llama's ``vocab_size`` or a sliding window), the tensors llama.cpp's converter generates beside the
  checkpoint's (``gguf_extra_tensors``: LongRoPE's factor sets), and which shapes llama-quantize treats as
  its 70B type (``gguf_quant_70b``, the one shape rule of llama-quantize that differs between these
  families);
* how to read its config (``config``, ``gguf_config``), and whether the fused C++ stack computes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A model's config as the writer hands it over: a ``hydragen.model.config.ModelConfig`` (not imported here:
# the config reads the registry, which reads this module).
ModelConfig = Any

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
# family shares, in the order the writer lays out a block; a family adds its own in
# ``Family.gguf_layer_tensors`` (they follow these in the file).
GGUF_LAYER_ROLES: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}

# llama.cpp's names of the tensors outside the blocks (``NAME.weight``) -> the Hugging Face checkpoint's.
GGUF_TOP_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# ShapeFn(config) -> a role's weight shape in the Hugging Face layout: (rows, cols), or (n,) for a vector.
ShapeFn = Callable[[ModelConfig], tuple[int, ...]]

# The decoder's roles and their shapes (model/decoder.py builds exactly these).
ROLE_SHAPES: dict[str, ShapeFn] = {
    "attn_norm": lambda c: (c.hidden_size,),
    "q": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "k": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "v": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "o": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "mlp_norm": lambda c: (c.hidden_size,),
    "gate": lambda c: (c.intermediate_size, c.hidden_size),
    "up": lambda c: (c.intermediate_size, c.hidden_size),
    "down": lambda c: (c.hidden_size, c.intermediate_size),
    "q_norm": lambda c: (c.head_dim,),
    "k_norm": lambda c: (c.head_dim,),
}
# The roles that carry a bias when the config's ``attention_bias`` is set (Qwen2's q, k and v).
BIASED_ROLES = ("q", "k", "v")

# ConfigFn(hf_config) -> the family's ModelConfig fields beyond the common ones (model/config.py)
ConfigFn = Callable[[dict[str, Any]], dict[str, Any]]
# GGUFConfigFn(metadata getter, arch) -> Hugging Face config fields beyond the ones every family's GGUF has
GGUFConfigFn = Callable[[Callable[..., Any], str], dict[str, Any]]


def _no_fields(_: Any, *__: Any) -> dict[str, Any]:
    return {}


def _never(*_: Any) -> bool:
    return False


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
    # Shapes of the roles ROLE_SHAPES lacks (a fused qkv, a norm of the family's own), for the writer.
    role_shapes: dict[str, ShapeFn] = field(default_factory=dict)
    # config -> the GGUF metadata this family's files carry beyond every architecture's: key (without the
    # "{arch}." prefix) -> value; int is written as uint32, float as float32 (llama.cpp checks the types).
    gguf_metadata: Callable[[ModelConfig], dict[str, Any]] = _no_fields
    # config -> the tensors llama.cpp's converter generates beside the checkpoint's (Phi-3's
    # rope_factors_long/short): GGUF name -> values, written float32 at the head of the file (the reader
    # folds them into the config, as it reads them).
    gguf_extra_tensors: Callable[[ModelConfig], dict[str, Any]] = _no_fields
    # (layers, query heads per KV head) -> whether llama.cpp's loader types this shape LLM_TYPE_70B, the one
    # model type llama-quantize's rules look at (attn_v gets Q5_K where it would get Q3_K or Q4_K).
    gguf_quant_70b: Callable[[int, int], bool] = _never
    # A family without a GGUF architecture of its own is written as this family's files (Mistral: "llama").
    gguf_family: str = ""

    def hf_tensor(self, role: str) -> str:
        return self.layer_tensors[role]

    def gguf_roles(self) -> dict[str, str]:
        return {**GGUF_LAYER_ROLES, **self.gguf_layer_tensors}

    def hf_name(self, name: str) -> str:
        """A GGUF tensor name (``blk.3.attn_q.weight``) -> this family's HF parameter name; ValueError for a
        name that is not one of its tensors."""
        parts = name.split(".")
        roles = self.gguf_roles()
        if parts[0] == "blk" and len(parts) == 4 and roles.get(parts[2]) in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.hf_tensor(roles[parts[2]])}.{parts[3]}"
        if len(parts) == 2 and parts[0] in GGUF_TOP_TENSORS:
            return f"{GGUF_TOP_TENSORS[parts[0]]}.{parts[1]}"
        raise ValueError(f"unexpected GGUF tensor {name!r}")

    def gguf_tensors(self, cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
        """Every tensor of a GGUF of this family and shape ``cfg`` that a checkpoint holds, in file order:
        (GGUF name, HF name, shape in the HF layout). The block's tensors are the family's roles under
        llama.cpp's names (``gguf_roles``), a fused tensor whole (its parts' rows stacked) in place of its
        parts; the HF names are ``hf_name``'s, the reader's own mapping."""
        shapes = {**ROLE_SHAPES, **self.role_shapes}
        parts = {p for fused in self.fused_tensors.values() for p in fused}

        def shape(role: str) -> tuple[int, ...]:
            if role in self.fused_tensors:
                stacked = [shapes[p](cfg) for p in self.fused_tensors[role]]
                return (sum(s[0] for s in stacked), *stacked[0][1:])
            return shapes[role](cfg)

        block = [(g, r) for g, r in self.gguf_roles().items() if r in self.layer_tensors and r not in parts]
        missing = sorted(set(self.layer_tensors) - parts - {r for _, r in block})
        if missing:
            raise ValueError(f"family {self.name}: roles {missing} have no GGUF name (gguf_layer_tensors)")
        out = [("token_embd.weight", (cfg.vocab_size, cfg.hidden_size))]
        for i in range(cfg.num_layers):
            for g, role in block:
                out.append((f"blk.{i}.{g}.weight", shape(role)))
                if cfg.attention_bias and {role, *self.fused_tensors.get(role, ())} & set(BIASED_ROLES):
                    out.append((f"blk.{i}.{g}.bias", shape(role)[:1]))
        out.append(("output_norm.weight", (cfg.hidden_size,)))
        if not cfg.tie_word_embeddings:
            out.append(("output.weight", (cfg.vocab_size, cfg.hidden_size)))
        return [(g, self.hf_name(g), s) for g, s in out]


def sliding_everywhere(hf: dict[str, Any], window: Any) -> dict[str, Any]:
    """The ModelConfig fields of a model whose every layer attends through the same sliding ``window``
    (Mistral 7B v0.1, Phi-3-mini-4k): a spec per layer, one KV group (its pages are the tables' own, so
    none is released early: exact, with the full context's KV). None or a window covering the whole
    context: nothing."""
    context = int(hf.get("max_position_embeddings", 4096))
    if not window or int(window) >= context:
        return {}
    from hydragen.attention.layer_spec import AttentionSpec

    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    spec = AttentionSpec(scale=head_dim**-0.5, window=int(window))
    return {"layer_specs": (spec,) * int(hf["num_hidden_layers"])}
