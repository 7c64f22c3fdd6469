"""Hydragen attention: a batch of sequences whose keys are shared prefix levels plus private suffixes.

Level l holds G_l groups of P_l keys; sequence b reads group b // (B // G_l). For each level the
queries of every sequence in a group are folded into the rows of one matrix, so the group's prefix is
read once by a matrix-matrix product (inter-sequence batching), instead of once per sequence. The
suffix is attended per sequence with its own causal/ragged visibility. Partials are merged in fp32
through their log-sum-exp, which makes the decomposition exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hydragen.attention.merge import merge_into
from hydragen.attention.primitives import partial_attention

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def suffix_visibility(suffix_lens: torch.Tensor, n_queries: int, s: int) -> torch.Tensor:
    """[B, 1, Nq, S] boolean: query i of sequence b sees suffix key j iff j <= len_b - Nq + i."""
    i = torch.arange(n_queries, device=suffix_lens.device).view(1, 1, n_queries, 1)
    j = torch.arange(s, device=suffix_lens.device).view(1, 1, 1, s)
    return j <= suffix_lens.view(-1, 1, 1, 1) - n_queries + i


def level_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, impl: str = "auto"):
    """All queries of each group against that group's keys, in one batched call.

    q [B, Nq, Hq, D]; k/v [G, P, Hkv, D] with G | B. The rows of a group's sequences, queries and GQA
    heads are folded into one [m * Nq * g, D] matrix per KV head: a GEMM that reads the prefix once.
    Returns (out [B, Nq, Hq, D], lse [B, Nq, Hq]).
    """
    b, nq, hq, d = q.shape
    groups, hkv = k.shape[0], k.shape[2]
    m, g = b // groups, hq // hkv
    rows = q.view(groups, m, nq, hkv, g, d).permute(0, 3, 1, 2, 4, 5).reshape(groups, hkv, m * nq * g, d)
    out, lse = partial_attention(rows, k.transpose(1, 2), v.transpose(1, 2), scale, impl=impl)
    out = out.view(groups, hkv, m, nq, g, d).permute(0, 2, 3, 1, 4, 5).reshape(b, nq, hq, d)
    lse = lse.view(groups, hkv, m, nq, g).permute(0, 2, 3, 1, 4).reshape(b, nq, hq)
    return out, lse


def suffix_attention(q, k, v, suffix_lens, scale: float, impl: str = "auto"):
    """Each sequence's queries against its own suffix keys, with causal/ragged visibility.

    q [B, Nq, Hq, D]; k/v [B, S, Hkv, D]; suffix_lens [B] or None (all S valid).
    """
    b, nq, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if nq == 1:
        # Decode: fold the GQA group into query rows so each KV head is read by g rows at once.
        rows = q.view(b, hkv, hq // hkv, d)
        visible = None if suffix_lens is None else suffix_visibility(suffix_lens, 1, s)
        out, lse = partial_attention(rows, kt, vt, scale, visible=visible, impl=impl)
        return out.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
    qt = q.transpose(1, 2)
    if suffix_lens is None and nq == s:
        out, lse = partial_attention(qt, kt, vt, scale, causal=True, impl=impl)
    else:
        lens = torch.full((b,), s, device=q.device) if suffix_lens is None else suffix_lens
        out, lse = partial_attention(qt, kt, vt, scale, visible=suffix_visibility(lens, nq, s), impl=impl)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _check(q, prefix_ks, prefix_vs, suffix_k, suffix_v, suffix_lens) -> None:
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
):
    """Exact attention for sequences made of shared prefix levels and private suffixes.

    See DESIGN.md's public contract for shapes. ``impl`` picks the partial kernel: "auto" (fused where
    available), "fused", or "torch" (the plain reference).
    """
    _check(q, prefix_ks, prefix_vs, suffix_k, suffix_v, suffix_lens)
    b, nq, hq, d = q.shape
    scale = d**-0.5 if scale is None else float(scale)
    if suffix_lens is not None:
        suffix_lens = suffix_lens.to(q.device)
    acc_out = torch.zeros(b, nq, hq, d, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, nq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for k, v in zip(prefix_ks, prefix_vs, strict=True):
        if k.shape[1]:
            merge_into(acc_out, acc_lse, *level_attention(q, k, v, scale, impl))
    if suffix_k is not None and suffix_k.shape[1]:
        merge_into(acc_out, acc_lse, *suffix_attention(q, suffix_k, suffix_v, suffix_lens, scale, impl))
    out = acc_out.to(q.dtype)
    return (out, acc_lse) if return_lse else out
