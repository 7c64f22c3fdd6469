"""Find and load a checkpoint: the embedded default GGUF, any .gguf file, or a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hydragen.model.config import ModelConfig
from hydragen.model.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


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
        raise ValueError(f"model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model directory {path} has no config.json")
    return path


def _read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    if gen.exists() and "eos_token_id" in (g := json.loads(gen.read_text())):
        eos = (
            [cfg.get("eos_token_id")]
            if not isinstance(cfg.get("eos_token_id"), list)
            else cfg["eos_token_id"]
        )
        extra = g["eos_token_id"] if isinstance(g["eos_token_id"], list) else [g["eos_token_id"]]
        cfg["eos_token_id"] = sorted({e for e in eos + extra if e is not None})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"model directory {path} has no *.safetensors or pytorch_model*.bin weights")
        sd: dict[str, torch.Tensor] = {}
        for f in bins:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        return cfg, sd
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return cfg, sd


def load_model(
    model: str | Path | None, device: torch.device, dtype: torch.dtype, random_weights: bool = False
):
    """Returns (LlamaModel on device in dtype, ModelConfig, resolved path).

    ``random_weights``: ``model`` is a preset name (see hydragen.model.presets), a config.json or a model
    directory, and the weights are drawn at random on the device (for throughput benchmarks).
    """
    if random_weights:
        return _random_model(model, device, dtype)
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from hydragen.model.gguf import read_gguf

        hf_cfg, sd = read_gguf(path)
    else:
        hf_cfg, sd = _read_hf_dir(path)
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        net = LlamaModel(cfg)
    net = net.to_empty(device=device).to(dtype)
    net.load_hf_state_dict({k: v.to(dtype) for k, v in sd.items()})
    net.setup_rotary(device)
    net.eval()
    return net, cfg, path


def _random_model(spec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from hydragen.model.presets import config_for_random_weights

    if spec is None:
        raise ValueError("random weights need a shape: a preset name, a config.json or a model directory")
    hf_cfg, name = config_for_random_weights(spec)
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        net = LlamaModel(cfg)
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
    # A directory (or its config.json) stays the path, so its tokenizer, if any, is used.
    path = Path(spec).expanduser()
    path = path if path.is_dir() else path.parent if path.is_file() else Path(name)
    return net, cfg, path
