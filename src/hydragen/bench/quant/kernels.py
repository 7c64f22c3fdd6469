"""The kernel table of ``hydragen bench quant``: every weight format hydragen computes in, at M = 1, 8, 64
and 512 activation rows, against the machine's measured memory bandwidth and float32 GEMM rate, beside the
candidates it was chosen over.

hydragen's kernels run with their default 15-bit activations, and for the formats of the embedded
model and of Q4_K_M also with int8 activations. One N x K matrix per format (4,096 x 4,096 by default: a
7B model's attention projection), in enough copies that the copies cycled through overflow the last-level
cache: every call reads its weights from memory, as a decode step of a real model does. GB/s counts the
weight bytes one call reads; GFLOP/s counts 2 M N K.

Candidates beside hydragen's kernels (native/csrc/quant_*):
* float32 weights through torch (``F.linear``, oneDNN): what hydragen ran before (GGUF dequantized at load);
* torch's int4 op (``_weight_int4pack_mm_for_cpu``, bfloat16 activations, groups of 32): the 4-bit formats'
  alternative inside torch;
* bfloat16 weights through torch with bfloat16 activations (oneDNN, AVX-512 BF16 where the CPU has it):
  the alternative for 16-bit checkpoints, whose kernel here keeps activations float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from hydragen.model.gguf_quantize import random_blocks
from hydragen.model.qtensor import PACKED_TYPES
from hydragen.native import quant

Q = gguf.GGMLQuantizationType
FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16)
ROWS = (1, 8, 64, 512)
# Formats also measured with int8 activations (HYDRAGEN_QUANT_ACT_BITS=8): the embedded model's and Q4_K_M's
INT8_TOO = (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)
CYCLED_BYTES = 192 * 2**20  # at least this much weight memory cycled through: 6x a 32 MB L3


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s that a sum over a large float32 tensor reads (every thread torch uses): the ceiling for a
    kernel that streams its weights once."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats)


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cycled(calls: list[Callable[[], object]], repeats: int) -> float:
    """Seconds per call, the best of ``repeats`` passes over every copy."""
    return _best(lambda: [c() for c in calls], repeats) / len(calls)


def _copies(bytes_each: int) -> int:
    return max(2, -(-CYCLED_BYTES // bytes_each))


def format_rows(n: int, k: int, rows: tuple[int, ...], repeats: int, seed: int = 0) -> list[dict]:
    """hydragen's kernel for every format at each M."""
    rng = np.random.default_rng(seed)
    out = []
    for qtype in FORMATS:
        one = torch.from_numpy(random_blocks(qtype, n, k, 0.02, rng))
        # every copy packed as a model's weights are (on 2 MiB pages where the system gives them)
        place = partial(quant.pack, one, qtype) if qtype in PACKED_TYPES else one.clone
        data = place()
        copies = [data] + [place() for _ in range(_copies(data.numel()) - 1)]
        widths = (15, 8) if qtype in INT8_TOO else (15,)
        for m in rows:
            x = torch.randn(m, k)
            for bits in widths:
                calls = [
                    lambda w=w, x=x, t=int(qtype), b=bits: quant.linear(x, [w], [t], [n], act_bits=b)
                    for w in copies
                ]
                t = _cycled(calls, repeats if m < 512 else max(1, repeats // 3))
                kernel = "hydragen" if bits == 15 else "hydragen, int8 activations"
                out.append(_row(qtype.name, kernel, m, n, k, data.numel(), t))
    return out


def candidate_rows(n: int, k: int, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """The alternatives the kernels were measured against."""
    out = []
    dense = torch.randn(n, k) * 0.02
    copies = [dense.clone() for _ in range(_copies(dense.numel() * 4))]
    for m in rows:
        x = torch.randn(m, k)
        t = _cycled(
            [lambda w=w, x=x: F.linear(x, w) for w in copies], repeats if m < 512 else max(1, repeats // 3)
        )
        out.append(_row("F32", "torch float32 (before)", m, n, k, n * k * 4, t))
    del copies
    w4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4, 2)
    scales = (torch.rand(k // 32, n, 2) * 0.01).to(torch.bfloat16)
    int4 = [(packed.clone(), scales.clone()) for _ in range(_copies(packed.numel() + scales.numel() * 2))]
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        calls = [
            lambda p=p, s=s, x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, s) for p, s in int4
        ]
        t = _cycled(calls, repeats if m < 512 else max(1, repeats // 3))
        out.append(
            _row("int4 (Q4_0-like)", "torch int4 op, bf16 activations", m, n, k, n * k // 2 + n * k // 16, t)
        )
    del int4
    bf = [dense.to(torch.bfloat16) for _ in range(_copies(n * k * 2))]
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        t = _cycled(
            [lambda w=w, x=x: F.linear(x, w) for w in bf], repeats if m < 512 else max(1, repeats // 3)
        )
        out.append(_row("BF16", "torch bf16, bf16 activations", m, n, k, n * k * 2, t))
    return out


def _row(fmt: str, kernel: str, m: int, n: int, k: int, weight_bytes: int, seconds: float) -> dict:
    return {
        "format": fmt,
        "kernel": kernel,
        "M": m,
        "ms": seconds * 1e3,
        "GB/s": weight_bytes / seconds / 1e9,
        "GFLOP/s": 2 * m * n * k / seconds / 1e9,
        "bits/weight": 8 * weight_bytes / (n * k),
    }


def kernel_table(
    n: int, k: int, rows: tuple[int, ...], repeats: int, bandwidth: float, gemm: float
) -> list[dict]:
    """Every row with its share of the machine's bandwidth and float32 GEMM rate."""
    table = format_rows(n, k, rows, repeats) + candidate_rows(n, k, rows, repeats)
    for r in table:
        r["% of bandwidth"] = 100 * r["GB/s"] * 1e9 / bandwidth
        r["% of fp32 GEMM"] = 100 * r["GFLOP/s"] * 1e9 / gemm
    return table


KERNEL_COLUMNS = [
    "format",
    "kernel",
    "M",
    "ms",
    "GB/s",
    "% of bandwidth",
    "GFLOP/s",
    "% of fp32 GEMM",
    "bits/weight",
]
