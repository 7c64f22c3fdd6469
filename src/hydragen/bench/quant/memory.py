"""The memory part of ``hydragen bench quant``: resident memory after load, and the peak while loading,
against the GGUF's size.

Each model loads in a fresh process. First the fixed runtime is measured there (Python, torch, hydragen, the
C++ ops, a tiny one-layer model of the measured model's family loaded and run once: a Gemma runs the per-op
path, a Llama the fused C++ stack); then the model is loaded (weights only, no KV cache)
and run once, and its share is the resident memory after minus the runtime before. The target: model share
<= 1.15 x the file's size. The peak is measured in a second fresh process, loading nothing else: the peak
RSS of the load (VmHWM, which counts the file's mapped pages too) over the RSS after importing hydragen and
loading the C++ ops (issue 39's "runtime"), with the same target. Where llama-cpp-python is installed, a
third fresh process loads the file with llama.cpp as the decode benchmark's peer does (its default mmap) and
decodes three tokens: its load time, its first tokens' time (a mapped file is read in then, where hydragen
reads it while loading), and its resident memory and peak over its runtime, beside hydragen's.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _status_mb(key: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_probe(model: str, runtime_model: str) -> dict:
    """In this (fresh) process: RSS with the runtime loaded (imports, ops, a tiny model run once), then RSS
    after loading ``model`` (no KV cache: ``load_model``)."""
    from hydragen.bench.quant.accuracy import plain_attention
    from hydragen.model.loader import load_model

    cpu = torch.device("cpu")

    def run_once(net):
        net.logits(net(torch.tensor([1, 2, 3]), torch.arange(3), plain_attention))

    tiny, _, _ = load_model(runtime_model, cpu, torch.float32)
    run_once(tiny)
    runtime = _status_mb()
    t0 = time.perf_counter()
    net, _, path = load_model(model, cpu, torch.float32)
    load_s = time.perf_counter() - t0
    run_once(net)
    first_s = time.perf_counter() - t0 - load_s
    return {
        "runtime MB": runtime,
        "after load MB": _status_mb(),
        "load s": load_s,
        "first run s": first_s,
        "path": str(path),
    }


def llamacpp_probe(model: str) -> dict:
    """In this (fresh) process: llama.cpp (llama-cpp-python, its default mmap of the file) loading ``model``
    and a context, then a three-token prompt and one token, as the decode benchmark's peer does: the load's
    time, the first tokens' (llama.cpp reads the mapped weights in then), and resident memory before and
    after."""
    import llama_cpp  # noqa: F401  (with the peer's imports: the runtime the model's share is counted over)

    from hydragen.bench.peers.llamacpp_peer import Peer

    before = _status_mb()
    t0 = time.perf_counter()
    peer = Peer(model, max_prompt=8, max_new=1, max_n=1)
    load_s = time.perf_counter() - t0
    peer.generate([1, 2, 3], 1, 1)
    first_s = time.perf_counter() - t0 - load_s
    return {
        "runtime MB": before,
        "after load MB": _status_mb(),
        "peak MB": _status_mb("VmHWM"),
        "load s": load_s,
        "first run s": first_s,
    }


def peak_probe(model: str) -> dict:
    """In this (fresh) process: RSS with hydragen imported and the C++ ops loaded, then the peak RSS while
    loading ``model`` (``load_model``, no KV cache) and the RSS after."""
    import hydragen  # noqa: F401  (the runtime the peak is counted over)
    from hydragen.model.loader import load_model
    from hydragen.native import quant

    quant.available()
    imported = _status_mb()
    net, _, _ = load_model(model, torch.device("cpu"), torch.float32)
    return {
        "imported MB": imported,
        "peak MB": _status_mb("VmHWM"),
        "after load MB": _status_mb(),
        "layers": len(net.layers),
    }


def in_fresh_process(call: str) -> dict:
    """``call`` (a probe of this module, as ``q.peak_probe(...)``) in a new Python process: its JSON."""
    code = f"import json, hydragen.bench.quant.memory as q; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{call} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def runtime_shape(path: Path) -> dict:
    """A one-layer, 512-token Hugging Face config of the family of the model at ``path`` (a GGUF or a model
    directory): the tiny model whose run counts as the runtime."""
    config: dict = {"architectures": ["LlamaForCausalLM"]}
    if path.suffix == ".gguf":
        from hydragen.model.gguf import open_gguf_tensors

        config, _ = open_gguf_tensors(path)
    elif (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, vocab_size=512)
    context = dict(max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False)
    config = {k: v for k, v in config.items() if k != "layer_types"}  # per layer: the model's count, not one
    if "query_pre_attn_scalar" in config:  # Gemma: the scale llama.cpp derives for these heads
        heads["query_pre_attn_scalar"] = heads["head_dim"]
    return config | heads | sizes | context


def memory_row(model, label: str) -> dict:
    from hydragen.model.config import ModelConfig
    from hydragen.model.gguf_write import random_maker, write_gguf
    from hydragen.model.loader import resolve_model_path

    path = resolve_model_path(model)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = ModelConfig.from_hf(runtime_shape(path))
        runtime_model = write_gguf(Path(tmp) / "runtime.gguf", tiny, "Q4_K_M", random_maker())
        probe = in_fresh_process(f"q.rss_probe({str(path)!r}, {str(runtime_model)!r})")
    peak = in_fresh_process(f"q.peak_probe({str(path)!r})")
    file_mb = path.stat().st_size / 2**20
    model_mb = probe["after load MB"] - probe["runtime MB"]
    row = {
        "model": label,
        "file MB": file_mb,
        "runtime MB": probe["runtime MB"],
        "resident after load MB": probe["after load MB"],
        "model MB (resident - runtime)": model_mb,
        "model / file": model_mb / file_mb,
        "imported MB": peak["imported MB"],
        "peak during load MB": peak["peak MB"],
        "peak / file": (peak["peak MB"] - peak["imported MB"]) / file_mb,
        "load s": probe["load s"],
        "first run s": probe["first run s"],
    }
    if importlib.util.find_spec("llama_cpp") is None:
        return row
    theirs = in_fresh_process(f"q.llamacpp_probe({str(path)!r})")  # a crash fails the part: it says why
    return row | {
        "llama.cpp model / file": (theirs["after load MB"] - theirs["runtime MB"]) / file_mb,
        "llama.cpp peak / file": (theirs["peak MB"] - theirs["runtime MB"]) / file_mb,
        "llama.cpp load s": theirs["load s"],
        "llama.cpp first run s": theirs["first run s"],
    }
