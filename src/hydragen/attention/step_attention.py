"""One step's attention over the paged pool (placeholder twin; replaced by the kernel branch's op)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydragen.attention.merge import merge_into
from hydragen.attention.primitives import partial_attention


@dataclass
class StepAttentionMeta:
    units: torch.Tensor
    seg_tok: torch.Tensor
    seg_run: torch.Tensor
    runs: torch.Tensor
    seg_visible: torch.Tensor
    num_tokens: int
    _units: list
    _segments: list

    @classmethod
    def build(cls, units, segments, num_tokens: int, device) -> StepAttentionMeta:
        seg_tok = [0]
        seg_run = [0]
        runs = []
        for _, t1, rs, _ in segments:
            seg_tok.append(t1)
            runs.extend(rs)
            seg_run.append(len(runs))
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            t(units).view(-1, 5),
            t(seg_tok),
            t(seg_run),
            t(runs).view(-1, 2),
            t([v for *_, v in segments]),
            num_tokens,
            list(units),
            list(segments),
        )


def step_attention(q, k, v, meta: StepAttentionMeta, scale: float, impl: str = "auto") -> torch.Tensor:
    t, hq, d = q.shape
    acc = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    kimpl = "torch" if impl == "torch" else "auto"
    for kv_lo, kv_hi, t0, t1, causal in meta._units:
        qs = q[t0:t1].transpose(0, 1).unsqueeze(0)
        ks = k[kv_lo:kv_hi].transpose(0, 1).unsqueeze(0)
        vs = v[kv_lo:kv_hi].transpose(0, 1).unsqueeze(0)
        o, lo = partial_attention(qs, ks, vs, scale, causal=bool(causal), impl=kimpl)
        merge_into(acc[t0:t1], lse[t0:t1], o[0].transpose(0, 1), lo[0].transpose(0, 1))
    for t0, t1, rs, visible in meta._segments:
        if not rs:
            continue
        idx = torch.cat([torch.arange(a, b, device=q.device) for a, b in rs])
        ks, vs = k[idx].transpose(0, 1).unsqueeze(0), v[idx].transpose(0, 1).unsqueeze(0)
        n = t1 - t0
        j = torch.arange(idx.numel(), device=q.device)
        vis = (j.view(1, -1) < (visible + torch.arange(n, device=q.device)).view(-1, 1)).view(1, 1, n, -1)
        o, lo = partial_attention(
            q[t0:t1].transpose(0, 1).unsqueeze(0), ks, vs, scale, visible=vis, impl=kimpl
        )
        merge_into(acc[t0:t1], lse[t0:t1], o[0].transpose(0, 1), lo[0].transpose(0, 1))
    return acc.to(q.dtype)
