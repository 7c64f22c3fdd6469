"""The pure-torch twin and oracle of the quantized projection (``hydragen::quant_linear``).

It computes what the C++ op computes, from independent pieces: the weights dequantized from the file's own
blocks by the gguf package (not from hydragen's repacked tiles), and the activations quantized the same way
as the kernels do (int8 per group of 32, scale max|x| / 127, round half to even), then an ordinary matmul in
float64. The op's result differs from it only by float32 summation order; the tests hold every format and
every instruction-set path to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hydragen.model.linear import rotate_leading
from hydragen.model.qtensor import PACKED_TYPES, QuantTensor

QMAX = {8: 127.0, 15: 16191.0}  # the kernels' largest activation integer per width (quant_matmul.cpp)


def quantize_activations(x: torch.Tensor, bits: int = 15) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as the kernels see it: groups of 32 rounded to integers of ``bits``
    bits (scale max|x| / QMAX, half to even) and scaled back, float32."""
    m, k = x.shape
    groups = x.float().reshape(m, k // 32, 32)
    d = groups.abs().amax(-1, keepdim=True) / QMAX[bits]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(groups * inv) * d).reshape(m, k)


def kernel_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op's RMSNorm: the mean of squares in float64, then float32 (the same bits as the C++ op)."""
    r = (1.0 / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)).float()
    return weight * (x * r)


def quant_linear_reference(
    x: torch.Tensor,
    parts: list[QuantTensor],
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    swiglu: bool = False,
    act_bits: int = 15,
) -> torch.Tensor:
    """What ``hydragen.native.quant.linear`` returns for these parts in the file's layout (float32)."""
    x = x.float()
    if norm is not None:
        x = kernel_rms_norm(x, norm.float(), eps)
    outs = []
    for p in parts:
        xin = quantize_activations(x, act_bits) if p.qtype in PACKED_TYPES else x
        outs.append(F.linear(xin.double(), p.dequantize().double()))
    y = torch.cat(outs, dim=1).float()
    if rope is not None:
        y = rotate_leading(y, rope)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y


class TwinProjection(torch.nn.Module):
    """``PackedProjection``'s twin: the same call, computed by ``quant_linear_reference`` from the parts in
    the file's layout. Slow (it dequantizes every call); the tests swap it in for a whole model."""

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None, act_bits: int = 15):
        super().__init__()
        self.parts, self.bias, self.act_bits = parts, bias, act_bits

    def forward(self, x, *, norm=None, eps=0.0, residual=None, rope=None, swiglu=False) -> torch.Tensor:
        bits = self.act_bits
        if self.bias is None:
            y = quant_linear_reference(
                x, self.parts, norm=norm, eps=eps, rope=rope, swiglu=swiglu, act_bits=bits
            )
        else:
            y = quant_linear_reference(x, self.parts, norm=norm, eps=eps, act_bits=bits) + self.bias.float()
            y = y if rope is None else rotate_leading(y, rope)
        if residual is not None:
            return residual.add_(y.to(residual.dtype))
        return y.to(x.dtype)


class TwinEmbedding(torch.nn.Module):
    """``PackedEmbedding``'s twin: rows dequantized by the gguf package."""

    def __init__(self, table: QuantTensor):
        super().__init__()
        self.table, self.num_embeddings = table, table.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize()[ids]

    def as_projection(self) -> TwinProjection:
        return TwinProjection([self.table])
