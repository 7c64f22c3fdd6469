"""The pure-torch twin of the C++ step attention: any device, and a second oracle for the C++ op.

Segments with the same number of tokens are attended together: their keys are gathered from the pool into
a padded [N, K] block (the copy the C++ op avoids) and run through ``partial_attention`` with a visibility
mask, so a decode step is one call however many sequences it holds. Units are contiguous pool views read by
``level_attention`` (GQA folded into query rows) or a causal partial, and merged into the covered token
range through their LSE. The gather tables are built on first use and kept on the step's metadata, so
later layers of the step reuse them.
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


def segment_buckets(meta) -> list[SegmentBucket]:
    by_len: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for lo, hi, runs, visible in meta.segment_list:
        n = hi - lo
        total = sum(b - a for a, b in runs)
        seen = [min(visible + j, total) for j in range(n)]
        if n and seen[-1] > 0:
            slots = [s for a, b in runs for s in range(a, b)][: seen[-1]]
            by_len.setdefault(n, []).append((lo, seen, slots))
    buckets = []
    for n, segs in by_len.items():
        width = max(seen[-1] for _, seen, _ in segs)
        slots = torch.zeros(len(segs), width, dtype=torch.int64)
        seen_t = torch.tensor([seen for _, seen, _ in segs], dtype=torch.int64)
        for i, (_, _, sl) in enumerate(segs):
            slots[i, : len(sl)] = torch.tensor(sl, dtype=torch.int64)
        tokens = torch.tensor([lo for lo, _, _ in segs], dtype=torch.int64).view(-1, 1) + torch.arange(n)
        visible = torch.arange(width).view(1, 1, 1, width) < seen_t.view(len(segs), 1, n, 1)
        buckets.append(SegmentBucket(tokens.to(meta.device), slots.to(meta.device), visible.to(meta.device)))
    return buckets


def torch_step_attention(q: Tensor, k: Tensor, v: Tensor, meta, scale: float) -> Tensor:
    """Same contract as ``step_attention`` (inputs already checked). A 16-bit KV cache under float32 queries
    is widened as it is gathered, so the arithmetic is the float32 queries' on the cache's exact values."""
    t, hq, d = q.shape
    q = q.contiguous()
    if k.dtype != q.dtype:  # only what a step reads is widened, never the whole pool
        k, v = _Widened(k, q.dtype), _Widened(v, q.dtype)
    acc = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if meta.torch_plan is None:
        meta.torch_plan = segment_buckets(meta)
    for bucket in meta.torch_plan:
        out, lse = partial_attention(
            q[bucket.tokens].transpose(1, 2),  # [N, Hq, L, D]
            k[bucket.slots].transpose(1, 2),  # [N, Hkv, K, D]
            v[bucket.slots].transpose(1, 2),
            scale,
            visible=bucket.visible,
        )
        rows = bucket.tokens.view(-1)
        acc[rows] = out.transpose(1, 2).reshape(-1, hq, d).float()
        acc_lse[rows] = lse.transpose(1, 2).reshape(-1, hq)
    for kv_lo, kv_hi, lo, hi, causal in meta.unit_list:
        if causal:
            out, lse = partial_attention(
                q[lo:hi].unsqueeze(0).transpose(1, 2),
                k[kv_lo:kv_hi].unsqueeze(0).transpose(1, 2),
                v[kv_lo:kv_hi].unsqueeze(0).transpose(1, 2),
                scale,
                causal=True,
            )
            out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1)
        else:
            out, lse = level_attention(
                q[lo:hi].unsqueeze(1), k[kv_lo:kv_hi].unsqueeze(0), v[kv_lo:kv_hi].unsqueeze(0), scale
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
