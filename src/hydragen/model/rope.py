"""Rotary position embeddings (rotate-half layout) with default, linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class Rotary:
    """Precomputed cos/sin tables indexed by absolute position.

    A forward looks its positions up once (:meth:`tables`) and hands the result to every layer
    (:func:`apply_rotary`): the lookup depends only on the positions, so repeating it per layer is waste.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, device):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        # Rotate-half negates the first half of the rotated vector; folding that sign into the table is
        # exact (IEEE negation commutes with rounding) and saves one op per rotation.
        sin = emb.sin()
        half = head_dim // 2
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for ``positions`` [T], each [T, 1, D] in ``dtype`` to broadcast over heads."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.signed_sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half layout) by tables from :meth:`Rotary.tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * signed_sin
