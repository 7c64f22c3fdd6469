"""llama.cpp as the GGUF oracle (slow; run with ``-m slow``): a tiny Hugging Face Qwen3 converted by
llama.cpp's own ``convert_hf_to_gguf.py`` is the file hydragen's writer writes from the same checkpoint,
tensor for tensor; hydragen runs the converted file to transformers' greedy tokens, and so does llama.cpp
(and the written one too); llama.cpp loads and runs the writer's random-weights Qwen3 in llama-quantize's
Q4_K_M mix. A tiny Gemma 3 likewise: the converter's file is the writer's, and llama.cpp runs the writer's to
hydragen's greedy tokens.

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


def _save_tiny(path: Path, arch: str, config_class: str = "", gemma: bool = False, **shape) -> Path:
    """A tiny random checkpoint saved with save_pretrained, with the embedded model's tokenizer (a GPT-2 BPE
    the converter recognises) and a vocabulary that holds it. ``config_class``: the config when it is not the
    architecture's; ``gemma``: random norm weights (Gemma's are w of 1 + w: zeros would hide a norm taken for
    another) and small embeddings (Gemma scales them by sqrt(hidden))."""
    import transformers
    from transformers import AutoTokenizer

    from hydragen.model.default_model import default_model_path

    gguf_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = getattr(transformers, config_class or arch.replace("ForCausalLM", "Config"))
    cfg = config(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(1234)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # peaky, well-separated logits, as tests/conftest.py's tiny models
        for p in model.parameters():
            if gemma and p is model.get_input_embeddings().weight:
                p.normal_(0, 0.02)
            elif p.dim() == 2:
                p.normal_(0, 0.15)
            elif gemma:
                p.normal_(0, 0.3)
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


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A tiny Gemma 3 as llama.cpp can hold it: query_pre_attn_scalar = head_dim, the default five local
    layers to one global (the converter writes no pattern), a window of 4 (shorter than every sequence here),
    local RoPE on its own base and global RoPE linearly scaled."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=4)
    shape |= dict(rope_parameters=rope, max_position_embeddings=512, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp("llama_cpp_gemma3")
    return _save_tiny(root / "tiny-gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", gemma=True, **shape)


@pytest.mark.parametrize("scheme", ["F32", "Q8_0"])
def test_the_writers_gemma3_is_the_converters(tiny_gemma3, scheme) -> None:
    """convert_hf_to_gguf.py's Gemma3Model on the tiny Gemma 3 and the writer on the same checkpoint: the same
    tensors (norms as 1 + w, QK-norms, no output) in name, type, shape and bytes, and the same metadata (the
    window, rope.freq_base_swa, the linear factor; no pattern), general.* and the tokenizer aside."""
    theirs = gguf.GGUFReader(convert(tiny_gemma3, scheme.lower()))
    ours = gguf.GGUFReader(_written(tiny_gemma3, scheme))
    _same_tensors(theirs, ours)
    assert _metadata(theirs) == _metadata(ours)
    assert "gemma3.rope.freq_base_swa" in _metadata(ours)


def test_llama_cpp_runs_the_writers_gemma3_to_hydragens_greedy_tokens(tiny_gemma3) -> None:
    """The writer's F32 tiny Gemma 3 (windows of 4 on five layers of six): llama.cpp's greedy tokens are
    hydragen's on the same file, and transformers' on the checkpoint."""
    from transformers import AutoModelForCausalLM

    path = _written(tiny_gemma3, "F32")
    llm = LLM(str(path), kv_cache_tokens=1024)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    assert llama_cpp_greedy(path, PROMPTS, T) == ours
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32)
    want = [
        hf.generate(torch.tensor([p]), max_new_tokens=T, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]
    assert ours == want


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


# llama-quantize itself (llama_model_quantize, no importance matrix) on an F32 file, into each scheme.
_LLAMA_QUANTIZE = """
import ctypes, json, sys
import llama_cpp
source, jobs = sys.argv[1], json.loads(sys.argv[2])
for out, ftype in jobs:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {out}")
"""
_SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=512)
_SMALL |= dict(bos_token_id=1, eos_token_id=2)
# Shapes whose rules differ: tied or not, KV groups of 1, 2 and 4 (Q2_K's attn_v), biases (Qwen2), fused
# attn_qkv/ffn_up (Phi-3), 256-block rows and rows that fall back, and 80 layers (llama.cpp's 70B type).
QUANTIZE_SHAPES = {
    "qwen3": (_SMALL | dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=16, head_dim=64), None),
    "qwen3-tied-gqa4": (
        _SMALL
        | dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=9, num_attention_heads=8)
        | dict(num_key_value_heads=2, head_dim=32, intermediate_size=768, tie_word_embeddings=True),
        None,
    ),
    "llama-mqa": (
        _SMALL | dict(architectures=["LlamaForCausalLM"], num_hidden_layers=16, num_key_value_heads=1),
        None,
    ),
    "qwen2": (
        _SMALL | dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=12, num_key_value_heads=2),
        None,
    ),
    "phi3": (
        _SMALL
        | dict(architectures=["Phi3ForCausalLM"], num_hidden_layers=12, num_key_value_heads=2)
        | dict(partial_rotary_factor=0.75, tie_word_embeddings=True),
        None,
    ),
    **{
        f"{family}-80-layers-kv{kv}": (
            _SMALL
            | dict(architectures=[arch], num_hidden_layers=80, num_key_value_heads=kv, head_dim=64)
            | dict(intermediate_size=256, vocab_size=256),
            ("Q2_K", "Q3_K_S", "Q4_K_S", "Q4_K_M"),
        )
        for family, arch, kv in (
            ("qwen3", "Qwen3ForCausalLM", 2),
            ("llama", "LlamaForCausalLM", 2),
            ("llama", "LlamaForCausalLM", 4),
            ("qwen2", "Qwen2ForCausalLM", 4),
        )
    },
}


@pytest.mark.parametrize("name", list(QUANTIZE_SHAPES))
def test_llama_quantize_picks_the_types_the_writer_picks(tmp_path, name) -> None:
    """Every tensor's type in every scheme (model_types) is the one llama.cpp's own quantizer gives an F32
    file of the same family and shape: its rules by category, and its 70B type per family (an 80-layer Llama
    with KV groups or Qwen2 is one, an 80-layer Qwen3 or a Llama without KV groups is not)."""
    from hydragen.model.gguf_write import SCHEMES, float_maker, model_types, tensor_shapes

    hf, schemes = QUANTIZE_SHAPES[name]
    schemes = schemes or [s for s in SCHEMES if s != "F32"]
    cfg = ModelConfig.from_hf(hf)
    rng = np.random.default_rng(0)
    weights = {
        n: np.ones(s, np.float32) if len(s) == 1 else (0.05 * rng.standard_normal(s)).astype(np.float32)
        for n, s in tensor_shapes(cfg)
    }
    source = write_gguf(tmp_path / "f32.gguf", cfg, "F32", float_maker(weights, cfg))
    jobs = [(str(tmp_path / f"{s}.gguf"), SCHEMES[s][1]) for s in schemes]
    run = subprocess.run(
        [_llama_cpp_python(), "-c", _LLAMA_QUANTIZE, str(source), json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for scheme in schemes:
        got = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / f"{scheme}.gguf").tensors}
        want = model_types(scheme, cfg)
        assert {
            n: (want.get(n), got.get(n)) for n in set(want) | set(got) if want.get(n) != got.get(n)
        } == {}, scheme
