"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens.

The model knows nothing about caches or sharing: each layer hands its rotated q/k/v to an attention
callback supplied by the runner, which stores K/V in the pool and returns the attention output.
q/k/v and gate/up projections are packed into single matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hydragen.model.config import ModelConfig
from hydragen.model.rope import Rotary, apply_rotary

# attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.split = (q, kv, kv)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary: Rotary | None = None

    def setup_rotary(self, device) -> None:
        c = self.cfg
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, device)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden] (normalised)."""
        c = self.cfg
        t = input_ids.shape[0]
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, h.dtype)  # once per forward, shared by every layer
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            q, k, v = layer.qkv(x).split(layer.split, dim=-1)
            q = apply_rotary(q.view(t, c.num_heads, c.head_dim), cos, sin)
            k = apply_rotary(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
            o = attention(i, q, k, v.view(t, c.num_kv_heads, c.head_dim))
            h = h + self.reduce(layer.o(o.reshape(t, -1)))
            x = rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + self.reduce(layer.down(F.silu(gate) * up))
        return rms_norm(h, self.norm, c.rms_norm_eps)

    # Hooks a tensor-parallel shard overrides (hydragen.distributed.sharded_model): a vocabulary shard's
    # lookup, and the sum over ranks of a row-parallel projection's partial output.
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.inference_mode()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face checkpoints, packing q/k/v and gate/up."""
        c = self.cfg
        take = lambda name: sd.pop(name)  # noqa: E731
        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        else:
            sd.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.qkv.weight.copy_(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
            if c.attention_bias:
                layer.qkv.bias.copy_(torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]))
            layer.o.weight.copy_(take(a + "o_proj.weight"))
            layer.gate_up.weight.copy_(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            )
            layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.attn_norm.copy_(take(p + "input_layernorm.weight"))
            layer.mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
        leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"checkpoint has unexpected tensors, e.g. {leftovers[:3]}")
