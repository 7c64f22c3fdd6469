"""The decoder every family runs (Llama, Mistral, Qwen2/3, ...) over a flat batch of tokens.

The model knows nothing about caches or sharing: each layer hands its rotated q/k/v to an attention
callback supplied by the runner, which stores K/V in the pool and returns the attention output.
q/k/v and gate/up are packed into single projections, and each projection carries its neighbours
(model/linear.py): a Llama layer is RMSNorm+qkv+rotary, attention, o+residual, RMSNorm+gate/up+SwiGLU and
down+residual. A family's switches (``ModelConfig``: QK-norm, sandwich norms, GeGLU, the embedding scale,
the final logit soft-cap, a second RoPE for windowed layers) take the steps they change out of the fused
calls; the family's module (model/families/) names its checkpoint's tensors.
Weights are float tensors in the model dtype, or kept in the checkpoint's compact format (GGUF quantized
blocks, 16-bit floats), whichever the loader hands ``load_hf_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hydragen.model.config import ModelConfig
from hydragen.model.family import Family
from hydragen.model.layer_stack import LayersFn
from hydragen.model.linear import (
    DenseProjection,
    PackedEmbedding,
    PackedProjection,
    Projection,
    QkvHeads,
    mlp_tail,
    rms_norm,
    rotate_leading,
)
from hydragen.model.qtensor import QuantTensor
from hydragen.model.registry import family_named
from hydragen.model.rope import Rotary

__all__ = ["AttentionFn", "DecoderLayer", "DecoderModel", "rms_norm"]

# attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        bias = torch.empty(q + 2 * kv) if cfg.attention_bias else None
        self.qkv: Projection = DenseProjection(torch.empty(q + 2 * kv, h), bias)
        self.o: Projection = DenseProjection(torch.empty(h, q))
        self.gate_up: Projection = DenseProjection(torch.empty(2 * inter, h))
        self.down: Projection = DenseProjection(torch.empty(h, inter))
        self.attn_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.mlp_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
        if cfg.sandwich_norms:  # on the attention output and the MLP output, before each joins the residual
            self.post_attn_norm = nn.Parameter(torch.ones(h), requires_grad=False)
            self.post_mlp_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.split = (q, kv, kv)


class DecoderModel(nn.Module):
    fuse_residual = True  # a tensor-parallel shard all-reduces the o/down partials before adding them

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.family: Family = family_named(cfg.family)
        # _weight: no random init (on the meta device it would import torch._dynamo, and with it Triton)
        self.embed: nn.Embedding | PackedEmbedding = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head: Projection | None = (
            None if cfg.tie_word_embeddings else DenseProjection(torch.empty(cfg.vocab_size, cfg.hidden_size))
        )
        self.rotary: Rotary | None = None
        self.local_rotary: Rotary | None = None  # the windowed layers' own RoPE (Gemma 3), if they have one
        if cfg.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown MLP activation {cfg.activation!r} (the decoder has silu, gelu_tanh)")
        # The layers with the plain path: Llama's, whose steps the projections fuse (QK-norm aside).
        self._plain_tail = not cfg.sandwich_norms and cfg.activation == "silu"
        self._local_rope = tuple(cfg.uses_local_rope(i) for i in range(cfg.num_layers))

    def setup_rotary(self, device) -> None:
        c = self.cfg
        self.rotary = Rotary(c.rotary_dims, c.rope_theta, c.rope_scaling, c.max_position_embeddings, device)
        if c.local_rope_theta is not None:
            self.local_rotary = Rotary(
                c.rotary_dims, c.local_rope_theta, c.local_rope_scaling, c.max_position_embeddings, device
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        layers: LayersFn | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden], normalised unless ``final_norm`` is
        False (the runner then normalises only the rows it samples, inside the head: ``logits``).
        ``layers``, when given, runs every layer at once in place of the loop (model/layer_stack.py: the
        same calls, from C++)."""
        c = self.cfg
        t = input_ids.shape[0]
        h = self.embed_tokens(input_ids)
        if c.embed_scale != 1.0:  # rounded to the model's dtype first, as transformers does (Gemma)
            h = h * torch.tensor(c.embed_scale, dtype=h.dtype)
        cols = (c.num_heads + c.num_kv_heads) * c.head_dim
        cos, sin = self.rotary.tables(positions, h.dtype)  # once per forward, shared by every layer
        rope = (cos.view(t, -1), sin.view(t, -1), cols)
        local_rope = rope
        if self.local_rotary is not None:  # the windowed layers' table, also once per forward
            cos, sin = self.local_rotary.tables(positions, h.dtype)
            local_rope = (cos.view(t, -1), sin.view(t, -1), cols)
        eps = c.rms_norm_eps
        if layers is not None:
            h = layers(h.contiguous(), rope, local_rope)
            return rms_norm(h, self.norm, eps) if final_norm else h
        # QK-norm goes between the projection and the rotary, and the projection's fused rotary rotates whole
        # heads: with either, q and k are rotated after the projection: by a packed projection's epilogue (a
        # bias too: the layer stack's function), else op by op.
        apart = c.qk_norm or c.rotary_dims != c.head_dim
        for i, layer in enumerate(self.layers):
            layer_rope = local_rope if self._local_rope[i] else rope
            if isinstance(layer.qkv, PackedProjection) and (apart or layer.qkv.bias is not None):
                heads = QkvHeads(c.head_dim, *layer.split[:2], *_head_norms(layer))
                qkv = layer.qkv(h, norm=layer.attn_norm, eps=eps, rope=layer_rope, heads=heads)
                q, k, v = qkv.split(layer.split, dim=-1)
            elif apart:
                q, k, v = layer.qkv(h, norm=layer.attn_norm, eps=eps).split(layer.split, dim=-1)
                if c.qk_norm:  # norm each head of q and k, then rotate
                    q = rms_norm(q.reshape(t, c.num_heads, c.head_dim), layer.q_norm, eps).view(t, -1)
                    k = rms_norm(k.reshape(t, c.num_kv_heads, c.head_dim), layer.k_norm, eps).view(t, -1)
                q = rotate_leading(q, _rope_for(layer_rope, q), c.head_dim)
                k = rotate_leading(k, _rope_for(layer_rope, k), c.head_dim)
            else:
                qkv = layer.qkv(h, norm=layer.attn_norm, eps=eps, rope=layer_rope)
                q, k, v = qkv.split(layer.split, dim=-1)
            o = attention(
                i,
                q.reshape(t, c.num_heads, c.head_dim),
                k.reshape(t, c.num_kv_heads, c.head_dim),
                v.reshape(t, c.num_kv_heads, c.head_dim),
            )
            if not self._plain_tail:
                h = self._layer_tail(layer, o.reshape(t, -1), h)
            elif self.fuse_residual:
                h = mlp_tail(layer.o, layer.gate_up, layer.down, o.reshape(t, -1), h, layer.mlp_norm, eps)
            else:
                h = h.add_(self.reduce(layer.o(o.reshape(t, -1))))
                mlp = layer.gate_up(h, norm=layer.mlp_norm, eps=eps, swiglu=True)
                h = h.add_(self.reduce(layer.down(mlp)))
        return rms_norm(h, self.norm, eps) if final_norm else h

    def _layer_tail(self, layer: DecoderLayer, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """A layer after attention, op by op: o, its norm (sandwich norms), the residual, the MLP's norm,
        gate/up and the activation (SwiGLU or GeGLU), down, its norm, the residual. h is updated in place.
        A norm after a projection needs the projection's whole output, so a tensor-parallel shard reduces
        first (``reduce``)."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        # packed projections in float32 on the CPU: the norms and GeGLU by the layer stack's functions
        native = isinstance(layer.o, PackedProjection) and h.dtype == torch.float32 and h.device.type == "cpu"
        norm = _native_rms_norm if native else rms_norm
        attn = self.reduce(layer.o(o))
        if c.sandwich_norms:
            attn = norm(attn, layer.post_attn_norm, eps)
        h = h.add_(attn)
        silu = c.activation == "silu"
        mlp = layer.gate_up(h, norm=layer.mlp_norm, eps=eps, swiglu=silu)
        if not silu and native:
            mlp = torch.ops.hydragen.geglu_rows(mlp.contiguous())
        elif not silu:  # GeGLU: gelu (tanh approximation) of the gate times up
            gate, up = mlp.chunk(2, dim=-1)
            mlp = F.gelu(gate, approximate="tanh") * up
        out = self.reduce(layer.down(mlp))
        if c.sandwich_norms:
            out = norm(out, layer.post_mlp_norm, eps)
        return h.add_(out)

    # Hooks a tensor-parallel shard overrides (hydragen.tp.sharded_model): a vocabulary shard's
    # lookup, and the sum over ranks of a row-parallel projection's partial output.
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).to(self.norm.dtype)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, normalized: bool = True) -> torch.Tensor:
        """Logits [R, V] (fp32) of final hidden rows. Rows taken before the final RMSNorm
        (``normalized=False``) are normalised by the head's own call: a packed head fuses the norm, so a
        decode step does not pay a handful of tensor ops for one row, and a prefill normalises only the
        rows it samples."""
        norm, eps = (None, 0.0) if normalized else (self.norm, self.cfg.rms_norm_eps)
        if self.lm_head is not None:
            logits = self.lm_head(hidden, norm=norm, eps=eps).float()
        else:
            if norm is not None:
                hidden = rms_norm(hidden, norm, eps)
            logits = F.linear(hidden, self.embed.weight).float()
        if (cap := self.cfg.final_logit_softcap) is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def load_hf_state_dict(
        self,
        sd,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        norm_offset: float = 0.0,
    ) -> None:
        """Take weights named as in Hugging Face checkpoints, packing q/k/v and gate/up.

        Each module is replaced by one holding the checkpoint's tensors (moved to ``device``, float tensors
        cast to ``dtype``); ``QuantTensor`` weights stay in their format. A tensor of the wrong shape raises
        RuntimeError, a missing one KeyError. ``norm_offset`` is added to every norm weight (a Gemma HF
        checkpoint's w for norms computing x * (1 + w); its GGUF already holds 1 + w).
        """
        from hydragen.model.heap import release_freed_memory

        c = self.cfg
        device = device or self.norm.device
        dtype = dtype or self.norm.dtype
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, inter = c.hidden_size, c.intermediate_size
        names = self.family.layer_tensors

        # Norms computing x * (1 + w) (Gemma's) multiply in float32 and round once: their weights stay float32
        # (linear.rms_norm then takes that order).
        norm_dtype = torch.float32 if self.family.hf_norm_offset else dtype

        def vector(name: str, n: int, offset: float = 0.0) -> nn.Parameter:
            t = _checked(name, sd.pop(name), (n,)).to(device, torch.float32) + offset
            return nn.Parameter(t.to(norm_dtype), requires_grad=False)

        def projection(names: list[tuple[str, int]], cols: int, bias: list[str] | None = None) -> Projection:
            parts = [_checked(n, sd.pop(n), (rows, cols)) for n, rows in names]
            b = (
                None
                if bias is None
                else torch.cat([_checked(n, sd.pop(n), (r,)) for n, (_, r) in zip(bias, names, strict=True)])
            )
            if any(isinstance(p, QuantTensor) for p in parts) and device.type == "cpu":
                return PackedProjection.from_parts([_as_kept(p) for p in parts], b)
            weight = torch.cat([_as_float(p) for p in parts]).to(device, dtype)
            return DenseProjection(weight, None if b is None else b.to(device, dtype))

        table = _checked("model.embed_tokens.weight", sd.pop("model.embed_tokens.weight"), (c.vocab_size, h))
        if isinstance(table, QuantTensor) and device.type == "cpu":
            self.embed = PackedEmbedding(table)
        else:
            self.embed = nn.Embedding.from_pretrained(_as_float(table).to(device, dtype))
        self.norm = vector("model.norm.weight", h, norm_offset)
        if self.lm_head is not None:
            self.lm_head = projection([("lm_head.weight", c.vocab_size)], h)
        else:
            sd.pop("lm_head.weight", None)
            if isinstance(self.embed, PackedEmbedding):
                self.lm_head = self.embed.as_projection()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            w = lambda role, p=p: f"{p}{names[role]}.weight"  # noqa: E731
            qkv = [(w("q"), q), (w("k"), kv), (w("v"), kv)]
            bias = [f"{p}{names[r]}.bias" for r in "qkv"] if c.attention_bias else None
            layer.qkv = projection(qkv, h, bias)
            layer.o = projection([(w("o"), h)], q)
            layer.gate_up = projection([(w("gate"), inter), (w("up"), inter)], h)
            layer.down = projection([(w("down"), h)], inter)
            layer.attn_norm = vector(w("attn_norm"), h, norm_offset)
            layer.mlp_norm = vector(w("mlp_norm"), h, norm_offset)
            if c.qk_norm:
                layer.q_norm = vector(w("q_norm"), c.head_dim, norm_offset)
                layer.k_norm = vector(w("k_norm"), c.head_dim, norm_offset)
            if c.sandwich_norms:
                layer.post_attn_norm = vector(w("post_attn_norm"), h, norm_offset)
                layer.post_mlp_norm = vector(w("post_mlp_norm"), h, norm_offset)
            # The layer's freed copies (q and k put back in HF row order) go back to the OS now: glibc cuts
            # the next layer's small lasting tensors (its norms) from their chunks, and takes fresh memory
            # for the next copies, ~1 copy a layer that only the final trim returned (25 MB on a 1B shape).
            release_freed_memory()
        leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"checkpoint has unexpected tensors, e.g. {leftovers[:3]}")


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.hydragen.rms_norm_rows(x.contiguous(), weight.float().contiguous(), eps)


def _head_norms(layer: DecoderLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)


def _rope_for(rope, x: torch.Tensor):
    """The step's rotary tables for rotating all of x [T, heads * D] (q or k alone)."""
    cos, sin, _ = rope
    return cos.to(x.dtype), sin.to(x.dtype), x.shape[1]


def _checked(name: str, t, shape: tuple[int, ...]):
    if tuple(t.shape) != shape:
        raise RuntimeError(f"{name} has shape {tuple(t.shape)}, the config calls for {shape}")
    return t


def _as_float(t) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantTensor) else t


def _as_kept(t) -> QuantTensor:
    """A float part beside quantized ones (a q/k/v of mixed types) joins them as float32 rows."""
    if isinstance(t, QuantTensor):
        return t
    w = t.float().contiguous()
    return QuantTensor(0, w.view(torch.uint8).reshape(w.shape[0], -1), int(w.shape[1]))
