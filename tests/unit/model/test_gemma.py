"""Gemma 2 and Gemma 3 (text): the decoder's Gemma switches against transformers, their configs (HF and
llama.cpp's GGUF metadata), and what is refused (the vision checkpoint, an mmproj file).

The decoder is checked here through a plain attention callback that computes each layer's spec (scale,
window, soft-cap) itself, over contexts several windows long: it checks the decoder alone, whatever the
attention kernels compute. The engine's own runs are in tests/unit/engine/test_engine_tiny.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hydragen.attention.layer_spec import AttentionSpec, model_layer_specs
from hydragen.kv.layout import KVLayout, model_kv_layout, window_groups
from hydragen.model.config import ModelConfig
from hydragen.model.errors import ModelFileError
from hydragen.model.gguf import read_gguf
from hydragen.model.gguf_write import _add_tokenizer
from hydragen.model.loader import load_model, parse_config
from tests.conftest import TINY, save_tiny

CPU = torch.device("cpu")
WINDOW = 8  # the windows of the decoder checks: their 40-token contexts are five windows long


def plain_attention(cfg: ModelConfig):
    """attention(layer, q, k, v) for one sequence at positions 0..T-1, each layer as its spec says: scores
    scaled, soft-capped, causal and within the window, in float32."""
    specs = model_layer_specs(cfg)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = specs.specs[specs.of_layer[i]]
        t, heads, _ = q.shape
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1).float() for x in (k, v))
        s = torch.einsum("thd,shd->hts", q.float(), k) * spec.scale
        if spec.soft_cap is not None:
            s = torch.tanh(s / spec.soft_cap) * spec.soft_cap
        i_, j_ = torch.arange(t)[:, None], torch.arange(t)[None]
        seen = (j_ <= i_) & ((i_ - j_ < spec.window) if spec.window is not None else True)
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", p, v).to(q.dtype)

    return attend


def logits_of(net, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    hidden = net(ids, torch.arange(len(ids)), plain_attention(cfg))
    return net.logits(hidden)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def narrow(name: str) -> dict:
    """The TINY entry with windows of WINDOW tokens."""
    return {**TINY[name], "sliding_window": WINDOW}


@pytest.fixture(scope="module")
def narrow_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: save_tiny(narrow(name), root / name) for name in ("gemma2", "gemma3")}


IDS = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_decoder_computes_transformers_logits(narrow_models, name) -> None:
    """Sandwich norms, (1 + w) norms (q/k norms too), GeGLU, the embedding scale, query_pre_attn_scalar,
    soft-caps, windows five times over and Gemma 3's local and global RoPE, all at once."""
    net, cfg, _ = load_model(narrow_models[name], CPU, torch.float32)
    got, want = logits_of(net, cfg, IDS), hf_logits(narrow_models[name], IDS)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    # Each switch matters in this check: the logits move when one is off.
    for change in (
        dict(sandwich_norms=False),
        dict(activation="silu"),
        dict(embed_scale=1.0),
        dict(layer_specs=tuple(AttentionSpec(scale=s.scale, soft_cap=s.soft_cap) for s in cfg.layer_specs)),
        *([dict(local_rope_theta=None)] if name == "gemma3" else []),
        *([dict(final_logit_softcap=None)] if name == "gemma2" else []),
        *([dict(layer_specs=tuple(AttentionSpec(scale=s.scale, window=s.window) for s in cfg.layer_specs))]
          if name == "gemma2" else []),
    ):  # fmt: skip
        moved = _logits_with(net, dataclasses.replace(cfg, **change), IDS)
        assert (moved - want).abs().max() > 1e-3, change


