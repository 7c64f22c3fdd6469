"""Hydragen attention: a batch of sequences whose keys are shared prefix levels plus private suffixes.

Level l holds G_l groups of P_l keys; sequence b reads group b // (B // G_l). For each level the
queries of every sequence in a group are folded into the rows of one matrix, so the group's prefix is
read once by a matrix-matrix product (inter-sequence batching), instead of once per sequence. The
suffix is attended per sequence with its own causal/ragged visibility. Partials are merged in fp32
through their log-sum-exp, which makes the decomposition exact.

Sliding window (``window=W``) and soft-cap (``softcap=c``), both off by default. Positions: a sequence's
keys are its prefix levels, outermost first, then its valid suffix, at consecutive positions from 0
(level l starts at the sum of the earlier levels' lengths, the suffix at P, the sum of them all); its Nq
queries are its last Nq positions, L - Nq .. L - 1 with L = P + suffix_lens[b] (the suffix's causal rule
in positions). A query at position p then sees only keys at positions in (p - W, p]: its last W
positions, its own included (Hugging Face's ``sliding_window_overlay``, ``kv_idx > q_idx - sliding_window``;
Mistral's and Gemma's sliding layers). A level is still read once for all its sequences: only its keys
from the first position any query of the batch sees are read (a level wholly before every query's window
is not read at all), and a query that does not see some of those keys has them masked in the one matrix
product. With ``softcap`` each scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hydragen.attention.merge import merge_into
from hydragen.attention.primitives import partial_attention

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def suffix_visibility(
    suffix_lens: torch.Tensor, n_queries: int, s: int, window: int | None = None
) -> torch.Tensor:
    """[B, 1, Nq, S] boolean: query i of sequence b sees suffix key j iff j <= len_b - Nq + i (and, with a
    window W, j > len_b - Nq + i - W)."""
    i = torch.arange(n_queries, device=suffix_lens.device).view(1, 1, n_queries, 1)
    j = torch.arange(s, device=suffix_lens.device).view(1, 1, 1, s)
    last = suffix_lens.view(-1, 1, 1, 1) - n_queries + i
    seen = j <= last
    return seen if window is None else seen & (j > last - window)


def level_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    impl: str = "auto",
    first: torch.Tensor | None = None,
    softcap: float | None = None,
):
    """All queries of each group against that group's keys, in one batched call.

    q [B, Nq, Hq, D]; k/v [G, P, Hkv, D] with G | B. The rows of a group's sequences, queries and GQA
    heads are folded into one [m * Nq * g, D] matrix per KV head: a GEMM that reads the prefix once.
    ``first`` [B, Nq] (a window): query i of sequence b sees only keys j >= first[b, i], masked in the
    same product. Returns (out [B, Nq, Hq, D], lse [B, Nq, Hq]).
    """
    b, nq, hq, d = q.shape
    groups, hkv = k.shape[0], k.shape[2]
    m, g = b // groups, hq // hkv
    rows = q.view(groups, m, nq, hkv, g, d).permute(0, 3, 1, 2, 4, 5).reshape(groups, hkv, m * nq * g, d)
    visible = None
    if first is not None:
        lo = first.view(groups, m * nq, 1).expand(groups, m * nq, g).reshape(groups, 1, m * nq * g, 1)
        visible = torch.arange(k.shape[1], device=q.device).view(1, 1, 1, -1) >= lo
    out, lse = partial_attention(
        rows, k.transpose(1, 2), v.transpose(1, 2), scale, visible=visible, impl=impl, softcap=softcap
    )
    out = out.view(groups, hkv, m, nq, g, d).permute(0, 2, 3, 1, 4, 5).reshape(b, nq, hq, d)
    lse = lse.view(groups, hkv, m, nq, g).permute(0, 2, 3, 1, 4).reshape(b, nq, hq)
    return out, lse


def suffix_attention(
    q, k, v, suffix_lens, scale: float, impl: str = "auto", window: int | None = None, softcap=None
):
    """Each sequence's queries against its own suffix keys, with causal/ragged visibility (and a window).

    q [B, Nq, Hq, D]; k/v [B, S, Hkv, D]; suffix_lens [B] or None (all S valid).
    """
    b, nq, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if window is not None and suffix_lens is None:
        suffix_lens = torch.full((b,), s, device=q.device)
    if nq == 1:
        # Decode: fold the GQA group into query rows so each KV head is read by g rows at once.
        rows = q.view(b, hkv, hq // hkv, d)
        visible = None if suffix_lens is None else suffix_visibility(suffix_lens, 1, s, window)
        out, lse = partial_attention(rows, kt, vt, scale, visible=visible, impl=impl, softcap=softcap)
        return out.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
    qt = q.transpose(1, 2)
    if suffix_lens is None and nq == s:
        out, lse = partial_attention(qt, kt, vt, scale, causal=True, impl=impl, softcap=softcap)
    else:
        lens = torch.full((b,), s, device=q.device) if suffix_lens is None else suffix_lens
        visible = suffix_visibility(lens, nq, s, window)
        out, lse = partial_attention(qt, kt, vt, scale, visible=visible, impl=impl, softcap=softcap)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _check(q, prefix_ks, prefix_vs, suffix_k, suffix_v, suffix_lens, window=None, softcap=None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 (or None), got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Nq, Hq, D], got shape {tuple(q.shape)}")
    b, _, hq, d = q.shape
    if len(prefix_ks) != len(prefix_vs):
        raise ValueError(f"prefix_ks has {len(prefix_ks)} levels but prefix_vs has {len(prefix_vs)}")
    levels = list(zip(prefix_ks, prefix_vs, strict=True))
    if (suffix_k is None) != (suffix_v is None):
        raise ValueError("suffix_k and suffix_v must both be given or both be None")
    if suffix_k is not None:
        levels.append((suffix_k, suffix_v))
        if suffix_k.shape[0] != b:
            raise ValueError(f"suffix_k batch {suffix_k.shape[0]} != q batch {b}")
    for i, (k, v) in enumerate(levels):
        name = f"prefix level {i}" if i < len(prefix_ks) else "suffix"
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"{name}: k/v must be equal-shaped [G, P, Hkv, D], got {tuple(k.shape)} / {tuple(v.shape)}"
            )
        if k.shape[3] != d:
            raise ValueError(f"{name}: head dim {k.shape[3]} != query head dim {d}")
        if hq % k.shape[2]:
            raise ValueError(f"{name}: query heads {hq} not a multiple of KV heads {k.shape[2]}")
        if name != "suffix" and (k.shape[0] == 0 or b % k.shape[0]):
            raise ValueError(f"{name}: {k.shape[0]} groups do not divide batch {b}")
        if k.dtype != q.dtype or k.device != q.device:
            raise ValueError(f"{name}: dtype/device {k.dtype}/{k.device} != q's {q.dtype}/{q.device}")
    if suffix_lens is not None:
        if suffix_k is None:
            raise ValueError("suffix_lens given without suffix_k")
        if suffix_lens.shape != (b,) or suffix_lens.dtype not in _INT_DTYPES:
            raise ValueError(f"suffix_lens must be an integer tensor of shape [{b}]")
        if bool((suffix_lens < 0).any()) or bool((suffix_lens > suffix_k.shape[1]).any()):
            raise ValueError(f"suffix_lens must lie in [0, {suffix_k.shape[1]}]")


def shared_prefix_attention(
    q: torch.Tensor,
    prefix_ks: Sequence[torch.Tensor],
    prefix_vs: Sequence[torch.Tensor],
    suffix_k: torch.Tensor | None,
    suffix_v: torch.Tensor | None,
    suffix_lens: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """Exact attention for sequences made of shared prefix levels and private suffixes.

    See DESIGN.md's public contract for shapes. ``impl`` picks the partial kernel: "auto" (fused where
    available), "fused", or "torch" (the plain reference; soft-capped partials always run it).
    ``window`` (a sliding window of W positions) and ``softcap`` (scores c * tanh(s / c)) are off by
    default; the module docstring says how positions are counted.
    """
    _check(q, prefix_ks, prefix_vs, suffix_k, suffix_v, suffix_lens, window, softcap)
    b, nq, hq, d = q.shape
    scale = d**-0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    if suffix_lens is not None:
        suffix_lens = suffix_lens.to(q.device)
    acc_out = torch.zeros(b, nq, hq, d, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, nq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    s = 0 if suffix_k is None else suffix_k.shape[1]
    first = lens = None
    if b * nq == 0:
        window = None  # no query: nothing to bound
    if window is not None:  # first[b, i]: the first position query i of sequence b sees
        lens = torch.full((b,), s, device=q.device) if suffix_lens is None else suffix_lens.long()
        total = sum(k.shape[1] for k in prefix_ks) + lens
        first = total.view(b, 1) - nq + torch.arange(nq, device=q.device).view(1, nq) - window + 1
        lowest, highest = (int(x) for x in torch.aminmax(first))
    offset = 0  # the position of the level's first key
    for k, v in zip(prefix_ks, prefix_vs, strict=True):
        p, lo = k.shape[1], offset
        offset += p
        if window is not None:  # only the keys from the first position a query sees (maybe none)
            lo = min(max(lo, lowest), offset)
            k, v = k[:, lo - offset + p :], v[:, lo - offset + p :]
        if k.shape[1]:
            masked = first - lo if window is not None and highest > lo else None
            merge_into(acc_out, acc_lse, *level_attention(q, k, v, scale, impl, masked, softcap))
    if s:
        if window is not None:  # the keys from the first any query sees; positions shift by j0
            j0 = min(max(0, int(lens.min()) - nq - window + 1), s)
            suffix_k, suffix_v, suffix_lens = suffix_k[:, j0:], suffix_v[:, j0:], lens - j0
        if suffix_k.shape[1]:
            part = suffix_attention(q, suffix_k, suffix_v, suffix_lens, scale, impl, window, softcap)
            merge_into(acc_out, acc_lse, *part)
    out = acc_out.to(q.dtype)
    return (out, acc_lse) if return_lse else out
