"""A weight matrix kept in its file's format: GGUF quantized blocks, or 16-bit floats.

``QuantTensor`` is what the GGUF reader (and a 16-bit safetensors checkpoint) hands the model instead of a
float32 tensor: the file's bytes, row by row, plus the type. A row is a whole number of blocks, so row
slices (a tensor-parallel rank's heads, a vocabulary shard) are byte slices, and column slices are exact
when they fall on block boundaries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# Types the kernels compute in their compact form: quantized blocks, and 16-bit floats read row-major.
PACKED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
FLOAT16_TYPES = (Q.F16, Q.BF16)
KEPT_TYPES = PACKED_TYPES + FLOAT16_TYPES
TORCH_16BIT = {torch.float16: Q.F16, torch.bfloat16: Q.BF16}


def type_name(qtype: int) -> str:
    return Q(qtype).name


def block_size(qtype: int) -> int:
    """Weights per block along a row."""
    return gguf.GGML_QUANT_SIZES[Q(qtype)][0]


def row_bytes(qtype: int, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    return cols // block * size


@dataclass
class QuantTensor:
    """A [rows, cols] matrix as the file stores it: ``data`` is uint8 [rows, row_bytes].

    ``drop_source``, when set, takes the file pages ``data`` was read from out of the process: the model calls
    it (``source_packed``) once the bytes are repacked and the file's are never read again.
    """

    qtype: int
    data: torch.Tensor
    cols: int
    drop_source: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_16bit(cls, t: torch.Tensor) -> QuantTensor:
        """A float16/bfloat16 matrix's own bytes (no copy)."""
        t = t.contiguous()
        return cls(int(TORCH_16BIT[t.dtype]), t.view(torch.uint8).reshape(t.shape[0], -1), int(t.shape[1]))

    def source_packed(self) -> None:
        """The bytes are packed: the file pages they came from can go (``drop_source``)."""
        if self.drop_source is not None:
            self.drop_source()

    def row_slice(self, lo: int, hi: int) -> QuantTensor:
        return QuantTensor(self.qtype, self.data[lo:hi], self.cols, self.drop_source)

    def col_slice(self, lo: int, hi: int) -> QuantTensor:
        """Columns [lo, hi): whole blocks only (a quantized block cannot be split)."""
        block = block_size(self.qtype)
        if lo % block or hi % block:
            raise ValueError(
                f"columns [{lo}, {hi}) do not fall on the {block}-weight blocks of {type_name(self.qtype)}"
            )
        per = row_bytes(self.qtype, block)
        return QuantTensor(
            self.qtype, self.data[:, lo // block * per : hi // block * per], hi - lo, self.drop_source
        )

    def pad_rows(self, rows: int) -> QuantTensor:
        """Zero rows appended up to ``rows``: all-zero blocks (scale 0) dequantize to 0 in every format."""
        if rows <= self.rows:
            return self
        pad = torch.zeros((rows - self.rows, self.data.shape[1]), dtype=torch.uint8)
        return QuantTensor(self.qtype, torch.cat([self.data, pad]), self.cols, self.drop_source)

    def take_rows(self, order: torch.Tensor | np.ndarray) -> QuantTensor:
        """Rows reordered (llama.cpp's permuted q/k rows put back in Hugging Face order): a copy."""
        rows = self.data[torch.as_tensor(order)].contiguous()
        return QuantTensor(self.qtype, rows, self.cols, self.drop_source)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] through the gguf package's dequantizer."""
        if self.qtype == Q.BF16:
            return self.data.view(torch.bfloat16).float().reshape(self.rows, self.cols)
        arr = gguf.quants.dequantize(self.data.numpy(), Q(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.rows, self.cols)

    def to(self, *args, **kwargs) -> QuantTensor:
        """Unchanged: the file's format is kept whatever dtype the model computes in."""
        return self
