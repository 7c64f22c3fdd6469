"""Load one rank's shard of a checkpoint, reading only its slices from disk.

safetensors files are opened lazily and sliced (``safe_open(...).get_slice``); ``pytorch_model*.bin`` files
are memory-mapped (``torch.load(mmap=True)``) and sliced. A GGUF's quantized tensors are sliced as blocks
(rows are byte ranges, columns whole blocks: sharding.SplitBlocks) and stay quantized, as 16-bit weights
stay 16-bit; with ``dequantize`` they are dequantized only for the rows wanted (a column slice a few rows
at a time). So no rank ever holds the whole model, only, for a moment, one slice of one tensor on top of
its shard.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hydragen.model.config import ModelConfig
from hydragen.model.errors import ModelFileError, first_line
from hydragen.model.fused import FusedFiles
from hydragen.model.heap import release_freed_memory
from hydragen.model.loader import (
    build_model,
    keeps_compact,
    kept_16bit,
    parse_config,
    random_config,
    random_gguf_or,
    random_model,
    read_hf_config,
    resolve_model_path,
    weight_files,
)
from hydragen.model.qtensor import QuantTensor
from hydragen.model.registry import family_named
from hydragen.tp.sharded_model import ShardedDecoderModel
from hydragen.tp.sharding import Shard, SplitBlocks


class SafetensorsFiles:
    """Tensors of a directory's *.safetensors files, read slice by slice."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._where: dict[str, object] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # a damaged header raises the library's own error types
                raise ModelFileError(
                    f, f"unreadable weights file, truncated or corrupt ({first_line(e)})"
                ) from None
            for name in handle.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                self._where[name] = handle
        self.names = list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, lo: int, hi: int) -> torch.Tensor:
        handle = self._where[name]
        if dim is None:
            return handle.get_tensor(name)
        piece = handle.get_slice(name)
        return piece[lo:hi] if dim == 0 else piece[:, lo:hi]


class TorchBinFiles:
    """Tensors of pytorch_model*.bin files, memory-mapped: a slice copies only its own bytes."""

    def __init__(self, files: list[Path]):
        self._tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                self._tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:  # pickle and zip each raise their own types for a damaged file
                raise ModelFileError(
                    f, f"unreadable weights file, truncated or corrupt ({first_line(e)})"
                ) from None
        self.names = list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, dim: int | None, lo: int, hi: int) -> torch.Tensor:
        t = self._tensors[name]
        if dim is None:
            return t.clone()
        return (t[lo:hi] if dim == 0 else t[:, lo:hi]).clone()


class ShardState:
    """What ``DecoderModel.load_hf_state_dict`` pops by name, each tensor cut to this rank's slice as read
    (``keep``: 16-bit safetensors slices stay 16-bit; a GGUF's files decide for themselves)."""

    def __init__(self, files, shard: Shard, dtype: torch.dtype, keep: bool = False):
        self.files, self.shard, self.dtype, self.keep = files, shard, dtype, keep
        self._left = dict.fromkeys(files.names)

    def __iter__(self):
        return iter(list(self._left))

    def __contains__(self, name: object) -> bool:
        return name in self._left

    def pop(self, name: str, *default):
        if name not in self._left:
            if default:
                return default[0]
            raise KeyError(name)
        del self._left[name]
        piece = self.shard.piece(name)
        t = kept_16bit(self.files.read(name, piece.dim, piece.lo, piece.hi), self.keep)
        if isinstance(t, QuantTensor):
            return t if piece.pad_to is None else t.pad_rows(piece.pad_to)
        t = t.to(self.dtype)
        if piece.pad_to is not None and t.shape[0] < piece.pad_to:
            pad = torch.zeros((piece.pad_to - t.shape[0], *t.shape[1:]), dtype=t.dtype)
            t = torch.cat([t, pad])
        return t


def read_config(model: str | Path | None, keep: bool = False) -> tuple[ModelConfig, Path, SplitBlocks]:
    """The model's config and the block sizes a split must respect, from its header alone (no weights read):
    enough to check a split."""
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from hydragen.model.gguf import open_gguf_tensors

        hf_cfg, files = open_gguf_tensors(path, keep)
        cfg = parse_config(hf_cfg, path)
        return cfg, path, split_blocks(files, cfg) if keep else SplitBlocks()
    return parse_config(read_hf_config(path), path / "config.json"), path, SplitBlocks()


def split_blocks(files, cfg: ModelConfig) -> SplitBlocks:
    """The largest block along the input of any layer's down and o projection (1 when all are float)."""
    blocks = {"down": 1, "o": 1}
    for i in range(cfg.num_layers):
        for kind, name in (("down", "mlp.down_proj"), ("o", "self_attn.o_proj")):
            blocks[kind] = max(blocks[kind], files.block(f"model.layers.{i}.{name}.weight"))
    return SplitBlocks(**blocks)


def load_shard(
    model: str | Path | None,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    random_weights: bool = False,
    dequantize: bool = False,
) -> tuple[ShardedDecoderModel, ModelConfig, Path, Shard]:
    """(this rank's model shard, the full config, the resolved path, the shard's description).

    ``random_weights``: each rank draws its own slices (seeded by rank): the right shapes for throughput
    measurements, but not the same numbers as a TP = 1 random model. A random spec naming a quantization
    (``llama-3.1-8b:Q4_K_M``) is a random GGUF file, sliced like any other. ``dequantize``: as in
    ``load_model``.
    """
    model, random_weights = random_gguf_or(model, random_weights)
    if random_weights:
        cfg, path = random_config(model)
        shard = Shard(cfg, rank, world)
        net = random_model(shard.local_config(), device, dtype, seed=rank, model_class=ShardedDecoderModel)
        return net, cfg, path, shard
    path = resolve_model_path(model)
    keep = keeps_compact(device, dtype, dequantize)
    blocks = SplitBlocks()
    if path.suffix == ".gguf":
        from hydragen.model.gguf import open_gguf_tensors

        hf_cfg, files = open_gguf_tensors(path, keep)
        cfg = parse_config(hf_cfg, path)
        blocks = split_blocks(files, cfg) if keep else blocks
    else:
        cfg = parse_config(read_hf_config(path), path / "config.json")
        found = weight_files(path)
        files = SafetensorsFiles(found) if found[0].suffix == ".safetensors" else TorchBinFiles(found)
    shard = Shard(cfg, rank, world, blocks)
    files = FusedFiles(files, family_named(cfg.family), cfg, path)  # fused tensors (Phi-3's qkv) as parts
    state = ShardState(files, shard, dtype, keep and dtype == torch.float32)
    net = build_model(shard.local_config(), state, device, dtype, path, model_class=ShardedDecoderModel)
    release_freed_memory()
    net.setup_rotary(device)
    net.eval()
    return net, cfg, path, shard
