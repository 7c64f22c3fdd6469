"""Batched sampling: greedy, temperature, top-k, top-p, with counter-based per-sequence randomness.

Each sequence draws one uniform per step from a hash of (its seed, its step), so a sequence's samples
depend only on its own seed and history, never on which other sequences share the batch: seeded runs
reproduce exactly with sharing on or off and at any batch size, and the n samples of one prompt (seeds
derived from (seed, index)) differ. The token is found by inverse-CDF search over the filtered
distribution, one batched cumsum + searchsorted for the whole batch.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def derive_seed(seed: int, index: int) -> int:
    """Seed (32-bit) of sample ``index`` of a request seeded with ``seed`` (any Python int)."""
    folded = _mix32_int(seed & _M32) ^ _mix32_int((seed >> 32) & _M32)
    return _mix32_int(folded ^ (index * 0x9E3779B1 & _M32))


class Sampler:
    def uniforms(self, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """[B] uniforms strictly inside (0, 1) (24 bits, exact in fp32) from seeds and step counters."""
        x = mix32(mix32(seeds & _M32) ^ (steps * 0xC2B2AE3D & _M32))
        return ((x >> 8).float() + 0.5) * (1.0 / 16777216.0)

    def __call__(
        self,
        logits,
        temperature,
        top_k,
        top_p,
        seeds,
        steps,
        any_random: bool,
        any_top_k: bool,
        any_top_p: bool,
    ) -> torch.Tensor:
        """logits [B, V] fp32; per-row tensors [B]. Returns sampled token ids [B] (int64)."""
        greedy = logits.argmax(-1)
        if not any_random:
            return greedy
        scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
        if any_top_k:
            k = torch.where(top_k > 0, top_k, logits.shape[1]).clamp_max(logits.shape[1])
            kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if any_top_p:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop tokens whose preceding mass already reaches top_p; the top token always stays.
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p.unsqueeze(1)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        cdf = probs.cumsum(-1)
        total = cdf[:, -1]
        # Strictly below the total, so the search lands on a token with nonzero probability.
        target = torch.minimum(
            self.uniforms(seeds, steps) * total, torch.nextafter(total, torch.zeros_like(total))
        )
        sampled = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
        return torch.where(temperature > 0, sampled, greedy)
