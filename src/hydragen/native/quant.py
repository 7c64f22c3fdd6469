"""The quantized-matmul ops (``native/csrc/quant_*.cpp``) from Python: repacking GGUF rows, reading rows
back, the fused projection, and which instruction set runs them.

The kernels pick the best instruction set the CPU has at run time (AVX-512 VNNI, AVX-VNNI, AVX2, or portable
C++). ``HYDRAGEN_QUANT_ISA=avx2`` (or ``avxvnni``, ``scalar``) caps it lower, so a machine that has AVX-512
can check every slower path; a cap above what the CPU has changes nothing.

Activations are quantized per group of 32 before the integer dot products: to 15 bits by default (two int8
planes, two dot instructions per step), or to int8 as llama.cpp does (``HYDRAGEN_QUANT_ACT_BITS=8``: faster
when compute-bound, but an int8 step is large enough that float32 rounding differences between batch shapes
flip it and change tokens; docs/quantization.md has both measured).
"""

from __future__ import annotations

import os

import torch

from hydragen.native.build import load_ops

ISA_LEVELS = {"scalar": 1, "avx2": 2, "avxvnni": 3, "avx512": 4}
ISA_NAMES = {level: name for name, level in ISA_LEVELS.items()}
DEFAULT_ACT_BITS = 15


def requested_isa() -> int:
    """The cap from ``HYDRAGEN_QUANT_ISA`` (0: none); an unknown name is an error naming the choices."""
    name = os.environ.get("HYDRAGEN_QUANT_ISA", "").strip().lower()
    if not name:
        return 0
    if name not in ISA_LEVELS:
        raise ValueError(f"HYDRAGEN_QUANT_ISA={name!r} is not one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[name]


def requested_act_bits() -> int:
    """Activation bits from ``HYDRAGEN_QUANT_ACT_BITS`` (15 by default, or 8)."""
    value = os.environ.get("HYDRAGEN_QUANT_ACT_BITS", "").strip() or str(DEFAULT_ACT_BITS)
    if value not in ("8", "15"):
        raise ValueError(f"HYDRAGEN_QUANT_ACT_BITS={value!r} must be 8 or 15")
    return int(value)


def available() -> bool:
    """Whether the C++ ops (and so quantized weights kept quantized) can run here."""
    return load_ops() is not None


def isa_name(requested: int | None = None) -> str:
    """The instruction set the kernels use: the CPU's best, capped by ``requested`` (default: the env)."""
    best = int(_ops().quant_isa())
    cap = requested_isa() if requested is None else requested
    return ISA_NAMES[min(best, cap) if cap else best]


def _ops():
    ops = load_ops()
    if ops is None:
        from hydragen.native.build import build_error

        raise RuntimeError(f"hydragen's C++ ops are unavailable: {build_error()}")
    return ops


def huge_pages() -> bool:
    """Whether packed weights go on 2 MiB pages (``native/csrc/weight_arena.h``); ``HYDRAGEN_HUGE_PAGES=0``
    keeps them on ordinary pages."""
    value = os.environ.get("HYDRAGEN_HUGE_PAGES", "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"HYDRAGEN_HUGE_PAGES={value!r} must be 1 or 0")


def pack(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The file's rows [rows, row_bytes] (uint8) -> hydragen's 16-row tiles (native/csrc/quant_layout.h)."""
    return pack_stacked([raw], qtype)


def pack_stacked(parts: list[torch.Tensor], qtype: int) -> torch.Tensor:
    """Matrices of one type stacked by rows, packed as one, each read where it lies (no stacked copy first):
    uint8 [rows_i, row_bytes] parts whose rows are contiguous (a column slice's rows are strided: fine)."""
    rows_contiguous = [p if p.stride(-1) == 1 else p.contiguous() for p in parts]
    return _ops().quant_pack(rows_contiguous, int(qtype), huge_pages())


def rows(packed: torch.Tensor, qtype: int, cols: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a packed matrix as float32 [len(ids), cols] (an embedding lookup)."""
    return _ops().quant_rows(packed, int(qtype), int(cols), ids)


def linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    qtypes: list[int],
    rows_per_part: list[int],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    swiglu: bool = False,
    act_bits: int = DEFAULT_ACT_BITS,
    isa: int = 0,
) -> torch.Tensor:
    """``x @ W^T`` over the parts' concatenated outputs (float32), with RMSNorm before and rotary / SwiGLU /
    residual accumulation after (see quant_matmul.cpp). ``residual`` is updated in place and returned."""
    cos, sin, cols = rope if rope is not None else (None, None, 0)
    return _ops().quant_linear(
        x, weights, qtypes, rows_per_part, norm, eps, residual, cos, sin, cols, swiglu, act_bits, isa
    )