def _logits_with(net, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """The loaded model's logits under another config's switches (its weights as they are)."""
    saved = (net.cfg, net._plain_tail, net._local_rope, net.local_rotary)
    net.cfg = cfg
    net._plain_tail = not cfg.sandwich_norms and cfg.activation == "silu"
    net._local_rope = tuple(cfg.uses_local_rope(i) for i in range(cfg.num_layers))
    if cfg.local_rope_theta is None:
        net.local_rotary = None
    try:
        return logits_of(net, cfg, ids)
    finally:
        net.cfg, net._plain_tail, net._local_rope, net.local_rotary = saved


def test_gemma2_config() -> None:
    cfg = parse_config(_hf_config("gemma2"), _where())
    assert (cfg.family, cfg.sandwich_norms, cfg.activation, cfg.qk_norm) == (
        "gemma2",
        True,
        "gelu_tanh",
        False,
    )
    assert cfg.embed_scale == 8.0 and cfg.final_logit_softcap == 3.0 and cfg.local_rope_theta is None
    cap, scale = 2.0, 24**-0.5
    assert cfg.layer_specs == (
        AttentionSpec(scale, 64, cap),
        AttentionSpec(scale, None, cap),
        AttentionSpec(scale, 64, cap),
        AttentionSpec(scale, None, cap),
    )
    assert cfg.kv_groups == (1, 0, 1, 0)  # full layers first: group 0 keeps every page


def test_gemma3_config_new_and_old_layouts() -> None:
    hf = _hf_config("gemma3")
    cfg = parse_config(hf, _where())
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.final_logit_softcap is None
    assert [s.window for s in cfg.layer_specs] == [64, 64, None, 64, 64, None]
    assert all(s.soft_cap is None and s.scale == 24**-0.5 for s in cfg.layer_specs)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10_000.0, None)
    assert [cfg.uses_local_rope(i) for i in range(6)] == [True, True, False, True, True, False]
    assert cfg.kv_groups == (1, 1, 0, 2, 2, 0)
    assert model_kv_layout(cfg).released == {1: 64, 2: 64}  # group 0 (full) keeps every page
    # google/gemma-3-4b's text config, as saved before per-layer-type rope dicts and layer_types
    old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    old |= dict(
        rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10_000.0,
        sliding_window_pattern=3,
    )
    assert parse_config(old, _where()) == cfg
    # the default pattern: five local layers, then a global one
    six = parse_config({**old, "sliding_window_pattern": None}, _where())
    assert [s.window for s in six.layer_specs] == [64] * 5 + [None]


def test_window_groups_take_equal_rows() -> None:
    assert window_groups([True, False] * 3) == (1, 0, 1, 0, 1, 0)
    assert window_groups([True] * 4) == window_groups([False] * 4) == (0,) * 4
    gemma3_1b = window_groups([(i + 1) % 6 != 0 for i in range(26)])
    layout = KVLayout(gemma3_1b)
    assert (layout.groups, layout.rows) == (7, 4)  # 28 rows a page for 26 layers
    full = {g for g, i in zip(gemma3_1b, range(26), strict=True) if (i + 1) % 6 == 0}
    assert full == {0} and all(gemma3_1b.count(g) <= 4 for g in set(gemma3_1b))


def test_refused_with_one_line(tmp_path) -> None:
    vision = {**_hf_config("gemma3"), "architectures": ["Gemma3ForConditionalGeneration"]}
    with pytest.raises(ModelFileError, match="vision tower.*gemma3 GGUF.*Gemma3ForCausalLM") as e:
        parse_config(vision, _where())
    assert "\n" not in str(e.value)
    with pytest.raises(ModelFileError, match="use_bidirectional_attention"):
        parse_config({**_hf_config("gemma3"), "use_bidirectional_attention": True}, _where())
    with pytest.raises(ModelFileError, match="activation"):
        parse_config({**_hf_config("gemma2"), "hidden_activation": "relu"}, _where())
    w = gguf.GGUFWriter(str(tmp_path / "mmproj.gguf"), "clip")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"mmproj.*text") as e:
        read_gguf(tmp_path / "mmproj.gguf")
    assert "\n" not in str(e.value)


def _hf_config(name: str) -> dict:
    """The config.json transformers writes for the TINY entry (without saving weights)."""
    import transformers

    spec = {k: v for k, v in TINY[name].items() if k not in ("random_norms", "embed_std")}
    arch = spec.pop("arch")
    cls = getattr(transformers, spec.pop("config_class", arch.replace("ForCausalLM", "Config")))
    d = cls(bos_token_id=1, eos_token_id=2, **spec).to_dict()
    d["architectures"] = [arch]
    return json.loads(json.dumps(d))


