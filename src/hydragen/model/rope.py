"""Rotary position embeddings (rotate-half layout): default, linear, Llama-3 and YaRN frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated (slowed by ``factor``), those turning more than ``beta_fast`` times kept, and a linear
    ramp blends the band between. Computed as transformers computes it, so the tables match."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``orig``
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


def attention_factor(scaling: dict | None) -> float:
    """The factor YaRN puts on cos and sin (so on every attention score, squared): 1 for other scalings.
    ``attention_factor`` when the config gives it, else 0.1 ln(factor) + 1, or DeepSeek's ratio of two such
    terms when it gives ``mscale`` and ``mscale_all_dim``."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def m(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(m(factor, mscale) / m(factor, mscale_all))
    return m(factor)


class Rotary:
    """cos/sin of each absolute position, computed once per forward for that forward's positions.

    A forward computes them once (:meth:`tables`) and hands the result to every layer
    (:func:`apply_rotary`): they depend only on the positions, so repeating them per layer is waste. No
    table over the whole context is kept: T x D/2 cos/sin per forward cost nothing next to a layer, while a
    table for Llama 3's 131,072 positions would hold 67 MB (more than 8 % of a 1B Q4_K_M model).
    ``max_positions`` is kept for the callers that check lengths.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, device):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        self.scale = attention_factor(scaling)  # on cos and sin: YaRN's, else 1
        self.max_positions = max_positions
        # Each frequency twice (rotate-half pairs column i with i + D/2), and the sign rotate-half puts on
        # the first half: folded into the sin table, exact (IEEE negation commutes with rounding), it saves
        # one op per rotation. Built once, so a step's tables are five small ops (a decode step pays each
        # op's overhead for a single row).
        self._freq_cols = torch.cat([self.inv_freq, self.inv_freq])
        ones = torch.ones_like(self.inv_freq)
        self._sin_sign = torch.cat([-ones, ones])

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for ``positions`` [T], each [T, 1, D] in ``dtype`` to broadcast over heads."""
        emb = positions.to(self.inv_freq.device, torch.float32).unsqueeze(1) * self._freq_cols
        cos, sin = emb.cos(), emb.sin().mul_(self._sin_sign)
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half layout) by tables from :meth:`Rotary.tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * signed_sin


def parse_rope(params: dict[str, Any], cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from one rope parameter dict (new layout: theta and scaling together), else
    from ``cfg``'s old-layout ``rope_theta`` and ``rope_scaling``. ``cfg`` also has YaRN's lengths."""
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = params or cfg.get("rope_scaling") or None
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
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
    return theta, scaling
