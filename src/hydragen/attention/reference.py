"""The oracle: naive attention over the concatenated keys of each sequence, in float64 by default.

Positions, for a sliding window: a sequence's keys are its prefix levels, outermost first, then its valid
suffix, at consecutive positions from 0 (level 0's keys at 0 .. P_0 - 1, the suffix's at P .. P + len - 1
with P the sum of the levels' lengths); its Nq queries are its last Nq positions, L - Nq .. L - 1 with
L = P + suffix_lens[b]. With ``window`` W a query at position p sees only keys at positions in
(p - W, p], the last W positions including its own (Hugging Face's ``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``), besides the contract's own rule (every prefix key, the suffix
causally). With ``softcap`` c every score s (already scaled) becomes c * tanh(s / c) before the softmax
(Gemma 2's attention logit soft-capping).
"""

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
    window: int | None = None,
    softcap: float | None = None,
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
    prefix = sum(k.shape[1] for k in prefix_ks)
    s = 0 if suffix_k is None else suffix_k.shape[1]
    lens = torch.full((b,), s, device=q.device) if suffix_lens is None else suffix_lens.to(q.device).long()
    if suffix_k is not None:
        i = torch.arange(nq, device=q.device).view(1, nq, 1)
        j = torch.arange(s, device=q.device).view(1, 1, s)
        ks.append(suffix_k)
        vs.append(suffix_v)
        vis.append(j <= lens.view(-1, 1, 1) - nq + i)
    if not ks:
        ks, vs = [q.new_zeros(b, 0, 1, d)], [q.new_zeros(b, 0, 1, d)]
        vis.append(torch.ones(b, nq, 0, dtype=torch.bool, device=q.device))
    k = torch.cat(ks, 1).to(dtype)  # [B, S_total, Hkv, D]
    v = torch.cat(vs, 1).to(dtype)
    visible = torch.cat(vis, 2)  # [B, Nq, S_total]
    if window is not None:
        q_pos = (prefix + lens).view(-1, 1, 1) - nq + torch.arange(nq, device=q.device).view(1, nq, 1)
        k_pos = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
        visible = visible & (k_pos > q_pos - window)
    g = hq // k.shape[2]
    k = k.repeat_interleave(g, 2)
    v = v.repeat_interleave(g, 2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.to(dtype), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqs,bshd->bqhd", probs, v)
    return out, lse.transpose(1, 2)