def _where() -> Path:
    return Path("config.json")


# ---- GGUF, as llama.cpp's converter lays it out ------------------------------------------------------------

Q = gguf.GGMLQuantizationType
# HF tensor suffix -> llama.cpp's block tensor name (no q/k permutation: Gemma's RoPE is NeoX-style there)
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def write_gemma_gguf(hf_dir, path, types: dict[str, Q], pattern: int | None = None) -> dict[str, np.ndarray]:
    """The HF checkpoint as llama.cpp's converter writes it: its metadata keys, norms stored as 1 + w,
    tied embeddings, no lm_head; matrices in ``types`` (default F32); a tokenizer. Returns the weights as
    the file holds them, dequantized: what transformers must compute with to be the oracle."""
    from safetensors.torch import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    arch = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}[hf["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_sliding_window(hf["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    else:
        rope = hf["rope_parameters"]
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    _add_tokenizer(w, hf["vocab_size"])  # the embedded model's, cut to the vocabulary (the engine needs one)
    stored = {}
    for name, t in sorted(load_file(hf_dir / "model.safetensors").items()):
        if name == "lm_head.weight":
            continue
        arr = t.float().numpy()
        if arr.ndim == 1:
            arr = arr + np.float32(1.0)  # Gemma's norms compute x * (1 + w): llama.cpp stores 1 + w
        g, qtype = gguf_name(name), types.get(name, Q.F32)
        if qtype == Q.F32 or arr.ndim == 1:
            w.add_tensor(g, arr)
            stored[name] = arr
        elif qtype == Q.F16:
            w.add_tensor(g, arr.astype(np.float16))
            stored[name] = arr.astype(np.float16).astype(np.float32)
        else:
            blocks = gguf.quants.quantize(arr, qtype)
            w.add_tensor(g, blocks, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(blocks, qtype).reshape(arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def oracle_dir(hf_dir, stored: dict[str, np.ndarray], out):
    """The HF checkpoint holding the GGUF's (dequantized) weights: transformers computing what the file
    holds."""
    from safetensors.torch import save_file

    out.mkdir()
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = {k: torch.from_numpy(v - 1.0 if v.ndim == 1 else v).contiguous() for k, v in stored.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def gguf_spec(name: str) -> dict:
    """llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5 (but the 27B's), so the
    GGUF models have query_pre_attn_scalar = head_dim, as every released size but the 27B has."""
    spec = narrow(name)
    return {**spec, "query_pre_attn_scalar": spec["head_dim"]}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory) -> dict:
    """Per family: (HF dir, F32 GGUF, quantized GGUF, the HF dir holding the quantized file's weights)."""
    root = tmp_path_factory.mktemp("gemma_gguf")
    out = {}
    for name in ("gemma2", "gemma3"):
        hf_dir = root / name
        save_tiny(gguf_spec(name), hf_dir)
        pattern = 3 if name == "gemma3" else None  # the key llama.cpp reads; absent: Gemma 2's default, 2
        write_gemma_gguf(hf_dir, root / f"{name}-f32.gguf", {}, pattern)
        layer = "model.layers.1."
        types = {
            "model.embed_tokens.weight": Q.Q8_0,
            layer + "self_attn.q_proj.weight": Q.Q8_0,
            layer + "self_attn.k_proj.weight": Q.F16,
            layer + "mlp.gate_proj.weight": Q.Q8_0,
            layer + "mlp.up_proj.weight": Q.Q8_0,
            layer + "mlp.down_proj.weight": Q.F16,
            "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
        }
        stored = write_gemma_gguf(hf_dir, root / f"{name}-q.gguf", types, pattern)
        out[name] = (
            hf_dir,
            root / f"{name}-f32.gguf",
            root / f"{name}-q.gguf",
            oracle_dir(hf_dir, stored, root / f"{name}-oracle"),
        )
    return out


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_config_is_the_checkpoints(gguf_models, name) -> None:
    hf_dir, f32, _, _ = gguf_models[name]
    from_hf = parse_config(json.loads((hf_dir / "config.json").read_text()), _where())
    cfg, sd = read_gguf(f32)
    from_gguf = ModelConfig.from_hf(cfg)
    assert "lm_head.weight" not in sd and from_gguf.tie_word_embeddings
    assert cfg["model_type"] == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[name]
    same = (
        "layer_specs",
        "kv_groups",
        "rope_theta",
        "rope_scaling",
        "local_rope_theta",
        "embed_scale",
        "final_logit_softcap",
        "qk_norm",
        "sandwich_norms",
        "activation",
        "head_dim",
        "num_kv_heads",
    )
    for field in same:
        assert getattr(from_gguf, field) == getattr(from_hf, field), field


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_computes_transformers_logits(gguf_models, name) -> None:
    """F32 files: transformers' logits from the HF checkpoint. Files with Q8_0 and F16 matrices kept in
    their format: transformers' logits from those blocks dequantized, within the kernels' rounding (they
    quantize activations to 15 bits)."""
    hf_dir, f32, quantized, oracle = gguf_models[name]
    net, cfg, _ = load_model(f32, CPU, torch.float32)
    assert torch.allclose(logits_of(net, cfg, IDS), hf_logits(hf_dir, IDS), rtol=0, atol=1e-5)
    net, cfg, _ = load_model(quantized, CPU, torch.float32)
    from hydragen.model.linear import PackedEmbedding, PackedProjection

    assert isinstance(net.embed, PackedEmbedding) and isinstance(net.layers[1].gate_up, PackedProjection)
    got, want = logits_of(net, cfg, IDS), hf_logits(oracle, IDS)
    assert (got - want).abs().max() < 2e-3, (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- llama.cpp's converter itself (slow) ------------------------------------------------------------------

LLAMA_CPP = Path(
    os.environ.get("HYDRAGEN_LLAMA_CPP_SOURCE", "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
)
needs_converter = pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp's converter is not at {LLAMA_CPP} (set HYDRAGEN_LLAMA_CPP_SOURCE to a llama.cpp tree)",
)


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, with its own gguf-py, on ``hf_dir``. It needs a tokenizer it
    knows, and Gemma 2's needs SentencePiece (not installed here): the Gemma 3 models take the embedded
    model's BPE tokenizer (49,152 tokens), whose pre-tokenizer the converter knows as smollm's."""
    from transformers import AutoTokenizer

    from hydragen.model.default_model import default_model_path

    model = default_model_path()
    AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name).save_pretrained(hf_dir)
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    command = [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out)]
    run = subprocess.run([*command, "--outtype", outtype], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def file_oracle(path: Path, config: dict, out: Path) -> Path:
    """An HF Gemma3ForCausalLM directory holding exactly the GGUF's weights (dequantized by the gguf package,
    norms back to w): transformers computing what the file holds."""
    from safetensors.torch import save_file

    to_hf = {v: k for k, v in GGUF_NAMES.items()}
    tensors = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, role, _ = t.name.split(".")
            name = f"model.layers.{layer}.{to_hf[role]}.weight"
        tensors[name] = torch.from_numpy(w - 1.0 if w.ndim == 1 else w).contiguous()
    out.mkdir()
    config = {**config, "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0])}
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def converter_spec() -> dict:
    """Gemma 3 as the converter keeps it: query_pre_attn_scalar = head_dim (llama.cpp keeps none) and the
    default pattern (five local layers, a global one: the converter writes no pattern)."""
    spec = {k: v for k, v in gguf_spec("gemma3").items() if k != "sliding_window_pattern"}
    return {**spec, "vocab_size": 49152}


@pytest.mark.slow
@needs_converter
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_llama_cpps_converter_output_computes_transformers_logits(tmp_path, outtype) -> None:
    """A tiny Gemma3ForCausalLM through convert_hf_to_gguf.py, loaded kept in the file's format: the logits
    of transformers running the file's weights over a context five windows long, and its greedy tokens
    through the engine."""
    from hydragen.model.linear import PackedProjection

    hf_dir = tmp_path / "hf"
    save_tiny(converter_spec(), hf_dir)
    path = convert(hf_dir, tmp_path / f"gemma3-{outtype}.gguf", outtype)
    oracle = file_oracle(path, json.loads((hf_dir / "config.json").read_text()), tmp_path / "oracle")
    net, cfg, _ = load_model(path, CPU, torch.float32)
    assert [s.window for s in cfg.layer_specs] == [WINDOW] * 5 + [None]
    if outtype != "f32":
        assert isinstance(net.layers[0].gate_up, PackedProjection)
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0))
    got, want = logits_of(net, cfg, ids), hf_logits(oracle, ids)
    assert (got - want).abs().max() < (1e-5 if outtype == "f32" else 2e-3), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # and through the engine, on prompts several windows long
    from hydragen import LLM, SamplingParams
    from tests.unit.engine.test_engine_tiny import LONG_PROMPTS, LONG_T, hf_greedy

    llm = LLM(str(path), kv_cache_tokens=4096, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=LONG_T, ignore_eos=True)
    outs = llm.generate(LONG_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(oracle), LONG_PROMPTS, LONG_T)


@pytest.mark.slow
@needs_converter
def test_the_text_part_of_gemma3_for_conditional_generation_loads(tmp_path) -> None:
    """convert_hf_to_gguf.py writes the text part of Gemma3ForConditionalGeneration as a gemma3 GGUF (the
    vision tower goes to a separate mmproj): it loads, and computes the checkpoint's text logits."""
    import transformers

    spec = {
        k: v
        for k, v in converter_spec().items()
        if k not in ("arch", "config_class", "random_norms", "embed_std")
    }
    text = transformers.Gemma3TextConfig(bos_token_id=1, eos_token_id=2, **spec)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32
    )
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=49151,
        boi_token_index=49150,
        eoi_token_index=49149,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() == 2 else 0.3)
    hf_dir = tmp_path / "vlm"
    model.save_pretrained(hf_dir)
    with pytest.raises(ModelFileError, match="vision tower"):
        load_model(hf_dir, CPU, torch.float32)
    path = convert(hf_dir, tmp_path / "gemma3-text.gguf", "f32")
    net, cfg, _ = load_model(path, CPU, torch.float32)
    ids = torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(input_ids=ids[None]).logits[0].float()
    got = logits_of(net, cfg, ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_16_bit_models_norm_in_gemmas_order(narrow_models) -> None:
    """Gemma's RMSNorm multiplies by 1 + w in float32 and rounds once (Llama's rounds, then multiplies): a
    bfloat16 model keeps its (1 + w) in float32 and gives transformers' norm bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from hydragen.model.linear import rms_norm

    net, cfg, _ = load_model(narrow_models["gemma3"], CPU, torch.bfloat16)
    layer = net.layers[0]
    norms = (
        layer.attn_norm,
        layer.post_attn_norm,
        layer.mlp_norm,
        layer.post_mlp_norm,
        layer.q_norm,
        net.norm,
    )
    assert all(n.dtype == torch.float32 for n in norms) and layer.qkv.weight.dtype == torch.bfloat16
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).mul(3).to(torch.bfloat16)
    hf = Gemma3RMSNorm(64, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        hf.weight.copy_(layer.attn_norm - 1.0)
        want = hf(x)
    got = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    llama_order = layer.attn_norm.to(torch.bfloat16) * rms_norm(
        x, torch.ones(64, dtype=x.dtype), cfg.rms_norm_eps
    )
    assert not torch.equal(llama_order, want)  # the order matters in bfloat16


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_kept_quantized_gives_transformers_greedy_tokens(gguf_models, name) -> None:
    """Through the engine (window kernels, prompts several windows long): the quantized file's greedy
    tokens are transformers' on its dequantized weights, and the F32 file's the checkpoint's."""
    from hydragen import LLM, SamplingParams
    from tests.unit.engine.test_engine_tiny import LONG_PROMPTS, LONG_T, hf_greedy

    hf_dir, f32, quantized, oracle = gguf_models[name]
    params = SamplingParams(n=2, temperature=0, max_tokens=LONG_T, ignore_eos=True)
    for path, reference in ((quantized, oracle), (f32, hf_dir)):
        want = hf_greedy(str(reference), LONG_PROMPTS, LONG_T)
        llm = LLM(str(path), kv_cache_tokens=4096, page_size=4)
        got = llm.generate(LONG_PROMPTS, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[w, w] for w in want], path.name
