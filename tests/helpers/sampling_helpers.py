"""The sampling distribution's documented definition, as an oracle for the samplers that claim to draw from
it (hydragen's own, and the llama.cpp peer's chain in the benchmarks)."""

from __future__ import annotations

import torch


def reference(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The documented definition in float64: min_p, then top_k, then top_p over the renormalised
    survivors, ties at every cut kept together."""
    p = torch.softmax(logits.double() / temperature, -1)
    keep = p >= min_p * p.max()
    if 0 < top_k < p.numel():
        keep &= p >= p.sort(descending=True).values[top_k - 1]
    q = p * keep
    above = torch.stack([q[q > x].sum() for x in q]) if q.numel() <= 64 else _above(q)
    keep &= above < top_p * q.sum()
    q = p * keep
    return q / q.sum()


def _above(q: torch.Tensor) -> torch.Tensor:
    """Mass strictly above each entry (ties share the mass above their group)."""
    values, inverse = torch.unique(q, return_inverse=True)  # ascending
    group_mass = torch.zeros_like(values).index_add_(0, inverse, q)
    above_group = group_mass.flip(0).cumsum(0).flip(0) - group_mass
    return above_group[inverse]
