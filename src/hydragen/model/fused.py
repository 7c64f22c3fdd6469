"""Checkpoint tensors that hold several of the decoder's weights stacked by rows, read as their parts.

Phi-3 stores q, k and v as one ``self_attn.qkv_proj`` and gate and up as one ``mlp.gate_up_proj`` (llama.cpp:
``attn_qkv`` and a fused ``ffn_up``). A family declares which roles a fused tensor holds, in row order
(``Family.fused_tensors``); each part's rows follow from the config (q: heads x head size, k and v: KV heads
x head size, gate and up: the MLP width). The split happens where the tensors are read: each part appears
under its own role's name (``self_attn.q_proj.weight``, ...) as a row range of the stored tensor. So the
decoder packs q/k/v and gate/up as for any family, and tensor parallelism, which slices by those names,
reads each rank's heads and columns of each part and nothing else. A quantized part stays in its blocks
(a row is whole blocks: ``QuantTensor.row_slice``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydragen.model.config import ModelConfig
from hydragen.model.errors import ModelFileError
from hydragen.model.family import Family

# Rows of each role a fused tensor can hold.
ROLE_ROWS: dict[str, Callable[[ModelConfig], int]] = {
    "q": lambda c: c.num_heads * c.head_dim,
    "k": lambda c: c.num_kv_heads * c.head_dim,
    "v": lambda c: c.num_kv_heads * c.head_dim,
    "gate": lambda c: c.intermediate_size,
    "up": lambda c: c.intermediate_size,
}


@dataclass(frozen=True)
class Part:
    """Rows [lo, hi) of the stored tensor ``stored``, whose parts have ``total`` rows together."""

    stored: str
    lo: int
    hi: int
    total: int


def fused_parts(family: Family, cfg: ModelConfig, names: Iterable[str]) -> dict[str, Part]:
    """The part name -> where it lies, for every fused tensor (weight or bias) among ``names``."""
    present = set(names)
    out: dict[str, Part] = {}
    for role, roles in family.fused_tensors.items():
        rows = [ROLE_ROWS[r](cfg) for r in roles]
        for i in range(cfg.num_layers):
            for kind in ("weight", "bias"):
                stored = f"model.layers.{i}.{family.hf_tensor(role)}.{kind}"
                if stored not in present:
                    continue
                lo, total = 0, sum(rows)
                for r, n in zip(roles, rows, strict=True):
                    out[f"model.layers.{i}.{family.hf_tensor(r)}.{kind}"] = Part(stored, lo, lo + n, total)
                    lo += n
    return out


def _check_rows(part: Part, rows: int, where: Path) -> None:
    if rows != part.total:
        raise ModelFileError(
            where, f"tensor {part.stored!r} has {rows} rows, but its fused parts call for {part.total}"
        )


def _rows(t: Any, lo: int, hi: int) -> Any:
    return t.row_slice(lo, hi) if hasattr(t, "row_slice") else t[lo:hi]


def split_state(sd: dict[str, Any], family: Family, cfg: ModelConfig, where: Path) -> dict[str, Any]:
    """A state dict read whole, its fused tensors replaced by their parts (views: nothing is copied)."""
    parts = fused_parts(family, cfg, sd)
    if not parts:
        return sd
    for name, p in parts.items():
        t = sd[p.stored]
        _check_rows(p, int(t.shape[0]), where)
        sd[name] = _rows(t, p.lo, p.hi)
    for stored in {p.stored for p in parts.values()}:
        del sd[stored]
    return sd


class FusedFiles:
    """A checkpoint's tensors read on demand (``names``, ``read(name, dim, lo, hi)``: a GGUF's, a rank's
    safetensors), with each fused tensor read as its parts: a part's slice reads only the stored tensor's
    rows it needs. Everything else is the wrapped files'."""

    def __init__(self, files: Any, family: Family, cfg: ModelConfig, where: Path) -> None:
        self.files, self.where = files, where
        self._parts = fused_parts(family, cfg, files.names)
        stored = {p.stored for p in self._parts.values()}
        self.names = [n for n in files.names if n not in stored] + list(self._parts)
        self._checked: set[str] = set()

    def __getattr__(self, name: str) -> Any:  # keeps_quantized(), elements(), ... of the wrapped files
        if name == "files":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.files, name)

    def _part(self, name: str) -> Part | None:
        p = self._parts.get(name)
        shape = getattr(self.files, "shape", None)
        if p is not None and shape is not None and p.stored not in self._checked:
            _check_rows(p, int(shape(p.stored)[0]), self.where)
            self._checked.add(p.stored)
        return p

    def shape(self, name: str) -> tuple[int, ...]:
        p = self._part(name)
        if p is None:
            return tuple(self.files.shape(name))
        return (p.hi - p.lo, *tuple(self.files.shape(p.stored))[1:])

    def block(self, name: str) -> int:
        p = self._part(name)
        return self.files.block(name if p is None else p.stored)

    def read(self, name: str, dim: int | None = None, lo: int = 0, hi: int = 0) -> Any:
        p = self._part(name)
        if p is None:
            return self.files.read(name, dim, lo, hi)
        if dim is None:
            return self.files.read(p.stored, 0, p.lo, p.hi)
        if dim == 0:
            return self.files.read(p.stored, 0, p.lo + lo, p.lo + hi)
        return _rows(self.files.read(p.stored, 1, lo, hi), p.lo, p.hi)  # columns of every row, then ours

    def on_demand(self):
        """The tensors as a state dict that reads each one when the model takes it (model/gguf.py)."""
        from hydragen.model.gguf import TensorsOnDemand

        return TensorsOnDemand(self)


def read_parts(source: Any, family: Family, cfg: ModelConfig, where: Path) -> Any:
    """What ``DecoderModel.load_hf_state_dict`` pops: a state dict read whole (split in place), or a GGUF's
    tensors read on demand, fused tensors as their parts either way."""
    if isinstance(source, dict):
        return split_state(source, family, cfg, where)
    return FusedFiles(source, family, cfg, where).on_demand()
