"""Writing GGUF blocks from float weights (the formats the gguf package cannot write: the K-quants), and
random blocks of any format for throughput-only models.

The K-quant quantizers here lay out blocks exactly as llama.cpp reads them (the inverse of its
dequantization), with a plain rounding search: min/max per sub-block, no iterative error minimisation, so
their error is larger than llama-quantize's. They serve tests (a tiny model in every format) and random
weights, where the layout matters and the last bit of accuracy does not.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, row_bytes] in GGUF type ``qtype``."""
    qtype = Q(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    ours = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q45_k, Q.Q5_K: _q45_k, Q.Q6_K: _q6_k}
    if qtype in ours:
        blocks = x.reshape(-1, 256)
        out = ours[qtype](blocks, qtype) if qtype in (Q.Q4_K, Q.Q5_K) else ours[qtype](blocks)
        return out.reshape(rows, -1)
    return np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(rows, -1)


def _f16(v: np.ndarray) -> np.ndarray:
    """float32 [n] -> the fp16 bytes [n, 2]."""
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _affine_scales(x: np.ndarray, levels: int, scale_max: int):
    """Per sub-block (min <= 0, max): (d, dmin, scale ints, min ints, unsigned q) for w = d*s*q - dmin*m."""
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / levels  # [n, subs]
    d = step.max(-1) / scale_max
    dmin = (-lo).max(-1) / scale_max
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    s = np.clip(np.rint(_safe_div(step, d[:, None])), 0, scale_max)
    m = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, scale_max)
    q = np.rint(_safe_div(x + (dmin[:, None] * m)[..., None], (d[:, None] * s)[..., None]))
    return d, dmin, s.astype(np.uint8), m.astype(np.uint8), np.clip(q, 0, levels).astype(np.uint8)


def _pack_k4_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs per block into llama.cpp's 12 bytes [n, 12]."""
    out = np.zeros((s.shape[0], 12), np.uint8)
    out[:, 0:4] = (s[:, :4] & 63) | ((s[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (s[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q45_k(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    n = blocks.shape[0]
    levels = 15 if qtype == Q.Q4_K else 31
    d, dmin, s, m, q = _affine_scales(blocks.reshape(n, 8, 32), levels, 63)
    q = q.reshape(n, 4, 2, 32)  # pairs of sub-blocks share 32 bytes: low nibble first, high second
    ql = (q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)
    parts = [_f16(d), _f16(dmin), _pack_k4_scales(s, m)]
    if qtype == Q.Q5_K:
        hi = q >> 4  # bit 2p of qh[l]: sub-block 2p's weight l; bit 2p+1: sub-block 2p+1's
        qh = np.zeros((n, 32), np.uint8)
        for p in range(4):
            qh |= (hi[:, p, 0] << (2 * p)) | (hi[:, p, 1] << (2 * p + 1))
        parts.append(qh)
    parts.append(ql.reshape(n, 128))
    return np.concatenate(parts, axis=1)


def _symmetric(x: np.ndarray, qmax: int, scale_bits_max: int):
    """Per 16-weight sub-block signed scales: (d, int scales, signed q in [-qmax-1, qmax])."""
    amax_idx = np.abs(x).argmax(-1)
    signed_max = np.take_along_axis(x, amax_idx[..., None], -1)[..., 0]
    step = -signed_max / (qmax + 1)  # the largest magnitude lands on -qmax-1, llama.cpp's convention
    d = (np.abs(step).max(-1) / scale_bits_max).astype(np.float16).astype(np.float32)
    s = np.clip(np.rint(_safe_div(step, d[:, None])), -scale_bits_max - 1, scale_bits_max)
    q = np.rint(_safe_div(x, (d[:, None] * s)[..., None]))
    return d, s.astype(np.int8), np.clip(q, -qmax - 1, qmax).astype(np.int16)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, s, q = _symmetric(blocks.reshape(n, 16, 16), 31, 127)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # halves of 128: four runs of 32
    ql = np.concatenate(
        [(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4), (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)], 2
    )
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), s.view(np.uint8), _f16(d)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, s, q = _symmetric(blocks.reshape(n, 16, 16), 3, 31)
    raw = (s.astype(np.int16) + 32).astype(np.uint8)  # 6-bit, stored offset by 32
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = (raw[:, 0:4] & 15) | ((raw[:, 8:12] & 15) << 4)
    scales[:, 4:8] = (raw[:, 4:8] & 15) | ((raw[:, 12:16] & 15) << 4)
    scales[:, 8:12] = (
        (raw[:, 0:4] >> 4)
        | ((raw[:, 4:8] >> 4) << 2)
        | ((raw[:, 8:12] >> 4) << 4)
        | ((raw[:, 12:16] >> 4) << 6)
    )
    u = (q + 4).astype(np.uint8).reshape(n, 2, 4, 2, 16)  # [half, j, first/second 16, l]
    qs = np.zeros((n, 2, 2, 16), np.uint8)
    hm = np.zeros((n, 2, 16), np.uint8)
    for half in range(2):
        for j in range(4):
            qs[:, half] |= (u[:, half, j] & 3) << (2 * j)
            hm |= ((u[:, half, j] >> 2) & 1) << (4 * half + j)
    return np.concatenate([hm.reshape(n, 32), qs.reshape(n, 64), scales, _f16(d)], axis=1)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, s, m, q = _affine_scales(blocks.reshape(n, 16, 16), 3, 15)
    u = q.reshape(n, 2, 4, 2, 16)
    qs = np.zeros((n, 2, 2, 16), np.uint8)
    for half in range(2):
        for j in range(4):
            qs[:, half] |= u[:, half, j] << (2 * j)
    return np.concatenate([s | (m << 4), qs.reshape(n, 64), _f16(d), _f16(dmin)], axis=1)


# Random blocks: the fp16 fields (offsets in a block) and the values that give weights of mean ~0 and a
# standard deviation of about `std` when every other byte is uniformly random.
_RANDOM_SCALES: dict[Q, list[tuple[int, float]]] = {
    Q.Q4_0: [(0, 1 / 4.6)],
    Q.Q4_1: [(0, 1 / 4.6), (2, -7.5 / 4.6)],
    Q.Q5_0: [(0, 1 / 9.2)],
    Q.Q5_1: [(0, 1 / 9.2), (2, -15.5 / 9.2)],
    Q.Q8_0: [(0, 1 / 74.0)],
    Q.Q2_K: [(80, 1 / 10.0), (82, 1.5 / 10.0)],
    Q.Q3_K: [(108, 1 / 42.0)],
    Q.Q4_K: [(0, 1 / 320.0), (2, 7.5 / 320.0)],
    Q.Q5_K: [(0, 1 / 640.0), (2, 15.5 / 640.0)],
    Q.Q6_K: [(208, 1 / 1370.0)],
}


def random_blocks(qtype: int, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of random weights in ``qtype`` (throughput measurements only)."""
    qtype = Q(qtype)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float32)
        return quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset, factor in _RANDOM_SCALES[qtype]:
        raw[:, :, offset : offset + 2] = (
            np.full((rows, cols // block), std * factor, np.float16)
            .view(np.uint8)
            .reshape(rows, cols // block, 2)
        )
    return raw.reshape(rows, -1)
