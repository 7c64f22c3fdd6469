"""The model's projections and token table, in float or kept in the checkpoint's compact format.

A projection computes ``x @ W^T`` with the neighbours the model always runs around it fused in, so that a
decoder layer is four calls: RMSNorm before (``norm``), and after, one of rotary embedding of the leading
q/k columns (``rope``), SwiGLU (``swiglu``), or accumulation into the residual stream (``residual``,
updated in place). Two implementations share that call:

* ``DenseProjection``: a float weight in the model's dtype, torch ops (safetensors in the model dtype,
  random weights, CUDA, and GGUF files when the C++ ops are unavailable or ``dequantize=True``);
* ``PackedProjection``: one or more parts (q, k, v may differ in type, as in Q4_K_M) in GGUF quantized
  blocks repacked for the C++ kernels, or 16-bit floats as stored, one C++ call (hydragen/native/quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hydragen.model.qtensor import PACKED_TYPES, Q, QuantTensor
from hydragen.native import quant

# rope: (cos, signed sin) [T, head_dim] tables and how many leading output columns to rotate
Rope = tuple[torch.Tensor, torch.Tensor, int]


@dataclass(frozen=True)
class QkvHeads:
    """How a q/k/v projection's output splits into heads, and its QK-norm weights (Qwen3, Gemma 3) when the
    model has them: what a packed projection's epilogue needs to add the bias, norm each head of q and k
    and rotate each head's leading columns (all of them, or Phi-4-mini's 96 of 128) in one C++ call, the
    one the layer stack makes (native/csrc/quant_matmul.cpp, ``hq::QkvEpilogue``)."""

    head_dim: int
    q_cols: int
    k_cols: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the weight multiplies in x's dtype (Llama's order), or, a float32 weight on 16-bit
    x (Gemma's norms), in float32 before the one rounding to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:
        return (weight.float() * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def rotate_leading(y: torch.Tensor, rope: Rope, head_dim: int | None = None) -> torch.Tensor:
    """The first ``cols`` columns of y [T, N] rotated per head (rotate-half), the rest unchanged.

    Heads are ``head_dim`` columns (default: the tables' width). With wider heads than the tables (partial
    rotary: Phi-4-mini rotates 96 of 128) only each head's leading table-width columns rotate, rotate-half
    within them, and the rest of the head passes through."""
    cos, sin, cols = rope
    d = cos.shape[-1]
    head = head_dim or d
    t = y.shape[0]
    x = y[:, :cols].view(t, cols // head, head)
    part = x if head == d else x[..., :d]
    swapped = torch.cat([part[..., d // 2 :], part[..., : d // 2]], dim=-1)
    rotated = part * cos.unsqueeze(1) + swapped * sin.unsqueeze(1)
    if head != d:
        rotated = torch.cat([rotated, x[..., d:]], dim=-1)
    return torch.cat([rotated.reshape(t, cols), y[:, cols:]], dim=1)


class DenseProjection(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        rope: Rope | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        if norm is not None:
            x = rms_norm(x, norm, eps)
        y = F.linear(x, self.weight, self.bias)
        if rope is not None:
            y = rotate_leading(y, (rope[0].to(y.dtype), rope[1].to(y.dtype), rope[2]))
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        if residual is not None:
            return residual.add_(y)
        return y


class PackedProjection(nn.Module):
    """Parts kept in their file format; float32 in and out (another dtype is converted around the call)."""

    def __init__(
        self,
        qtypes: list[int],
        rows: list[int],
        in_features: int,
        buffers: list[torch.Tensor],
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.qtypes, self.rows, self.in_features = qtypes, rows, in_features
        for i, data in enumerate(buffers):
            self.register_buffer(f"part{i}", data, persistent=False)
        self.weights = list(buffers)  # the same tensors, as the op takes them (packed modules never move)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.isa, self.act_bits = quant.requested_isa(), quant.requested_act_bits()

    @classmethod
    def from_parts(cls, parts: list[QuantTensor], bias: torch.Tensor | None = None) -> PackedProjection:
        """Packs the parts (neighbours of one type become one matrix: fewer, longer runs), then lets each part
        drop the file pages it was read from."""
        groups: list[list[QuantTensor]] = []
        for p in parts:
            if groups and groups[-1][0].qtype == p.qtype and groups[-1][0].cols == p.cols:
                groups[-1].append(p)
            else:
                groups.append([p])
        buffers = [stacked_bytes(g) for g in groups]
        _sources_packed(parts, buffers)
        rows = [sum(p.rows for p in g) for g in groups]
        return cls([g[0].qtype for g in groups], rows, parts[0].cols, buffers, bias)

    @property
    def out_features(self) -> int:
        return sum(self.rows)

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        rope: Rope | None = None,
        swiglu: bool = False,
        heads: QkvHeads | None = None,
    ) -> torch.Tensor:
        """``heads``: this is a q/k/v projection, and its bias, QK-norm and ``rope`` run as its epilogue
        (``QkvHeads``; not with ``residual`` or ``swiglu``)."""
        dtype = x.dtype
        if heads is not None:
            return self._qkv(x, norm, eps, rope, heads).to(dtype)
        if self.bias is not None:  # (Qwen2's q/k/v) the bias goes before the epilogue: only norm is fused
            y = self(x, norm=norm, eps=eps) + self.bias
            y = y if rope is None else rotate_leading(y, rope)
            y = F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1] if swiglu else y
            return y.to(dtype) if residual is None else residual.add_(y.to(dtype))
        if dtype != torch.float32:  # the kernels take float32: convert around them
            y = self(
                x.float(),
                norm=None if norm is None else norm.float(),
                eps=eps,
                rope=_float(rope),
                swiglu=swiglu,
            )
            return y.to(dtype) if residual is None else residual.add_(y.to(dtype))
        cos, sin, cols = rope if rope is not None else (None, None, 0)
        return _quant_linear(
            x.contiguous(),
            self.weights,
            self.qtypes,
            self.rows,
            norm,
            eps,
            residual,
            cos,
            sin,
            cols,
            swiglu,
            self.act_bits,
            self.isa,
        )

    def _qkv(self, x: torch.Tensor, norm, eps: float, rope: Rope | None, heads: QkvHeads) -> torch.Tensor:
        y = _quant_linear(
            x.float().contiguous(), self.weights, self.qtypes, self.rows, _f32(norm), eps, None, None, None,
            0, False, self.act_bits, self.isa,
        )  # fmt: skip
        cos, sin = (None, None) if rope is None else (_f32(rope[0]), _f32(rope[1]))
        q_norm, k_norm = _f32(heads.q_norm), _f32(heads.k_norm)
        return torch.ops.hydragen.qkv_epilogue(
            y, self.bias, q_norm, k_norm, eps, heads.head_dim, heads.q_cols, heads.k_cols, cos, sin
        )


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class PackedEmbedding(nn.Module):
    """A token table kept in its file format: looked up row by row (the tied LM head reads the same bytes)."""

    def __init__(self, table: QuantTensor):
        super().__init__()
        self.qtype, self.cols, self.num_embeddings = table.qtype, table.cols, table.rows
        self.register_buffer("table", packed_bytes(table), persistent=False)
        _sources_packed([table], [self.table])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype in PACKED_TYPES:
            return quant.rows(self.table, self.qtype, self.cols, ids)
        return self.table[ids].view(torch.bfloat16 if self.qtype == Q.BF16 else torch.float16).float()

    def as_projection(self) -> PackedProjection:
        """The tied LM head over the same bytes (no second copy)."""
        return PackedProjection([self.qtype], [self.num_embeddings], self.cols, [self.table])


def packed_bytes(t: QuantTensor) -> torch.Tensor:
    """What the kernels read: quantized rows repacked into 16-row tiles, 16-bit rows as stored."""
    return stacked_bytes([t])


def stacked_bytes(parts: list[QuantTensor]) -> torch.Tensor:
    """What the kernels read of parts of one type stacked by rows: quantized rows packed into 16-row tiles
    from where they lie (no stacked copy of the file's bytes first), 16-bit rows as stored (one part: its own
    bytes)."""
    data = [p.data for p in parts]
    if parts[0].qtype in PACKED_TYPES:
        return quant.pack_stacked(data, parts[0].qtype)
    return data[0].contiguous() if len(data) == 1 else torch.cat(data)


def _sources_packed(parts: list[QuantTensor], buffers: list[torch.Tensor]) -> None:
    """Each part's file pages can go once it is packed, unless a buffer is the part's own bytes (a 16-bit
    matrix kept as stored, read in place at run time)."""
    in_place = {b.data_ptr() for b in buffers}
    for p in parts:
        if p.data.data_ptr() not in in_place:
            p.source_packed()


def _float(rope: Rope | None) -> Rope | None:
    return None if rope is None else (rope[0].float(), rope[1].float(), rope[2])


def _quant_linear(*args):
    return torch.ops.hydragen.quant_linear(*args)


Projection = DenseProjection | PackedProjection


def mlp_tail(
    o: Projection,
    gate_up: Projection,
    down: Projection,
    attn: torch.Tensor,
    h: torch.Tensor,
    norm,
    eps: float,
) -> torch.Tensor:
    """h + o(attn), then + down(swiglu(gate_up(norm(h)))): a decoder layer after attention, h updated in
    place. One C++ call when all three are packed (float32, no bias), else the three projections."""
    if (
        all(isinstance(p, PackedProjection) and p.bias is None for p in (o, gate_up, down))
        and h.dtype == torch.float32
    ):
        return torch.ops.hydragen.quant_mlp_tail(
            attn.contiguous(), h, o.weights, o.qtypes, o.rows, norm, eps,
            gate_up.weights, gate_up.qtypes, gate_up.rows, down.weights, down.qtypes, down.rows,
            o.act_bits, o.isa,
        )  # fmt: skip
    h = o(attn, residual=h)
    return down(gate_up(h, norm=norm, eps=eps, swiglu=True), residual=h)


def keeps_quantized_weights(model: nn.Module) -> bool:
    """Whether any projection of ``model`` computes from GGUF quantized blocks (not floats, not 16-bit rows
    kept as they are): what the KV cache's "auto" dtype follows (model/loader.py, resolve_kv_dtype)."""
    return any(
        isinstance(m, PackedProjection) and any(t in PACKED_TYPES for t in m.qtypes) for m in model.modules()
    )
