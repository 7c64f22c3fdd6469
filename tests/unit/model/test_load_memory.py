"""Peak memory while a GGUF loads kept in its format. The weights are read one projection at a time from the
file's memory map and packed, and each projection's file pages leave the process once it is packed
(model/file_pages.py), so the peak is the packed model plus about one projection, not the file twice.
The issue's target: peak RSS during load at most 1.15x the file plus the runtime (the RSS after importing
hydragen and loading the C++ ops)."""

from __future__ import annotations

import sys

import pytest

from hydragen.bench.quant.memory import in_fresh_process, runtime_shape
from hydragen.model.config import ModelConfig
from hydragen.model.gguf_write import random_maker, write_gguf
from hydragen.model.presets import PRESETS
from hydragen.native import quant

pytestmark = [
    pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]

SHAPES = {
    # Llama-3.2-1B's layers (8 of its 16) with a 32,000-token vocabulary and an output head of its own, in
    # llama-quantize's Q4_K_M mix: 366 MiB, most of it in the layers, as in a downloaded model. It runs the
    # fused C++ stack and reorders its permuted q/k rows while loading.
    "llama": PRESETS["llama-3.2-1b"]
    | dict(num_hidden_layers=8, vocab_size=32000, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # Qwen3-1.7B's layers (6 of its 28) with a 32,000-token vocabulary tied to the output, as its own is:
    # 222 MiB. It runs the per-op path, with float32 QK-norms beside the quantized blocks.
    "qwen3": PRESETS["qwen3-1.7b"]
    | dict(num_hidden_layers=6, vocab_size=32000, bos_token_id=1, eos_token_id=2),
}
TARGET = 1.15


@pytest.fixture(scope="module", params=sorted(SHAPES))
def real_shape_gguf(request, tmp_path_factory):
    shape = SHAPES[request.param]
    path = tmp_path_factory.mktemp("load_memory") / f"{request.param}-layers.Q4_K_M.gguf"
    write_gguf(path, ModelConfig.from_hf(shape), "Q4_K_M", random_maker())
    yield path, shape
    path.unlink()


def test_the_load_peaks_at_the_packed_model_plus_one_projection(real_shape_gguf) -> None:
    """Peak and resident after the load, each at most 1.15x the file over the runtime."""
    path, shape = real_shape_gguf
    probe = in_fresh_process(f"q.peak_probe({str(path)!r})")  # the runtime, then the load
    assert probe["layers"] == shape["num_hidden_layers"]
    file_mb = path.stat().st_size / 2**20
    peak = (probe["peak MB"] - probe["imported MB"]) / file_mb
    resident = (probe["after load MB"] - probe["imported MB"]) / file_mb
    assert peak <= TARGET, f"peak {peak:.2f}x the file over the runtime (resident after load {resident:.2f}x)"
    assert resident <= TARGET, f"resident after load {resident:.2f}x the file over the runtime"


def test_the_benchmarks_runtime_model_is_of_the_measured_family(real_shape_gguf) -> None:
    """``bench quant``'s memory part counts as runtime a one-layer model of the same family (Qwen3's per-op
    path, Llama's fused stack), so the model's share is its weights alone."""
    path, shape = real_shape_gguf
    tiny = runtime_shape(path)
    assert tiny["architectures"] == shape["architectures"] and tiny["num_hidden_layers"] == 1
    assert ModelConfig.from_hf(tiny).qk_norm == (shape["architectures"] == ["Qwen3ForCausalLM"])
