"""Triton kernels for tree decode attention: private tails, shared nodes, and the LSE merge.

One decode step of one layer is at most three launches, whatever the tree (tables: ``tree_plan.py``):

1. ``_shared_kernel``, grid (units, Hkv): unit u reads KV chunk ``[kv_lo, kv_hi)`` of a shared node once
   for the queries of its sequences ``[seq_lo, seq_hi)`` x the GQA group (query row r = sequence
   ``seq_lo + r // G``, head ``h * G + r % G``): a tensor-core ``tl.dot`` of [BLOCK_M, D] x [D, BLOCK_N].
   Each sequence's normalised partial (o, natural-log lse) goes to row ``part_row + b - seq_lo`` of
   ``part_o [R, Hq, D]`` / ``part_lse [R, Hq]`` (fp32).
2. ``_tail_kernel``, grid (B, Hkv, S): sequence b's private tail, positions ``[0, tail_lens[b])`` read
   through its row of the page table ``tail_pages`` (PagedAttention), against its G query heads (rows
   padded to 16 for ``tl.dot``),
   cut in S splits (flash-decoding) when the batch alone cannot fill the GPU. With S == 1 the merge is
   fused into its epilogue: it folds the sequence's shared partials (CSR ``seq_ptr``/``seq_parts``) into
   its running softmax state and writes the final output in the output's dtype.
3. ``_merge_kernel``, grid (B, Hkv), only when S > 1: folds the S tail partials and the shared partials.

Sliding windows and soft-caps (``tree_plan``'s window fields, ``tree_decode_attention(softcap=...)``): under
a window each sequence sees keys from its first visible position on (its position - W + 1): a shared unit
masks each query row below its sequence's bound (``seq_first`` against the unit's first key's position,
``unit_kpos``), and a tail starts at its first visible index (``tail_lo``): keys before it are not read. The
plan leaves out the shared chunks no sequence of a tile sees. A soft-cap c makes every score
c * tanh(s / c) (s scaled, natural units) before the softmax; tanh is computed from exp2 (Triton has no tanh
that runs both compiled and interpreted). Both are constexpr switches: without them the kernels are the
plain ones.

Everything accumulates in fp32 (online softmax in base 2; LSEs are stored in natural log). Inputs may be
fp32 (dots in IEEE fp32: fp32 models must match their reference token for token), fp16 or bf16 (tensor
cores). Any head dim: it is padded to a power of two >= 16 with masked loads.

Testing on CPU: set ``TRITON_INTERPRET=1`` *before this module is imported* (Triton reads it when
``@triton.jit`` runs). The interpreter does not do bf16 arithmetic (it multiplies the raw bit patterns),
so interpreted bf16 kernels compute their dots on fp32 copies of the bf16 values; on a GPU they are bf16
tensor-core dots with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydragen.attention.tree_plan import TreePlan

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


def is_interpreted() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return not isinstance(_tail_kernel, triton.runtime.JITFunction)


def check_device(device: torch.device) -> None:
    """Clear errors for the two ways the kernels cannot run, instead of Triton's own."""
    if is_interpreted() and isinstance(tl.zeros, triton.runtime.JITFunction):
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported; Triton's library is then compiled-only. "
            "Set it before anything imports triton"
        )
    if device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            "Triton attention needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first "
            "imported (the CPU interpreter, for tests)"
        )


