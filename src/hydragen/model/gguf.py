"""Read a llama.cpp GGUF file into a Hugging Face-style config and state dict.

The state dict uses the family's HF names and layouts whatever the file: the model never sees GGUF names.
Weights in a type the kernels compute in (model/qtensor.py: the legacy and K-quants, F16, BF16) stay in it
as ``QuantTensor``s over the file's memory map (``keep=True``, the CPU default); otherwise every tensor is
dequantized to float32 (``keep=False``: CUDA, no C++ compiler, or ``LLM(..., dequantize=True)``).
A tensor's file pages leave the process once its bytes are copied out (model/file_pages.py): at once for a
float or reordered copy, and for a quantized matrix kept as it is, when the model has packed it.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from hydragen.model.errors import ModelFileError, first_line
from hydragen.model.family import Family
from hydragen.model.file_pages import FileMap
from hydragen.model.qtensor import KEPT_TYPES, PACKED_TYPES, QuantTensor, block_size, row_bytes
from hydragen.model.registry import family_for_gguf, supported_gguf

# folded into config["rope_scaling"] instead: llama3's rope_freqs, LongRoPE's two factor sets (phi3)
_SKIP = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_DEFAULT_ORIG_CTX = 8192  # llama3 rope: any value works, only L/(hi-lo) and lo/(hi-lo) matter (see below)


class _PastEnd(Exception):
    """A read past the end of the file: the header or tensor table points beyond the last byte."""

    def __init__(self, end: int, in_tensor_data: bool) -> None:
        super().__init__(end)
        self.end, self.in_tensor_data = end, in_tensor_data


class _Reader(gguf.GGUFReader):
    """GGUFReader slicing a plain ndarray view of its memmap: same bytes, but skips memmap's Python-level
    ``__array_finalize__`` on each of the ~250k header reads a 49k-token vocab needs (3.5 s -> 1.3 s).

    Every read is bounds-checked, so a truncated file is reported as such instead of as a numpy shape error.
    """

    _in_tensor_data = False
    _itemsize: dict[Any, int] = {}

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
        if isinstance(self.data, np.memmap):
            self.data = self.data.view(np.ndarray)
        count = int(count)
        if (size := self._itemsize.get(dtype)) is None:
            size = self._itemsize[dtype] = np.dtype(dtype).itemsize
        end = int(offset) + size * count
        if end > len(self.data):
            raise _PastEnd(end, self._in_tensor_data)
        arr = self.data[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, *args: Any, **kwargs: Any) -> None:
        self._in_tensor_data = True
        super()._build_tensors(*args, **kwargs)


def hf_name(name: str, family: Family) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to the family's HF parameter name (``Family.hf_name``,
    the mapping the writer lays files out by)."""
    return family.hf_name(name)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head it interleaves the two rotate-half halves
    (x0,y0,x1,y1,..) for its GPT-J-style RoPE; HF's rotate-half RoPE wants (x0,x1,..,y0,y1,..)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# What a damaged header makes the gguf package's parser raise (it reads past the end, or finds impossible
# counts, lengths or type codes).
_HEADER_ERRORS = (
    ValueError,
    IndexError,
    KeyError,
    OverflowError,
    MemoryError,
    UnicodeDecodeError,
    struct.error,
)


def open_gguf(path: str | Path) -> _Reader:
    """Parse a GGUF header, turning every way a file can be broken into a one-line ModelFileError.

    Checked here: empty file, wrong magic, a header that is cut short or holds impossible values, tensor
    type codes the gguf package does not know, and data that runs past the end of the file (the usual sign
    of an interrupted download).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(path, f"cannot be read ({first_line(e)})") from None
    if size == 0:
        raise ModelFileError(path, "the file is empty")
    if magic != b"GGUF":
        raise ModelFileError(
            path, f"not a GGUF file (it starts with {magic!r}; a GGUF file starts with b'GGUF')"
        )
    try:
        reader = _Reader(str(path))
    except _PastEnd as e:
        if e.in_tensor_data:
            raise ModelFileError(
                path,
                f"truncated: its tensor data runs to byte {e.end:,} but the file has {size:,} bytes "
                "(an interrupted download or copy?)",
            ) from None
        raise ModelFileError(
            path, f"truncated or corrupt: its header runs past the end of the file ({size:,} bytes)"
        ) from None
    except _HEADER_ERRORS as e:
        why = first_line(e)
        if "GGMLQuantizationType" in why:
            raise ModelFileError(
                path,
                f"a tensor has an unknown type code ({why}): the file is corrupt or newer than this gguf",
            ) from None
        if why.startswith("Sorry, file appears to be version"):
            raise ModelFileError(path, f"unsupported GGUF version ({why})") from None
        raise ModelFileError(path, f"truncated or corrupt GGUF header ({why})") from None
    return reader


@cache
def _can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_quantization(path: Path, tensors: dict[str, Any], keep: bool) -> None:
    """Fail before any work if a tensor's type can be neither kept nor dequantized, naming both."""
    for name, t in tensors.items():
        if keep and t.tensor_type not in KEPT_TYPES and t.tensor_type != gguf.GGMLQuantizationType.F32:
            kept = ", ".join(q.name for q in KEPT_TYPES)
            also = (
                "; dequantize=True (--dequantize on the command line) reads it as float32, slower"
                if _can_dequantize(t.tensor_type)
                else "; nor can it read it with dequantize=True"
            )
            raise ModelFileError(
                path,
                f"tensor {name!r} uses quantization type {t.tensor_type.name}, which hydragen cannot compute "
                f"in (it computes in {kept} and F32){also}",
            )
        if not _can_dequantize(t.tensor_type):
            readable = sorted(
                q.name for q in gguf.GGMLQuantizationType if q in gguf.GGML_QUANT_SIZES and _can_dequantize(q)
            )
            raise ModelFileError(
                path,
                f"tensor {name!r} uses quantization type {t.tensor_type.name}, which hydragen cannot read "
                f"(it reads {', '.join(readable)})",
            )


def _dequantize(t: Any) -> np.ndarray:
    """The whole tensor in HF layout, as float32."""
    return _dequantize_rows(t, 0, int(t.shape[-1]))  # ggml lists dims fastest-first: the last is the rows


def _sig(x: float) -> float:
    """float32 metadata (1e-5 stored as 9.99999974e-06) printed back at float32 precision."""
    return float(f"{float(x):.7g}")


def llama3_rope_scaling(
    factors: np.ndarray, head_dim: int, theta: float, orig_ctx: int | None = None
) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's ``rope_freqs`` tensor (per-frequency divisors).

    llama.cpp stores 1 for short wavelengths, ``factor`` for long ones and ``1/((1-s)/factor + s)``
    between, with ``s = (L/wavelen - lo)/(hi - lo)``. s is linear in L/wavelen, so a line fit over the smooth
    band gives 1/(hi-lo) and -lo/(hi-lo) exactly; L itself is not recoverable but also not needed (any L
    yields the same inverse frequencies once lo/hi are fitted for it).
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    orig = int(orig_ctx or _DEFAULT_ORIG_CTX)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = orig * inv_freq / (2 * math.pi)  # L / wavelen
    smooth = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    lo, hi = 1.0, 4.0  # Meta's published defaults, used when the band holds too few points to fit
    if smooth.sum() >= 2:
        s = (1.0 / factors[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(x[smooth], s, 1)
        lo, hi = -b / a, (1.0 - b) / a
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": round(float(lo), 4),
        "high_freq_factor": round(float(hi), 4),
        "original_max_position_embeddings": orig,
    }


# Metadata read by this process, minus long arrays, by file (path, size, modification time): parsing a GGUF
# header reads every vocab entry (0.66 s for the embedded model, 1.5 s for a 151k-token Qwen3), and the
# loader has just done it when the tokenizer or the sampling defaults ask. A few small dicts.
_METADATA: dict[tuple[str, int, int], dict[str, Any]] = {}
_METADATA_KEPT = 4


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def _remember_metadata(path: Path, reader: _Reader) -> dict[str, Any]:
    long_array = lambda f: f.types[:1] == [gguf.GGUFValueType.ARRAY] and len(f.data) > 64
    meta = {k: f.contents() for k, f in reader.fields.items() if not long_array(f)}
    while len(_METADATA) >= _METADATA_KEPT:
        del _METADATA[next(iter(_METADATA))]
    _METADATA[_file_key(path)] = meta
    return meta


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Metadata fields of a GGUF, minus long arrays (the vocab), for callers that need no tensors: parsed
    once per file in a process (the loader's parse counts), again if the file changed."""
    path = Path(path)
    meta = _METADATA.get(_file_key(path))
    if meta is None:
        meta = _remember_metadata(path, open_gguf(path))
    return dict(meta)


def read_gguf(path: str | Path, keep: bool = False) -> tuple[dict, dict[str, torch.Tensor | QuantTensor]]:
    """Return (HF-style config dict, HF-named state dict) for a GGUF of a registered family: float32 tensors,
    and with ``keep`` ``QuantTensor``s for the types the kernels compute in.

    Any unreadable file raises ModelFileError naming the file and the problem.
    """
    config, source = open_gguf_tensors(path, keep)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # numpy kernels release the GIL
        state = dict(zip(source.names, pool.map(source.read, source.names), strict=True))
    return config, state


def open_gguf_tensors(path: str | Path, keep: bool = False) -> tuple[dict, GGUFTensors]:
    """(HF-style config dict, the file's tensors under HF names, read on demand): what ``read_gguf`` reads,
    without dequantizing anything yet, so a tensor-parallel rank can read only its slices."""
    path = Path(path)
    reader = open_gguf(path)
    _remember_metadata(path, reader)

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except _HEADER_ERRORS as e:
            raise ModelFileError(path, f"corrupt metadata field {key!r} ({first_line(e)})") from None

    def need(key: str) -> int:
        if (value := meta(key)) is None:
            raise ModelFileError(path, f"lacks required metadata {key!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ModelFileError(path, f"metadata {key!r} should be a number, got {value!r}") from None

    arch = meta("general.architecture")
    family = family_for_gguf(arch)
    if family is None and arch == "clip":  # llama.cpp's mmproj: the vision tower beside a text model's GGUF
        why = (
            "a multimodal projector (mmproj), a vision tower: hydragen runs text models (load the text GGUF)"
        )
        raise ModelFileError(path, why)
    if family is None:
        supported = ", ".join(supported_gguf())
        raise ModelFileError(path, f"unsupported GGUF architecture {arch!r} (supported: {supported})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFileError(path, "lacks the tensor 'token_embd.weight' (the token embeddings)")
    for name in tensors:
        if name not in _SKIP:
            try:
                hf_name(name, family)
            except ValueError:
                raise ModelFileError(path, f"unexpected tensor {name!r} for a {arch} model") from None
    _check_quantization(path, tensors, keep)
    n_head = need(f"{arch}.attention.head_count")
    n_kv = int(meta(f"{arch}.attention.head_count_kv", n_head))
    hidden = need(f"{arch}.embedding_length")
    head_dim = int(
        meta(f"{arch}.attention.key_length", 0) or meta(f"{arch}.rope.dimension_count", 0) or hidden // n_head
    )
    theta = _sig(meta(f"{arch}.rope.freq_base", 10000.0))
    ctx = int(meta(f"{arch}.context_length", 2048))

    rope_scaling = None
    scaling_type = meta(f"{arch}.rope.scaling.type")
    orig_ctx = meta(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"])
        rope_scaling = llama3_rope_scaling(factors, head_dim, theta, orig_ctx)
    elif "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        rope_scaling = {  # model/rope.py, longrope_scaling, picks the set and the attention factor
            "rope_type": "longrope",
            "long_factor": _dequantize(tensors["rope_factors_long.weight"]).reshape(-1).tolist(),
            "short_factor": _dequantize(tensors["rope_factors_short.weight"]).reshape(-1).tolist(),
            "original_max_position_embeddings": int(orig_ctx or ctx),
        }
    elif scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": _sig(meta(f"{arch}.rope.scaling.factor", 1.0))}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(orig_ctx or ctx)
            for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if (value := meta(f"{arch}.rope.scaling.{key}")) is not None:
                    rope_scaling[name] = _sig(value)
            if (value := meta(f"{arch}.rope.scaling.yarn_attn_factor")) is not None:  # HF attention_factor
                rope_scaling["attention_factor"] = _sig(value)

    config = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.model_type or family.name,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # ggml dims: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": need(f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _sig(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **family.gguf_config(meta, arch),
    }

    file_map = FileMap.of(reader.data)
    return config, GGUFTensors(path, tensors, family, n_head, n_kv, head_dim, keep, file_map)


# Rows dequantized at a time when only some columns are kept: bounds the transient float32 copy.
_COLUMN_READ_ROWS = 256


class GGUFTensors:
    """A GGUF's tensors under HF names, dequantized on demand, whole or as a slice of rows or columns.

    A quantized row is a whole number of blocks along the columns, so a row slice dequantizes only its own
    blocks; a column slice dequantizes a few rows at a time and keeps the wanted columns.
    """

    def __init__(
        self,
        path: Path,
        tensors: dict[str, Any],
        family: Family,
        n_head: int,
        n_kv: int,
        d: int,
        keep: bool,
        file_map: FileMap | None = None,
    ):
        self.path, self.permuted, self.keep = path, family.gguf_permuted_qk, keep
        self._file_map = file_map or FileMap(None)
        self._by_hf = {hf_name(n, family): t for n, t in tensors.items() if n not in _SKIP}
        self._heads = {"attn_q": n_head, "attn_k": n_kv}
        self.head_dim = d
        self.names = list(self._by_hf)

    def elements(self) -> int:
        """Weights in the file (every tensor the model reads), whatever their type."""
        return sum(int(t.n_elements) for t in self._by_hf.values())

    def keeps_quantized(self) -> bool:
        """Whether any tensor is read in a quantized block format (kept, not dequantized): the model it builds
        then computes from quantized blocks (``model.linear.keeps_quantized_weights``)."""
        return self.keep and any(t.tensor_type in PACKED_TYPES for t in self._by_hf.values())

    def on_demand(self) -> TensorsOnDemand:
        """The tensors as a state dict that reads each one when the model takes it."""
        return TensorsOnDemand(self)

    def block(self, name: str) -> int:
        """Weights per block along the rows of ``name`` as it is read (1 when it is read as floats)."""
        t = self._by_hf[name]
        return block_size(t.tensor_type) if self.keep and t.tensor_type in KEPT_TYPES else 1

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._by_hf[name].shape))

    def read(self, name: str, dim: int | None = None, lo: int = 0, hi: int = 0) -> torch.Tensor | QuantTensor:
        """Tensor ``name``, or its slice [lo, hi) along ``dim`` (0: rows, 1: columns): a ``QuantTensor`` in
        the file's format when kept, else float32."""
        t = self._by_hf[name]
        qk = next((k for k in self._heads if f".{k}." in t.name), None) if self.permuted else None
        if self.keep and t.tensor_type in KEPT_TYPES and len(t.shape) == 2:
            return self._read_kept(t, qk, dim, lo, hi)
        try:
            if dim is None:
                w = _dequantize(t)
            elif dim == 0:
                w = _dequantize_rows(t, lo, hi)
            else:
                full = self.shape(name)
                parts = [
                    _dequantize_rows(t, r, min(r + _COLUMN_READ_ROWS, full[0]))[:, lo:hi]
                    for r in range(0, full[0], _COLUMN_READ_ROWS)
                ]
                w = np.concatenate(parts) if parts else np.zeros((0, hi - lo), np.float32)
        except ValueError as e:  # data whose size does not match its shape
            raise ModelFileError(self.path, f"tensor {t.name!r} is corrupt ({first_line(e)})") from None
        if qk is not None:
            if dim not in (None, 0):
                raise ValueError(f"{name}: llama.cpp's permuted q/k rows can only be sliced by rows")
            heads = self._heads[qk] if dim is None else (hi - lo) // self.head_dim
            w = np.ascontiguousarray(unpermute_qk(w, heads))  # per head: a slice of whole heads is exact
        self._drop_pages(t)  # w is a float copy
        return torch.from_numpy(np.ascontiguousarray(w))

    def _drop_pages(self, t: Any) -> None:
        """Tensor ``t``'s pages of the file leave this process (its bytes are copied out, or packed)."""
        self._file_map.drop(int(t.data_offset), int(t.n_bytes))

    def _read_kept(self, t: Any, qk: str | None, dim: int | None, lo: int, hi: int) -> QuantTensor:
        rows, cols = (int(x) for x in reversed(t.shape))
        with warnings.catch_warnings():  # the memory map is read-only, and nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data.view(np.uint8).reshape(rows, -1))
        if data.shape[1] != row_bytes(t.tensor_type, cols):
            raise ModelFileError(self.path, f"tensor {t.name!r} is corrupt (its rows are not whole blocks)")
        whole = QuantTensor(int(t.tensor_type), data, cols)
        if qk is not None:  # whole heads of rows, put back in HF order (a row reordering: exact)
            if dim not in (None, 0):
                raise ValueError(f"{t.name}: llama.cpp's permuted q/k rows can only be sliced by rows")
            lo, hi = (0, rows) if dim is None else (lo, hi)
            order = unpermute_qk(np.arange(lo, hi), (hi - lo) // self.head_dim)
            reordered = whole.take_rows(order)  # a copy: the file's pages are read
            self._drop_pages(t)
            return reordered
        whole.drop_source = partial(self._drop_pages, t)
        if dim is None:
            return whole
        try:
            return whole.row_slice(lo, hi) if dim == 0 else whole.col_slice(lo, hi)
        except ValueError as e:
            raise ModelFileError(self.path, f"tensor {t.name!r}: {e}") from None


class TensorsOnDemand:
    """What ``DecoderModel.load_hf_state_dict`` pops by name, each tensor read from the file as it is popped:
    a load holds one projection's file bytes at a time beside what it has packed, not the whole file."""

    def __init__(self, files: GGUFTensors) -> None:
        self._files = files
        self._left = dict.fromkeys(files.names)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._left))

    def pop(self, name: str, *default: Any) -> torch.Tensor | QuantTensor:
        if name in self._left:
            del self._left[name]
            return self._files.read(name)
        if default:
            return default[0]
        raise KeyError(name)


def _dequantize_rows(t: Any, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of a tensor's HF-layout matrix (or elements of a vector), as float32."""
    shape = tuple(int(d) for d in reversed(t.shape))
    data = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data
    arr = gguf.quants.dequantize(data[lo:hi], t.tensor_type).reshape((hi - lo, *shape[1:]))
    # F32 comes back as a read-only view of the memmap; copy so torch gets owned, writable memory
    return arr.astype(np.float32, copy=not arr.flags.writeable or arr.dtype != np.float32)
