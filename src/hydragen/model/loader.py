"""Find and load a checkpoint: the embedded default GGUF, any .gguf file, or a Hugging Face directory."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from hydragen.model.config import ModelConfig
from hydragen.model.decoder import DecoderModel
from hydragen.model.errors import ModelFileError, first_line
from hydragen.model.fused import read_parts
from hydragen.model.heap import release_freed_memory
from hydragen.model.qtensor import TORCH_16BIT, QuantTensor
from hydragen.model.registry import family_named

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, quantized_weights: bool = False) -> torch.dtype:
    """The KV cache's dtype. "auto" is float16 for a model computing from GGUF quantized blocks in float32
    (``quantized_weights``: the cache llama.cpp and Ollama give every GGUF model), else the model's dtype.

    A 16-bit cache under float32 compute holds half the bytes per token (twice the cached prefixes in the
    same memory, half the K/V a decode step reads); attention then runs in float32 on the cache's rounded
    values. On the embedded model, against the float32-dequantized model, float16 K/V move the next-token
    distribution by a KL of ~1.7e-6 (float32 K/V: ~0.7e-6; int8 activations, as llama.cpp computes: ~5e-3):
    docs/quantization.md. "float32" keeps a quantized model's cache in float32."""
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized_weights and dtype == torch.float32 else dtype
    if kv_cache_dtype not in DTYPES:
        names = ", ".join(DTYPES)
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {names}, got {kv_cache_dtype!r}")
    kv = DTYPES[kv_cache_dtype]
    if kv != dtype and dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs float32 compute (dtype='float32'); with dtype "
            f"{str(dtype).removeprefix('torch.')!r} the cache keeps the model's dtype ('auto')"
        )
    return kv


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return dev


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        from hydragen.model.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a .gguf file or a Hugging Face model directory "
            "(weights cannot be downloaded from a hub by hydragen)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelFileError(path, "not a .gguf file (pass a .gguf file or a Hugging Face model directory)")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelFileError(path, "a model directory needs a config.json, and this one has none")
    return path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(path, f"cannot be read ({first_line(e)})") from None
    except json.JSONDecodeError as e:
        raise ModelFileError(
            path, f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(data, dict):
        raise ModelFileError(path, f"should hold a JSON object, not a {type(data).__name__}")
    return data


def _load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors or pytorch_model*.bin file; a damaged one is a ModelFileError naming it."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip each raise their own types for a damaged file
        raise ModelFileError(
            path, f"unreadable weights file, truncated or corrupt ({first_line(e)})"
        ) from None


def _read_hf_dir(path: Path, keep: bool) -> tuple[dict, dict[str, torch.Tensor | QuantTensor]]:
    cfg = read_hf_config(path)
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        sd.update(_load_weights_file(f))
    return cfg, {name: kept_16bit(t, keep) for name, t in sd.items()}


def kept_16bit(t: torch.Tensor, keep: bool) -> torch.Tensor | QuantTensor:
    """A float16/bfloat16 matrix stays 16-bit (its own bytes) when ``keep``; anything else is unchanged."""
    if keep and isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in TORCH_16BIT:
        return QuantTensor.from_16bit(t)
    return t


def keeps_compact(device: torch.device, dtype: torch.dtype, dequantize: bool) -> bool:
    """Whether weights stay in their file's compact format: on CPU, with the C++ ops, unless asked not to.

    A 16-bit checkpoint loaded as float32 then stays 16-bit; GGUF blocks stay quantized in any dtype.
    """
    if dequantize or device.type != "cpu":
        return False
    from hydragen.native import quant

    if not quant.available():
        from hydragen.native.build import build_error

        warnings.warn(
            f"hydragen's C++ ops are unavailable ({build_error()}): quantized and 16-bit weights are "
            "converted to float at load, which takes several times the memory",
            stacklevel=3,
        )
        return False
    return True


def read_hf_config(path: Path) -> dict:
    """config.json with generation_config.json's end-of-sequence ids merged in."""
    cfg = _read_json(path / "config.json")
    gen = path / "generation_config.json"
    if gen.exists() and "eos_token_id" in (g := _read_json(gen)):
        eos = (
            [cfg.get("eos_token_id")]
            if not isinstance(cfg.get("eos_token_id"), list)
            else cfg["eos_token_id"]
        )
        extra = g["eos_token_id"] if isinstance(g["eos_token_id"], list) else [g["eos_token_id"]]
        cfg["eos_token_id"] = sorted({e for e in eos + extra if e is not None})
    return cfg


SAFETENSORS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor name -> file


def weight_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face directory, each to be read once.

    A sharded checkpoint's index names its files, and only those are read: Mistral's repositories ship
    ``consolidated.safetensors`` beside them, the same weights again under Mistral's own names. Without an
    index, ``consolidated*.safetensors`` is left out when other ``*.safetensors`` are there.
    """
    if (path / SAFETENSORS_INDEX).is_file():
        return _indexed_files(path / SAFETENSORS_INDEX)
    safetensors = sorted(path.glob("*.safetensors"))
    files = [f for f in safetensors if not f.name.startswith("consolidated")] or safetensors
    files = files or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ModelFileError(path, "the model directory has no *.safetensors or pytorch_model*.bin weights")
    return files


def _indexed_files(index: Path) -> list[Path]:
    """The files an index's ``weight_map`` names, each once; a missing one is a ModelFileError."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(index, "has no weight_map naming the checkpoint's files")
    files = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFileError(index, f"names weight files that are not in the directory: {', '.join(missing)}")
    return files


def build_model(cfg: ModelConfig, sd, device, dtype, where: Path, model_class=DecoderModel) -> DecoderModel:
    """The model with the checkpoint's weights; a missing or misshapen tensor names the checkpoint.

    ``sd`` is a dict, or any mapping with ``pop`` and iteration (a tensor-parallel rank's lazy shard). The
    model is built on the meta device and each module replaced by the checkpoint's (nothing is allocated
    twice).
    """
    with torch.device("meta"):
        net = model_class(cfg)
    offset = 0.0 if where.suffix == ".gguf" else net.family.hf_norm_offset  # llama.cpp stored 1 + w
    try:
        net.load_hf_state_dict(sd, device, dtype, norm_offset=offset)
    except KeyError as e:
        raise ModelFileError(
            where, f"the weights lack the tensor {e.args[0]!r} that the config calls for"
        ) from None
    except RuntimeError as e:  # copy_ into a parameter of another shape
        raise ModelFileError(where, f"a tensor's shape does not match the config ({first_line(e)})") from None
    except ValueError as e:
        raise ModelFileError(where, first_line(e)) from None
    return net


def parse_config(hf_cfg: dict, cfg_file: Path) -> ModelConfig:
    """The normalised config; a missing or bad field is a ModelFileError naming ``cfg_file``."""
    try:
        return ModelConfig.from_hf(hf_cfg)
    except KeyError as e:
        raise ModelFileError(cfg_file, f"lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(cfg_file, first_line(e)) from None


def load_model(
    model: str | Path | None,
    device: torch.device,
    dtype: torch.dtype,
    random_weights: bool = False,
    dequantize: bool = False,
):
    """Returns (DecoderModel on device in dtype, ModelConfig, resolved path).

    ``random_weights``: ``model`` is a preset name (see hydragen.model.presets), a config.json or a model
    directory, and the weights are drawn at random on the device (for throughput benchmarks).
    ``dequantize``: GGUF blocks and 16-bit weights become float tensors in ``dtype`` at load (the reference
    the quantized kernels are measured against) instead of staying in their format (keeps_compact).
    """
    model, random_weights = random_gguf_or(model, random_weights)
    if random_weights:
        return _random_model(model, device, dtype)
    path = resolve_model_path(model)
    keep = keeps_compact(device, dtype, dequantize)
    if path.suffix == ".gguf":
        hf_cfg, source = _gguf_state(path, keep)
        cfg_file = path
    else:
        hf_cfg, source = _read_hf_dir(path, keep and dtype == torch.float32)
        cfg_file = path / "config.json"
    cfg = parse_config(hf_cfg, cfg_file)
    sd = read_parts(source, family_named(cfg.family), cfg, path)  # fused tensors (Phi-3's qkv) as parts
    del source
    net = build_model(cfg, sd, device, dtype, path)
    del sd
    release_freed_memory()
    net.setup_rotary(device)
    net.eval()
    return net, cfg, path


def _gguf_state(path: Path, keep: bool):
    """(config, tensors) of a GGUF. Kept in its format, the tensors are the file's, read on demand
    (``read_parts``): each is read as the model takes it and packed before the next, so the load's peak is
    what it packed plus one projection's bytes. Dequantized, they are read up front into a state dict by a
    few threads (the float32 copies dwarf the file anyway)."""
    from hydragen.model.gguf import open_gguf_tensors, read_gguf

    if not keep:
        return read_gguf(path, keep)
    hf_cfg, files = open_gguf_tensors(path, keep)
    release_freed_memory()  # the header's parse (a vocabulary of Python objects) before the weights
    return hf_cfg, files


def random_gguf_or(model, random_weights: bool):
    """(model, random_weights), with a random spec that names a quantization (``PRESET:SCHEME``) replaced by
    its random-weights GGUF file (model/gguf_write.py), which then loads like any downloaded model."""
    if random_weights and isinstance(model, str) and ":" in model and not Path(model).exists():
        from hydragen.model.gguf_write import random_gguf_file

        return random_gguf_file(model), False
    return model, random_weights


def _random_model(spec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    cfg, path = random_config(spec)
    return random_model(cfg, device, dtype, seed), cfg, path


def random_config(spec) -> tuple[ModelConfig, Path]:
    """The config and path of a random-weights model: ``spec`` is a preset name, a config.json or a model
    directory. A directory (or its config.json) stays the path, so its tokenizer, if any, is used."""
    from hydragen.model.presets import config_for_random_weights

    if spec is None:
        raise ValueError("random weights need a shape: a preset name, a config.json or a model directory")
    hf_cfg, name = config_for_random_weights(spec)
    path = Path(spec).expanduser()
    path = path if path.is_dir() else path.parent if path.is_file() else Path(name)
    return ModelConfig.from_hf(hf_cfg), path


def random_model(cfg: ModelConfig, device, dtype, seed: int = 0, model_class=DecoderModel) -> DecoderModel:
    """A model of shape ``cfg`` with random weights drawn on the device (norms 1, biases 0)."""
    with torch.device("meta"):
        net = model_class(cfg)
    net = net.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in net.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            elif p.dim() == 1:  # biases
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    net.setup_rotary(device)
    net.eval()
    return net
