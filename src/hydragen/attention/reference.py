"""The oracle: naive attention over the concatenated keys of each sequence, in float64 by default."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reference_attention(
    q: torch.Tensor,
    prefix_ks: Sequence[torch.Tensor],
    prefix_vs: Sequence[torch.Tensor],
    suffix_k: torch.Tensor | None,
    suffix_v: torch.Tensor | None,
    suffix_lens: torch.Tensor | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, Nq, Hq, D], lse [B, Nq, Hq]) in ``dtype``; same semantics as the contract.

    Builds each sequence's full key list by materialising its prefix groups (this is exactly the
    per-sequence copy that hydragen avoids), then applies one mask and one softmax.
    """
    b, nq, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    ks, vs, vis = [], [], []
    for k, v in zip(prefix_ks, prefix_vs, strict=True):
        rep = b // k.shape[0]
        ks.append(k.repeat_interleave(rep, 0))
        vs.append(v.repeat_interleave(rep, 0))
        vis.append(torch.ones(b, nq, k.shape[1], dtype=torch.bool, device=q.device))
    if suffix_k is not None:
        s = suffix_k.shape[1]
        lens = torch.full((b,), s, device=q.device) if suffix_lens is None else suffix_lens.to(q.device)
        i = torch.arange(nq, device=q.device).view(1, nq, 1)
        j = torch.arange(s, device=q.device).view(1, 1, s)
        ks.append(suffix_k)
        vs.append(suffix_v)
        vis.append(j <= lens.view(-1, 1, 1) - nq + i)
    k = torch.cat(ks, 1).to(dtype)  # [B, S_total, Hkv, D]
    v = torch.cat(vs, 1).to(dtype)
    visible = torch.cat(vis, 2)  # [B, Nq, S_total]
    g = hq // k.shape[2]
    k = k.repeat_interleave(g, 2)
    v = v.repeat_interleave(g, 2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.to(dtype), k) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqs,bshd->bqhd", probs, v)
    return out, lse.transpose(1, 2)
