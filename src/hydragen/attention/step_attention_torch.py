"""The pure-torch twin of the C++ step attention: any device, and a second oracle for the C++ op.

Segments with the same number of tokens are attended together: their keys are gathered from the pool into
a padded [N, K] block (the copy the C++ op avoids) and run through ``partial_attention`` with a visibility
mask, so a decode step is one call however many sequences it holds. Units are contiguous pool views read by
``level_attention`` (GQA folded into query rows) or a causal partial, and merged into the covered token
range through their LSE. The gather tables are built on first use and kept on the step's metadata, so
later layers of the step reuse them.

A window (the metadata's ``tok_first``: each token's first visible position) adds a lower bound to every
token's mask: a segment's gathered keys below it, and a unit's, are masked in the same call (the units and
segments come trimmed by ``StepAttentionMeta.build``, so keys wholly out of sight are not gathered). A
soft-cap goes to the partials (``partial_attention(softcap=...)``, the plain-torch one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hydragen.attention.merge import merge_into
from hydragen.attention.primitives import partial_attention
from hydragen.attention.shared_prefix import level_attention


@dataclass
class SegmentBucket:
    """Segments of one token count L, padded to the most keys any of their tokens sees (K)."""

    tokens: Tensor  # int64 [N, L]: the segments' query tokens
    slots: Tensor  # int64 [N, K]: their keys' pool slots, padded with slot 0 (masked out)
    visible: Tensor  # bool [N, 1, L, K]


@dataclass
class TorchPlan:
    buckets: list[SegmentBucket]
    unit_masks: list[Tensor | None]  # per unit, under a window: bool [1, 1, L, S] (its tokens x its keys)


def segment_buckets(meta) -> list[SegmentBucket]:
    by_len: dict[int, list[tuple[int, list[int], list[int], list[int]]]] = {}
    first_pos = meta.tok_first.tolist() if meta.window is not None else None
    for (lo, hi, runs, visible), pos in zip(meta.segment_list, meta.segment_positions(), strict=True):
        n = hi - lo
        total = sum(b - a for a, b in runs)
        seen = [max(0, min(visible + j, total)) for j in range(n)]
        # the first key index each token sees: 0, or its window's first position's index
        low = [max(0, first_pos[lo + j] - pos) for j in range(n)] if first_pos else [0] * n
        if n and seen[-1] > 0:
            slots = [s for a, b in runs for s in range(a, b)][: seen[-1]]
            by_len.setdefault(n, []).append((lo, seen, low, slots))
    buckets = []
    for n, segs in by_len.items():
        width = max(seen[-1] for _, seen, _, _ in segs)
        slots = torch.zeros(len(segs), width, dtype=torch.int64)
        seen_t = torch.tensor([seen for _, seen, _, _ in segs], dtype=torch.int64)
        low_t = torch.tensor([low for _, _, low, _ in segs], dtype=torch.int64)
        for i, (_, _, _, sl) in enumerate(segs):
            slots[i, : len(sl)] = torch.tensor(sl, dtype=torch.int64)
        tokens = torch.tensor([lo for lo, _, _, _ in segs], dtype=torch.int64).view(-1, 1) + torch.arange(n)
        key = torch.arange(width).view(1, 1, 1, width)
        visible = (key < seen_t.view(len(segs), 1, n, 1)) & (key >= low_t.view(len(segs), 1, n, 1))
        buckets.append(SegmentBucket(tokens.to(meta.device), slots.to(meta.device), visible.to(meta.device)))
    return buckets


def unit_masks(meta) -> list[Tensor | None]:
    """Per unit, under a window, which of its keys each of its tokens sees (a causal unit: its diagonal
    too); None where every token sees every key (no window, or all of a unit inside every window)."""
    if meta.window is None:
        return [None] * len(meta.unit_list)
    first_pos = meta.tok_first
    masks = []
    for (kv_lo, kv_hi, lo, hi, causal), pos in zip(meta.unit_list, meta.unit_positions(), strict=True):
        key = torch.arange(kv_hi - kv_lo, device=meta.device).view(1, -1)
        seen = key >= (first_pos[lo:hi] - pos).view(-1, 1)  # [L, S]
        if causal:
            seen = seen & (key <= torch.arange(hi - lo, device=meta.device).view(-1, 1))
        masks.append(None if not causal and bool(seen.all()) else seen.view(1, 1, hi - lo, kv_hi - kv_lo))
    return masks


def torch_step_attention(q: Tensor, k: Tensor, v: Tensor, meta, scale: float, softcap=None) -> Tensor:
    """Same contract as ``step_attention`` (inputs already checked). A 16-bit KV cache under float32 queries
    is widened as it is gathered, so the arithmetic is the float32 queries' on the cache's exact values."""
    t, hq, d = q.shape
    q = q.contiguous()
    if k.dtype != q.dtype:  # only what a step reads is widened, never the whole pool
        k, v = _Widened(k, q.dtype), _Widened(v, q.dtype)
    acc = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if meta.torch_plan is None:
        meta.torch_plan = TorchPlan(segment_buckets(meta), unit_masks(meta))
    for bucket in meta.torch_plan.buckets:
        out, lse = partial_attention(
            q[bucket.tokens].transpose(1, 2),  # [N, Hq, L, D]
            k[bucket.slots].transpose(1, 2),  # [N, Hkv, K, D]
            v[bucket.slots].transpose(1, 2),
            scale,
            visible=bucket.visible,
            softcap=softcap,
        )
        rows = bucket.tokens.view(-1)
        acc[rows] = out.transpose(1, 2).reshape(-1, hq, d).float()
        acc_lse[rows] = lse.transpose(1, 2).reshape(-1, hq)
    for (kv_lo, kv_hi, lo, hi, causal), mask in zip(meta.unit_list, meta.torch_plan.unit_masks, strict=True):
        if causal or mask is not None:
            out, lse = partial_attention(
                q[lo:hi].unsqueeze(0).transpose(1, 2),
                k[kv_lo:kv_hi].unsqueeze(0).transpose(1, 2),
                v[kv_lo:kv_hi].unsqueeze(0).transpose(1, 2),
                scale,
                visible=mask,
                causal=bool(causal) and mask is None,
                softcap=softcap,
            )
            out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1)
        else:
            out, lse = level_attention(
                q[lo:hi].unsqueeze(1),
                k[kv_lo:kv_hi].unsqueeze(0),
                v[kv_lo:kv_hi].unsqueeze(0),
                scale,
                softcap=softcap,
            )
            out, lse = out[:, 0], lse[:, 0]
        merge_into(acc[lo:hi], acc_lse[lo:hi], out, lse)
    return acc.to(q.dtype)


class _Widened:
    """A KV pool whose reads (indexing, slicing) come back in ``dtype``."""

    def __init__(self, pool: Tensor, dtype: torch.dtype):
        self.pool, self.dtype = pool, dtype

    def __getitem__(self, index) -> Tensor:
        return self.pool[index].to(self.dtype)