@triton.jit
def _tanh(x):
    """tanh from exp2: sign(x) (1 - e) / (1 + e), e = exp(-2 |x|) (no overflow; absolute error ~1e-7)."""
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_range(
    q,
    k_ptr,
    v_ptr,
    stride_ks,
    stride_vs,
    lo,
    hi,
    acc,
    m_i,
    l_i,
    qk_scale,
    D,
    pages_ptr,
    row_lo,
    cap,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE: tl.constexpr,
    LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax of q [BLOCK_M, BLOCK_D] over keys [lo, hi) (k_ptr/v_ptr at slot 0, one head): slots
    lo..hi-1 when PAGE == 0, else positions lo..hi-1 of a context whose page i is ``pages_ptr[i]`` (slot
    ``page * PAGE + position % PAGE``). With LOWER, row r sees only keys n >= row_lo[r] (a window); with
    SOFTCAP, ``qk_scale`` is the natural-log scale and scores become cap * tanh(s / cap) (then base 2).

    State: acc [BLOCK_M, BLOCK_D] (unnormalised), m_i (running max, base-2 units), l_i (sum of exp2).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_mask = n < hi
        if PAGE:
            page = tl.load(pages_ptr + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            n64 = page * PAGE + (n % PAGE).to(tl.int64)
        else:
            n64 = n.to(tl.int64)
        kt = tl.load(
            k_ptr + n64[None, :] * stride_ks + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = _tanh(s / cap) * cap * _LOG2E
        seen = n_mask[None, :]
        if LOWER:
            seen = seen & (n[None, :] >= row_lo[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + n64[:, None] * stride_vs + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fold(acc, m_i, l_i, o, lse):
    """Fold a normalised partial (o [BLOCK_M, BLOCK_D], natural-log lse [BLOCK_M]) into the state."""
    lse2 = lse * _LOG2E
    m_new = tl.maximum(m_i, lse2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse2 - m_safe)
    acc = acc * alpha[:, None] + o * w[:, None]
    l_i = l_i * alpha + w
    return acc, m_new, l_i


@triton.jit
def _fold_rows(acc, m_i, l_i, o_ptr, lse_ptr, heads, stride_oh, row_mask, d_mask, offs_d):
    """Load one partial row (o_ptr/lse_ptr at its first head) for ``heads`` and fold it in."""
    o = tl.load(
        o_ptr + heads[:, None] * stride_oh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    lse = tl.load(lse_ptr + heads, mask=row_mask, other=float("-inf"))
    return _fold(acc, m_i, l_i, o, lse)


@triton.jit
def _fold_csr(acc, m_i, l_i, b, seq_ptr, seq_parts, part_o, part_lse, stride_pr, stride_ph, stride_plr,
              heads, row_mask, d_mask, offs_d):  # fmt: skip
    """Fold every shared partial listed for sequence b."""
    p0 = tl.load(seq_ptr + b)
    p1 = tl.load(seq_ptr + b + 1)
    for i in range(p0, p1):
        r = tl.load(seq_parts + i).to(tl.int64)
        acc, m_i, l_i = _fold_rows(
            acc, m_i, l_i, part_o + r * stride_pr, part_lse + r * stride_plr, heads, stride_ph,
            row_mask, d_mask, offs_d,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _finish(acc, m_i, l_i):
    """Normalise: (out, natural-log lse); rows that saw no key give out 0, lse -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    return out, lse


@triton.jit
def _tail_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, lens_ptr, out_ptr, lse_ptr,
    seq_ptr, seq_parts, part_o, part_lse, tail_lo_ptr,
    qk_scale, cap, split_len, G, D,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    stride_pr, stride_ph, stride_plr,
    MERGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, split): the G query heads of the group against a split of the tail, read
    through the sequence's row of the page table (under a window, from its first visible index on)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < G
    heads = h * G + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    b64 = b.to(tl.int64)
    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=tile_mask, other=0.0
    )
    q = q.to(DOT_DTYPE)
    length = tl.load(lens_ptr + b).to(tl.int32)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, length)
    if WINDOW:
        lo = tl.maximum(lo, tl.load(tail_lo_ptr + b).to(tl.int32))
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        q, k_ptr + h * stride_kh, v_ptr + h * stride_vh, stride_ks, stride_vs, lo, hi, acc, m_i, l_i,
        qk_scale, D, pages_ptr + b64 * stride_pb, lo, cap, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION, PAGE,
        False, SOFTCAP,
    )  # fmt: skip
    if MERGE:
        acc, m_i, l_i = _fold_csr(
            acc, m_i, l_i, b, seq_ptr, seq_parts, part_o, part_lse, stride_pr, stride_ph, stride_plr,
            heads, row_mask, d_mask, offs_d,
        )  # fmt: skip
    out, lse = _finish(acc, m_i, l_i)
    o_base = out_ptr + b64 * stride_ob + sp * stride_os
    tl.store(
        o_base + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=tile_mask,
    )
    tl.store(lse_ptr + b64 * stride_lb + sp * stride_ls + heads, lse, mask=row_mask)


@triton.jit
def _shared_kernel(
    q_ptr, k_ptr, v_ptr, units_ptr, part_o, part_lse, unit_kpos_ptr, seq_first_ptr,
    qk_scale, cap, G, D,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pr, stride_ph, stride_plr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One (work unit, KV head): all query rows of the unit's sequences against its KV chunk (under a
    window, each row from its sequence's first visible key on: a per-row lower bound in the same dots)."""
    u = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_lo = tl.load(units_ptr + u * 5 + 0)
    kv_hi = tl.load(units_ptr + u * 5 + 1)
    seq_lo = tl.load(units_ptr + u * 5 + 2)
    seq_hi = tl.load(units_ptr + u * 5 + 3)
    part_row = tl.load(units_ptr + u * 5 + 4)
    rows = tl.arange(0, BLOCK_M)
    seq = seq_lo + rows // G
    heads = h * G + rows % G
    row_mask = seq < seq_hi  # padding units (seq_hi == seq_lo) touch nothing
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=tile_mask,
        other=0.0,
    )
    q = q.to(DOT_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_lo = kv_lo
    if WINDOW:  # slot s of the unit holds position s - kv_lo + unit_kpos[u]
        first = tl.load(seq_first_ptr + seq, mask=row_mask, other=0)
        row_lo = kv_lo + first - tl.load(unit_kpos_ptr + u)
    acc, m_i, l_i = _attend_range(
        q, k_ptr + h * stride_kh, v_ptr + h * stride_vh, stride_ks, stride_vs, kv_lo, kv_hi,
        acc, m_i, l_i, qk_scale, D, units_ptr, row_lo, cap, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION, 0,
        WINDOW, SOFTCAP,
    )  # fmt: skip
    out, lse = _finish(acc, m_i, l_i)
    prow = part_row + seq - seq_lo
    tl.store(
        part_o + prow[:, None] * stride_pr + heads[:, None] * stride_ph + offs_d[None, :], out, mask=tile_mask
    )
    tl.store(part_lse + prow * stride_plr + heads, lse, mask=row_mask)


@triton.jit
def _merge_kernel(
    tail_o, tail_lse, seq_ptr, seq_parts, part_o, part_lse, out_ptr, lse_ptr,
    S, G, D,
    stride_tb, stride_ts, stride_th, stride_tlb, stride_tls,
    stride_pr, stride_ph, stride_plr, stride_ob, stride_oh, stride_lb,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head): fold the S tail partials and the shared partials; write the output."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < G
    heads = h * G + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    b64 = b.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for sp in range(0, S):
        acc, m_i, l_i = _fold_rows(
            acc, m_i, l_i, tail_o + b64 * stride_tb + sp * stride_ts,
            tail_lse + b64 * stride_tlb + sp * stride_tls, heads, stride_th, row_mask, d_mask, offs_d,
        )  # fmt: skip
    acc, m_i, l_i = _fold_csr(
        acc, m_i, l_i, b, seq_ptr, seq_parts, part_o, part_lse, stride_pr, stride_ph, stride_plr,
        heads, row_mask, d_mask, offs_d,
    )  # fmt: skip
    out, lse = _finish(acc, m_i, l_i)
    mask = row_mask[:, None] & d_mask[None, :]
    tl.store(
        out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + b64 * stride_lb + heads, lse, mask=row_mask)


# ---- launchers ------------------------------------------------------------------------------------


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(x))


def _stages(dtype: torch.dtype) -> int:
    """Software-pipelining depth: fp32 tiles at depth 3 need 180 KB of shared memory (A100 has 164)."""
    return 2 if dtype == torch.float32 else 3


def _dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(dtype the dots run in, input precision). See the module docstring for the interpreter's bf16."""
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if dtype == torch.float16:
        return tl.float16, "tf32"  # the precision flag only matters for fp32 operands
    if dtype == torch.bfloat16:
        return (tl.float32 if is_interpreted() else tl.bfloat16), "tf32"
    raise TypeError(f"Triton attention supports float32, float16 and bfloat16, got {dtype}")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """Validates q [B, Hq, D] against one layer's pool k/v [slots, Hkv, D]; returns (G, Hkv, D)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and k/v [slots, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)} (head dim, GQA group)")
    if k.dtype != v.dtype or (q.dtype != k.dtype and q.dtype != torch.float32):
        # a 16-bit KV cache under float32 q is fine: every K/V tile is widened to the dots' dtype on load
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head dim of q, k and v must be contiguous")
    check_device(q.device)
    return q.shape[1] // k.shape[1], k.shape[1], q.shape[2]


def _scores(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap) for the kernels: scale x log2(e) without a soft-cap; the natural scale with one (the
    kernel caps first, then goes to base 2)."""
    if softcap is None:
        return float(scale) * 1.4426950408889634, 1.0
    if not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    return float(scale), float(softcap)


def _empty_csr(b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(b + 1, dtype=torch.int32, device=device), torch.zeros(
        1, dtype=torch.int32, device=device
    )


def tail_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    lens: torch.Tensor,
    scale: float,
    *,
    split_len: int | None = None,
    num_splits: int = 1,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tail_lo: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's private tail: q [B, Hq, D] against positions [0, lens[b]) of the context whose page i
    is ``pages[b, i]`` (int32 [B, P]; slot ``page * page_size + position % page_size``); with ``tail_lo``
    (int32 [B], a window) from position tail_lo[b] on only; ``softcap`` caps the scores.

    Returns (out [B, S, Hq, D], lse [B, S, Hq]) per split (``split_len`` tokens each, S = num_splits);
    with S == 1 and ``parts = (seq_ptr, seq_parts, part_o, part_lse)`` the shared partials are folded in
    and ``out`` may have any dtype. Default: fp32 buffers. Sequences of length 0 give out 0, lse -inf.
    """
    g, hkv, d = _check(q, k, v)
    b, hq = q.shape[0], q.shape[1]
    if split_len is None:
        split_len, num_splits = 1 << 30, 1
    if parts is not None and num_splits != 1:
        raise ValueError("shared partials can only be fused into an unsplit tail (num_splits == 1)")
    if out is None:
        out = torch.empty(b, num_splits, hq, d, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(b, num_splits, hq, dtype=torch.float32, device=q.device)
    if parts is None:
        seq_ptr, seq_parts = _empty_csr(b, q.device)
        part_o, part_lse = out, lse  # never read
    else:
        seq_ptr, seq_parts, part_o, part_lse = parts
    dot_dtype, precision = _dot_config(q.dtype)
    qk_scale, cap = _scores(scale, softcap)
    if b:
        _tail_kernel[(b, hkv, num_splits)](
            q, k, v, pages, lens, out, lse, seq_ptr, seq_parts, part_o, part_lse,
            lens if tail_lo is None else tail_lo, qk_scale, cap, split_len, g, d,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), pages.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
            MERGE=parts is not None, BLOCK_M=_pow2(g), BLOCK_N=block_n, BLOCK_D=_pow2(d),
            DOT_DTYPE=dot_dtype, PRECISION=precision, PAGE=page_size, WINDOW=tail_lo is not None,
            SOFTCAP=softcap is not None, num_stages=_stages(q.dtype),
        )  # fmt: skip
    return out, lse


def shared_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    units: torch.Tensor,
    num_parts: int,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    part_o: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    window: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All work units of a layer in one launch. ``units`` int64 [U, 5] (see ``tree_plan``); ``window``
    (``unit_kpos`` int64 [U], ``seq_first`` int64 [B]) bounds each row below; ``softcap`` caps the scores.

    Returns the partials (part_o [R, Hq, D], part_lse [R, Hq]) fp32, R = ``num_parts``.
    """
    g, hkv, d = _check(q, k, v)
    hq = q.shape[1]
    if block_m < g or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, group {g}), got {block_m}")
    if part_o is None:
        part_o = torch.empty(max(num_parts, 1), hq, d, dtype=torch.float32, device=q.device)
    if part_lse is None:
        part_lse = torch.empty(max(num_parts, 1), hq, dtype=torch.float32, device=q.device)
    dot_dtype, precision = _dot_config(q.dtype)
    qk_scale, cap = _scores(scale, softcap)
    unit_kpos, seq_first = window if window is not None else (units, units)  # unread without a window
    if units.shape[0]:
        _shared_kernel[(units.shape[0], hkv)](
            q, k, v, units, part_o, part_lse, unit_kpos, seq_first, qk_scale, cap, g, d,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(d), DOT_DTYPE=dot_dtype, PRECISION=precision,
            WINDOW=window is not None, SOFTCAP=softcap is not None, num_stages=_stages(q.dtype),
        )  # fmt: skip
    return part_o, part_lse


def merge_attention(
    tail_o: torch.Tensor,
    tail_lse: torch.Tensor,
    seq_ptr: torch.Tensor,
    seq_parts: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    group: int,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sequence, head): LSE-merge the S tail partials [B, S, Hq, D] with the listed shared partials.

    Returns (out [B, Hq, D] in ``out_dtype``, lse [B, Hq] fp32).
    """
    b, s, hq, d = tail_o.shape
    if tail_o.stride(-1) != 1 or part_o.stride(-1) != 1:
        raise ValueError("partials must be contiguous in the head dim")
    out = torch.empty(b, hq, d, dtype=out_dtype, device=tail_o.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=tail_o.device)
    if b:
        _merge_kernel[(b, hq // group)](
            tail_o, tail_lse, seq_ptr, seq_parts, part_o, part_lse, out, lse, s, group, d,
            tail_o.stride(0), tail_o.stride(1), tail_o.stride(2), tail_lse.stride(0), tail_lse.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            BLOCK_M=_pow2(group), BLOCK_D=_pow2(d),
        )  # fmt: skip
    return out, lse


def tree_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreePlan,
    tail_lens: torch.Tensor,
    scale: float,
    *,
    block_n: int = 64,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """One layer of decode attention for the whole batch: q [B, Hq, D] -> out [B, Hq, D] in q's dtype.

    k/v are the layer's pool tensors [slots, Hkv, D]. Two launches (shared units, tails with the merge
    fused), or three when tails are split (shared units, tail splits, merge). A plan built with a window
    (``plan.window``) bounds every sequence's keys below; ``softcap`` caps the scores.
    """
    g, _, _ = _check(q, k, v)
    if g != plan.group:
        raise ValueError(f"plan was built for GQA group {plan.group}, q/k give {g}")
    window = (plan.unit_kpos, plan.seq_first) if plan.window is not None else None
    tail_lo = plan.tail_lo if plan.window is not None else None
    parts = shared_attention(
        q, k, v, plan.units, plan.num_parts, scale, block_m=plan.block_m, block_n=block_n, window=window,
        softcap=softcap,
    )  # fmt: skip
    csr = (plan.seq_ptr, plan.seq_parts, *parts)
    if plan.tail_splits == 1:
        out = torch.empty_like(q)
        out, lse = tail_attention(
            q, k, v, plan.tail_pages, plan.page_size, tail_lens, scale, block_n=block_n,
            out=out.unsqueeze(1), parts=csr, tail_lo=tail_lo, softcap=softcap,
        )  # fmt: skip
        out, lse = out.squeeze(1), lse.squeeze(1)
    else:
        to, tlse = tail_attention(
            q, k, v, plan.tail_pages, plan.page_size, tail_lens, scale,
            split_len=plan.tail_split_len, num_splits=plan.tail_splits, block_n=block_n, tail_lo=tail_lo,
            softcap=softcap,
        )  # fmt: skip
        out, lse = merge_attention(to, tlse, *csr, group=g, out_dtype=q.dtype)
    return (out, lse) if return_lse else out


def compile_report(
    capability: int = 90,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    group: int = 8,
    block_m: int = 64,
    block_n: int = 64,
    window: bool = False,
    softcap: bool = False,
) -> dict[str, dict]:
    """Compile every kernel for a CUDA target on any machine (Triton's bundled ptxas, no GPU needed)
    (``window`` / ``softcap``: with those switches on).

    Catches what the interpreter cannot (types, layouts, shared-memory overflows) and reports, per kernel,
    its shared memory in bytes and the matrix instructions its PTX uses ("wgmma", "mma" or "fma").
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if is_interpreted():
        raise RuntimeError("compile_report needs TRITON_INTERPRET unset when triton is imported")
    elem = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    dot_dtype, precision = _dot_config(dtype)
    ptrs = {p: f"*{elem}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    ptrs.update(pages_ptr="*i32", lens_ptr="*i64", units_ptr="*i64", seq_ptr="*i32", seq_parts="*i32")
    ptrs.update(tail_lo_ptr="*i32", unit_kpos_ptr="*i64", seq_first_ptr="*i64", cap="fp32")
    tiles = dict(BLOCK_D=_pow2(head_dim), DOT_DTYPE=dot_dtype, PRECISION=precision)
    tiles.update(WINDOW=window, SOFTCAP=softcap)
    kernels = {
        "tail": (_tail_kernel, dict(MERGE=True, BLOCK_M=_pow2(group), BLOCK_N=block_n, PAGE=16, **tiles)),
        "shared": (_shared_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, **tiles)),
        "merge": (_merge_kernel, dict(BLOCK_M=_pow2(group), BLOCK_D=_pow2(head_dim))),
    }
    report = {}
    for name, (fn, consts) in kernels.items():
        sig = {
            p: "constexpr" if p in consts else ptrs.get(p, "fp32" if p == "qk_scale" else "i32")
            for p in fn.arg_names
        }
        for p in ("lse_ptr", "part_o", "part_lse", "tail_o", "tail_lse"):
            if p in sig:
                sig[p] = "*fp32"
        if name == "merge":
            sig["out_ptr"] = f"*{elem}"
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts),
            target=GPUTarget("cuda", capability, 32),
            options=dict(num_stages=_stages(dtype)),
        )
        ptx = compiled.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "fma"
        report[name] = dict(shared=compiled.metadata.shared, mma=mma)
    return report
