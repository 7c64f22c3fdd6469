"""The memory part of ``hydragen bench quant``: resident memory after load, and the peak while loading,
against the GGUF's size.

Each model loads in a fresh process. First the fixed runtime is measured there (Python, torch, hydragen, the
C++ ops, a tiny one-layer model loaded and run once); then the model is loaded (weights only, no KV cache)
and run once, and its share is the resident memory after minus the runtime before. The target: model share
<= 1.15 x the file's size. The peak (VmHWM, file-backed pages included) is counted from the resident memory
right after importing hydragen and loading the C++ ops, before the tiny model (issue 39's definition of the
runtime), and has the same target.
"""

from __future__ import annotations

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
    """In this (fresh) process: RSS with hydragen imported and the ops loaded, RSS with the runtime loaded
    (those, and a tiny model run once), then RSS after loading ``model`` (no KV cache: ``load_model``) and the
    peak RSS so far."""
    from hydragen.bench.quant_accuracy import plain_attention
    from hydragen.model.loader import load_model
    from hydragen.native import quant

    cpu = torch.device("cpu")
    quant.available()
    imported = _status_mb()

    def run_once(net):
        net.logits(net(torch.tensor([1, 2, 3]), torch.arange(3), plain_attention))

    tiny, _, _ = load_model(runtime_model, cpu, torch.float32)
    run_once(tiny)
    runtime = _status_mb()
    t0 = time.perf_counter()
    net, _, path = load_model(model, cpu, torch.float32)
    load_s = time.perf_counter() - t0
    peak = _status_mb("VmHWM")
    run_once(net)
    return {
        "imported MB": imported,
        "runtime MB": runtime,
        "peak MB": peak,
        "after load MB": _status_mb(),
        "load s": load_s,
        "path": str(path),
    }


def memory_row(model, label: str) -> dict:
    from hydragen.model.config import ModelConfig
    from hydragen.model.gguf_write import random_maker, write_llama_gguf
    from hydragen.model.loader import resolve_model_path

    path = resolve_model_path(model)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = ModelConfig.from_hf(
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
                max_position_embeddings=256,
            )
        )
        runtime_model = write_llama_gguf(Path(tmp) / "runtime.gguf", tiny, "Q4_K_M", random_maker())
        probe = f"q.rss_probe({str(path)!r}, {str(runtime_model)!r})"
        code = f"import json, hydragen.bench.quant_memory as q; print(json.dumps({probe}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    file_mb = path.stat().st_size / 2**20
    model_mb = probe["after load MB"] - probe["runtime MB"]
    return {
        "model": label,
        "file MB": file_mb,
        "runtime MB": probe["runtime MB"],
        "resident after load MB": probe["after load MB"],
        "model MB (resident - runtime)": model_mb,
        "model / file": model_mb / file_mb,
        "peak during load MB": probe["peak MB"],
        "peak / file (over imported)": (probe["peak MB"] - probe["imported MB"]) / file_mb,
        "load s": probe["load s"],
    }
