"""Rotary position embeddings (rotate-half layout): default, linear, Llama-3, YaRN and LongRoPE scaling.

``head_dim`` here is the dimensions rotated: all of a head's, or its leading ``rotary_dim`` (partial rotary,
Phi-4-mini's 96 of 128), the rest passing through unrotated (``model/linear.py``, ``rotate_leading``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        # LongRoPE: each frequency divided by its own factor, of the set longrope_scaling chose
        ext = torch.tensor(scaling["ext_factors"], dtype=torch.float32)
        return 1.0 / (ext * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
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
    if scaling is not None and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])  # resolved with the config (longrope_scaling)
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


def longrope_scaling(
    scaling: dict[str, Any], hf: dict[str, Any], context: int, rotary_dims: int
) -> dict[str, Any]:
    """LongRoPE (Phi-3's "su"/"longrope") resolved for a model run at ``context`` tokens: which factor set
    rotates every position, and the attention factor on cos and sin.

    LongRoPE has two sets of per-frequency factors: ``short_factor`` for sequences within
    ``original_max_position_embeddings`` and ``long_factor`` beyond. transformers picks per forward by the
    sequence's length, and when a sequence grows past the original length its generate recomputes the whole
    cache with the long set: a token's keys then depend on how long its sequence gets. Shared and cached KV
    cannot: a page is computed once, for every sequence that reaches it. So hydragen picks one set per model,
    by the context it runs the model at (as llama.cpp does by ``n_ctx`` and vLLM by ``max_model_len``): the
    long set when that context exceeds the original length, else the short one. Equal to transformers for
    every sequence when the context is within the original length, and for every sequence whose prompt is
    longer than it otherwise; a shorter sequence of a long-context model gets the long set here and the short
    one in transformers.

    The attention factor is transformers': ``attention_factor`` when given, else
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` the declared ``max_position_embeddings`` over the
    original length (1 when that is at most 1), whichever set rotates.
    """
    orig = (
        hf.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings")
    )
    if not orig:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    orig = int(orig)
    factor = scaling.get("factor") or int(hf.get("max_position_embeddings", context)) / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = context > orig
    for key in ("short_factor", "long_factor"):
        got = scaling.get(key)
        if not isinstance(got, (list, tuple)) or len(got) != rotary_dims // 2:
            n = "none" if not isinstance(got, (list, tuple)) else len(got)
            raise ValueError(f"longrope {key} should list {rotary_dims // 2} factors (rotary dims / 2): {n}")
    return {
        **scaling,
        "rope_type": "longrope",
        "original_max_position_embeddings": orig,
        "attention_factor": float(attention),
        "long": long,
        "ext_factors": tuple(float(x) for x in scaling["long_factor" if long else "short_factor"]),
    }


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
        # on cos and sin, in float32 as transformers: YaRN's and LongRoPE's attention factor, else 1
        self.scale = attention_factor(scaling)
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
