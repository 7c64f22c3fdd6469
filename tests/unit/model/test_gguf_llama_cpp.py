"""llama.cpp as the GGUF oracle (slow; run with ``-m slow``): a tiny Hugging Face Qwen3 converted by
llama.cpp's own ``convert_hf_to_gguf.py`` is the file hydragen's writer writes from the same checkpoint,
tensor for tensor; hydragen runs the converted file to transformers' greedy tokens, and so does llama.cpp
(and the written one too); llama.cpp loads and runs the writer's random-weights Qwen3 in llama-quantize's
Q4_K_M mix.

Where the oracle lives is the machine's, told by the environment, with defaults where the project's
machines keep it (each test skips, saying which is missing):

* ``HYDRAGEN_LLAMA_CPP_SOURCE``: a llama.cpp source tree (``convert_hf_to_gguf.py``, ``gguf-py/``), e.g. the
  ``vendor/llama.cpp`` of an unpacked llama-cpp-python sdist (default: the one tests/unit/model/test_phi3.py
  uses);
* ``HYDRAGEN_CONVERTER_PYTHONPATH``: where the converter's requirements this environment lacks are installed
  (``sentencepiece``: ``pip install --target DIR sentencepiece``; default ``/work/lcpp-venv/converter-deps``);
  it runs on this Python, with its torch and transformers;
* ``HYDRAGEN_LLAMA_CPP_PYTHON``: a Python with llama-cpp-python (default: this one if it has it, else
  ``/work/lcpp-venv/bin/python`` if that exists).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.model.config import ModelConfig
from hydragen.model.gguf_write import checkpoint_maker, random_maker, write_gguf

pytestmark = pytest.mark.slow

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [300, 301, 302, 303], [7, 8, 9, 10, 11]]
T = 8


LLAMA_CPP = Path(
    os.environ.get("HYDRAGEN_LLAMA_CPP_SOURCE", "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
)
CONVERTER_DEPS = os.environ.get("HYDRAGEN_CONVERTER_PYTHONPATH", "/work/lcpp-venv/converter-deps")
LLAMA_CPP_VENV = Path("/work/lcpp-venv/bin/python")


def _converter() -> tuple[Path, dict[str, str]]:
    """The converter script and its environment, or a skip saying what is missing."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {LLAMA_CPP} (set HYDRAGEN_LLAMA_CPP_SOURCE)")
    paths = [str(LLAMA_CPP / "gguf-py"), CONVERTER_DEPS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    probe = subprocess.run([sys.executable, "-c", "import sentencepiece, gguf"], env=env, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            "llama.cpp's converter needs sentencepiece, not installed here (install it with pip --target DIR "
            "and set HYDRAGEN_CONVERTER_PYTHONPATH=DIR)"
        )
    return LLAMA_CPP / "convert_hf_to_gguf.py", env


def _llama_cpp_python() -> str:
    python = os.environ.get("HYDRAGEN_LLAMA_CPP_PYTHON")
    if python:
        return python
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    if LLAMA_CPP_VENV.is_file():
        probe = subprocess.run([str(LLAMA_CPP_VENV), "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode == 0:
            return str(LLAMA_CPP_VENV)
    pytest.skip("llama-cpp-python is not installed (set HYDRAGEN_LLAMA_CPP_PYTHON to a Python with it)")


# Greedy decoding on llama.cpp's own logits (float32 KV cache), one process per file.
_LLAMA_CPP_GREEDY = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, prompts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
m = Llama(model_path=path, n_ctx=128, n_batch=64, n_threads=2, logits_all=True, type_k=0, type_v=0,
          verbose=False)
out = []
for p in prompts:
    m.reset()
    m.eval(p)
    got = []
    for _ in range(steps):
        logits = np.asarray(m.scores[m.n_tokens - 1])
        if not np.isfinite(logits).all():
            raise SystemExit("llama.cpp computed non-finite logits")
        got.append(int(logits.argmax()))
        m.eval([got[-1]])
    out.append(got)
print(json.dumps(out))
"""


def llama_cpp_greedy(path: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    run = subprocess.run(
        [_llama_cpp_python(), "-c", _LLAMA_CPP_GREEDY, str(path), json.dumps(prompts), str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _save_tiny(path: Path, arch: str, **shape) -> Path:
    """A tiny random checkpoint saved with save_pretrained, with the embedded model's tokenizer (a GPT-2 BPE
    the converter recognises) and a vocabulary that holds it."""
    import transformers
    from transformers import AutoTokenizer

    from hydragen.model.default_model import default_model_path

    gguf_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = config(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(1234)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # peaky, well-separated logits, as tests/conftest.py's tiny models
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"  # Phi-3's converter: the BPE path
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("llama_cpp") / "tiny-qwen3", "Qwen3ForCausalLM", **shape)


@pytest.fixture(scope="module")
def transformers_greedy(tiny_qwen3) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    return [
        hf.generate(torch.tensor([p]), max_new_tokens=T, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]


def convert(checkpoint: Path, outtype: str) -> Path:
    """llama.cpp's converter on ``checkpoint``."""
    script, env = _converter()
    out = checkpoint.parent / f"converted.{outtype}.gguf"
    run = subprocess.run(
        [sys.executable, str(script), str(checkpoint), "--outfile", str(out), "--outtype", outtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(tiny_qwen3) -> dict[str, Path]:
    """llama.cpp's converter on the tiny Qwen3, as F32 and as Q8_0."""
    return {outtype: convert(tiny_qwen3, outtype) for outtype in ("f32", "q8_0")}


def _written(checkpoint: Path, scheme: str) -> Path:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
    path = checkpoint.parent / f"written.{scheme}.gguf"
    return write_gguf(path, cfg, scheme, checkpoint_maker(load_file(checkpoint / "model.safetensors"), cfg))


def _same_tensors(theirs: gguf.GGUFReader, ours: gguf.GGUFReader) -> None:
    a, b = {t.name: t for t in theirs.tensors}, {t.name: t for t in ours.tensors}
    assert set(a) == set(b)
    for name, t in a.items():
        assert (t.tensor_type, list(t.shape)) == (b[name].tensor_type, list(b[name].shape)), name
        assert np.array_equal(np.asarray(t.data), np.asarray(b[name].data)), name


def _metadata(reader: gguf.GGUFReader) -> dict:
    return {
        k: (f.types, f.contents())
        for k, f in reader.fields.items()
        if not k.startswith(("general.", "tokenizer.", "GGUF."))
    }


@pytest.mark.parametrize("scheme", ["F32", "Q8_0"])
def test_the_writer_writes_what_llama_cpps_converter_writes(tiny_qwen3, converted, scheme) -> None:
    """Same tensors in name, type, shape and bytes; same metadata but the general.* labels and the tokenizer
    (the writer's is the embedded model's, fitted to the vocabulary)."""
    theirs, ours = gguf.GGUFReader(converted[scheme.lower()]), gguf.GGUFReader(_written(tiny_qwen3, scheme))
    _same_tensors(theirs, ours)
    assert _metadata(theirs) == _metadata(ours)
    assert theirs.fields["general.architecture"].contents() == "qwen3"


def test_the_writers_phi_4_mini_is_the_converters(tmp_path) -> None:
    """A tiny Phi-4-mini (fused attn_qkv and ffn_up, LongRoPE factors, partial rotary, tied) at Q8_0: the same
    tensors, bytes included; the same metadata but two known differences: the writer adds the head size
    (key/value_length, every architecture's key) and leaves out the window (folded into the context)."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]}
    rope |= {"long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=4)
    shape |= dict(partial_rotary_factor=0.75, rope_scaling=rope, tie_word_embeddings=True, pad_token_id=0)
    checkpoint = _save_tiny(tmp_path / "tiny-phi4-mini", "Phi3ForCausalLM", **shape)
    theirs, ours = gguf.GGUFReader(convert(checkpoint, "q8_0")), gguf.GGUFReader(_written(checkpoint, "Q8_0"))
    _same_tensors(theirs, ours)
    a, b = _metadata(theirs), _metadata(ours)
    assert set(a) - set(b) == {"phi3.attention.sliding_window"}
    assert set(b) - set(a) == {"phi3.attention.key_length", "phi3.attention.value_length"}
    assert {k: v for k, v in a.items() if k in b and v != b[k]} == {}


def test_hydragen_runs_the_converted_file_to_transformers_greedy_tokens(converted, transformers_greedy):
    llm = LLM(str(converted["f32"]), kv_cache_tokens=1024)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy


def test_llama_cpp_runs_the_converted_file_to_transformers_greedy_tokens(converted, transformers_greedy):
    assert llama_cpp_greedy(converted["f32"], PROMPTS, T) == transformers_greedy


def test_llama_cpp_runs_the_written_file_to_transformers_greedy_tokens(tiny_qwen3, transformers_greedy):
    assert llama_cpp_greedy(_written(tiny_qwen3, "F32"), PROMPTS, T) == transformers_greedy


def test_llama_cpp_loads_and_runs_the_writers_random_qwen3(tmp_path) -> None:
    """A random Qwen3-1.7B-shaped file (2 of its layers, a 4,096-token vocabulary) in llama-quantize's Q4_K_M
    mix: llama.cpp loads it as written and decodes finite logits."""
    from hydragen.model.presets import PRESETS

    shape = PRESETS["qwen3-1.7b"] | dict(num_hidden_layers=2, vocab_size=4096, bos_token_id=1, eos_token_id=2)
    path = write_gguf(tmp_path / "random-qwen3.gguf", ModelConfig.from_hf(shape), "Q4_K_M", random_maker())
    got = llama_cpp_greedy(path, [[5, 6, 7]], 2)
    assert len(got[0]) == 2 and all(0 <= t < 4096 for t in got[0])
