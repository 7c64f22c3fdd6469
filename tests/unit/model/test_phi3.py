"""The Phi-3 family (Phi-3, Phi-4-mini): LongRoPE and partial rotary against transformers' own rotary,
fused q/k/v and gate/up read as parts, GGUF files in llama.cpp's phi3 layout (written here with the gguf
package, and, in a slow test, by llama.cpp's own converter) kept quantized giving transformers' greedy
tokens, and the one-line refusals."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.model.config import ModelConfig
from hydragen.model.errors import ModelFileError
from hydragen.model.fused import fused_parts
from hydragen.model.gguf import read_gguf
from hydragen.model.linear import PackedProjection, rotate_leading
from hydragen.model.loader import load_model, read_hf_config
from hydragen.model.registry import family_named
from hydragen.model.rope import Rotary
from hydragen.native import quant
from tests.conftest import PHI_LONG, PHI_SHORT
from tests.unit.engine.test_engine_tiny import PROMPTS, T, hf_greedy

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=T, ignore_eos=True)


def _hf_config(**over) -> dict:
    cfg = dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": PHI_SHORT, "long_factor": PHI_LONG},
    )
    return {**cfg, **over}


# ---- LongRoPE and partial rotary against transformers' rotary ----------------------------------------------


def _hf_rotary(hf_cfg: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi-3 cos and sin for ``positions`` in one forward (its per-forward factor choice)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    fields = {k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")}
    rotary = Phi3RotaryEmbedding(Phi3Config(pad_token_id=0, **fields))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))
    return cos[0], sin[0]


@pytest.mark.parametrize(
    "case, positions",
    [
        # context 512 past the original 64: the long set at every position; transformers uses it when the
        # forward reaches past 64 tokens (a prompt longer than the original length)
        ("long", torch.arange(0, 100)),
        # a context of the original 64 (Phi-3-mini-4k's shape): the short set, attention factor 1, as
        # transformers computes any forward of at most 64 tokens
        ("short", torch.arange(0, 48)),
        # partial rotary (12 of 16 dims), long set
        ("partial", torch.arange(0, 100)),
    ],
)
def test_tables_are_transformers_bit_for_bit(case, positions) -> None:
    over = {"max_position_embeddings": 64, "sliding_window": 48} if case == "short" else {}
    if case == "partial":
        over = {
            "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "longrope", "short_factor": PHI_SHORT[:6], "long_factor": PHI_LONG[:6]},
        }
    hf_cfg = _hf_config(**over)
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.rope_scaling["long"] is (case != "short")
    assert cfg.max_position_embeddings == (64 if case == "short" else 512)
    assert cfg.rotary_dims == (12 if case == "partial" else 16)
    assert [s.window for s in cfg.layer_specs] == ([48, 48] if case == "short" else [])  # a window, not a cap
    factor = 1.0 if case == "short" else math.sqrt(1 + math.log(512 / 64) / math.log(64))
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(factor, rel=1e-15)
    want_cos, want_sin = _hf_rotary(hf_cfg, positions)
    rotary = Rotary(cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, "cpu")
    cos, signed_sin = rotary.tables(positions, torch.float32)
    half = cfg.rotary_dims // 2
    assert torch.equal(cos[:, 0], want_cos)
    assert torch.equal(signed_sin[:, 0, half:], want_sin[:, half:])
    assert torch.equal(-signed_sin[:, 0, :half], want_sin[:, :half])


def test_partial_rotation_is_transformers_bit_for_bit() -> None:
    """rotate_leading over 16-dim heads with 12-dim tables: the leading 12 of each head rotated (rotate-half
    within them), the last 4 passed through, as transformers' apply_rotary_pos_emb."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    hf_cfg = _hf_config(
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": PHI_SHORT[:6], "long_factor": PHI_LONG[:6]},
    )
    cfg = ModelConfig.from_hf(hf_cfg)
    positions = torch.arange(70)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(70, 4, 16, generator=gen)
    k = torch.randn(70, 2, 16, generator=gen)
    cos, sin = _hf_rotary(hf_cfg, positions)
    # transformers: [batch, heads, tokens, dim]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    rotary = Rotary(cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, "cpu")
    tc, ts = rotary.tables(positions, torch.float32)
    for x, want in ((q, want_q), (k, want_k)):
        got = rotate_leading(x.reshape(70, -1), (tc.view(70, -1), ts.view(70, -1), x.shape[1] * 16), 16)
        assert torch.equal(got.view_as(x), want[0].transpose(0, 1))
        assert torch.equal(got.view_as(x)[..., 12:], x[..., 12:])  # the pass-through dims


def test_config_reading() -> None:
    """ "su" is LongRoPE's first name; a window at least the context changes nothing; biases are never
    expected (transformers' Phi-3 has none); factor lists of the wrong length are refused."""
    base = ModelConfig.from_hf(_hf_config())
    su = _hf_config(rope_scaling={"type": "su", "short_factor": PHI_SHORT, "long_factor": PHI_LONG})
    assert ModelConfig.from_hf(su).rope_scaling["ext_factors"] == base.rope_scaling["ext_factors"]
    assert base.rope_scaling["ext_factors"] == tuple(PHI_LONG)
    wide = ModelConfig.from_hf(_hf_config(sliding_window=262144, attention_bias=True))
    assert wide.max_position_embeddings == 512 and wide.attention_bias is False
    assert ModelConfig.from_hf(_hf_config(max_position_embeddings=64)).rope_scaling["ext_factors"] == tuple(
        PHI_SHORT
    )  # a model whose context is the original length: the short set, attention factor 1
    assert ModelConfig.from_hf(_hf_config(max_position_embeddings=64)).rope_scaling["attention_factor"] == 1.0
    with pytest.raises(ValueError, match="long_factor should list 8 factors"):
        ModelConfig.from_hf(
            _hf_config(rope_scaling={"type": "longrope", "short_factor": PHI_SHORT, "long_factor": [1.0]})
        )
    with pytest.raises(ValueError, match="partial_rotary_factor 0.1 gives 1 rotary dims"):
        ModelConfig.from_hf(_hf_config(partial_rotary_factor=0.1, rope_scaling=None))


@pytest.mark.parametrize("arch", ["Phi3SmallForCausalLM", "PhiMoEForCausalLM", "PhiForCausalLM"])
def test_other_phi_architectures_are_refused_in_one_line(tmp_path, arch) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(_hf_config(architectures=[arch])))
    save_file({"model.norm.weight": torch.ones(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelFileError) as e:
        load_model(tmp_path, CPU, torch.float32)
    message = str(e.value)
    assert "\n" not in message and f"unsupported model architecture {arch!r}" in message
    assert "Phi3ForCausalLM" in message and "LlamaForCausalLM" in message


def test_a_phimoe_gguf_is_refused_in_one_line(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "phimoe")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"unsupported GGUF architecture 'phimoe' \(supported: .*phi3"):
        load_model(tmp_path / "moe.gguf", CPU, torch.float32)


# ---- fused tensors --------------------------------------------------------------------------------------


def test_fused_tensors_are_read_as_their_parts(tiny_models, tmp_path) -> None:
    """The parts' names and row ranges, the model's q/k/v and gate/up equal to the stored rows, and a fused
    tensor with rows the config does not call for refused naming it."""
    path = Path(tiny_models["phi3"])
    cfg = ModelConfig.from_hf(read_hf_config(path))
    family = family_named(cfg.family)
    parts = fused_parts(
        family, cfg, ["model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    )
    where = {n: (p.stored.rsplit(".", 2)[-2], p.lo, p.hi) for n, p in parts.items()}
    assert where == {
        "model.layers.1.self_attn.q_proj.weight": ("qkv_proj", 0, 64),
        "model.layers.1.self_attn.k_proj.weight": ("qkv_proj", 64, 96),
        "model.layers.1.self_attn.v_proj.weight": ("qkv_proj", 96, 128),
        "model.layers.0.mlp.gate_proj.weight": ("gate_up_proj", 0, 128),
        "model.layers.0.mlp.up_proj.weight": ("gate_up_proj", 128, 256),
    }
    from safetensors.torch import load_file, save_file

    sd = load_file(path / "model.safetensors")
    net, _, _ = load_model(path, CPU, torch.float32)
    for i, layer in enumerate(net.layers):
        assert torch.equal(layer.qkv.weight, sd[f"model.layers.{i}.self_attn.qkv_proj.weight"])
        assert torch.equal(layer.gate_up.weight, sd[f"model.layers.{i}.mlp.gate_up_proj.weight"])
    sd["model.layers.1.mlp.gate_up_proj.weight"] = sd["model.layers.1.mlp.gate_up_proj.weight"][:-1].clone()
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(
        ModelFileError, match=r"gate_up_proj.weight' has 255 rows, but its fused parts call for 256"
    ):
        load_model(tmp_path, CPU, torch.float32)


# ---- GGUF in llama.cpp's phi3 layout ----------------------------------------------------------------------

# Hugging Face names -> llama.cpp's, as its converter maps Phi-3 (gguf-py's tensor_mapping: qkv_proj is
# attn_qkv, gate_up_proj is ffn_up; no row permutation)
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top or hf == "lm_head.weight":
        return top.get(hf, "output.weight")
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"


def write_phi3_gguf(hf_dir: Path, out: Path, types: dict[str, Q]) -> Path:
    """The HF checkpoint as llama.cpp's converter writes a phi3 GGUF (its metadata keys, its tensor names and
    layout, the LongRoPE factors as two tensors), each tensor in ``types`` by GGUF name (default F32); the
    tokenizer is the embedded model's, cut to the vocabulary (what the engine needs to load a GGUF)."""
    from safetensors.torch import load_file

    from hydragen.model.gguf_write import _add_tokenizer

    hf = json.loads((hf_dir / "config.json").read_text())
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rope_dims = int(partial * n_embd) // n_head
    orig, ctx = hf["original_max_position_embeddings"], hf["max_position_embeddings"]
    w = gguf.GGUFWriter(str(out), "phi3")
    w.add_context_length(ctx)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    w.add_sliding_window(hf.get("sliding_window") or 0)
    scale = ctx / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, t in load_file(hf_dir / "model.safetensors").items():
        gname, arr = _gguf_name(name), t.float().numpy()
        qtype = types.get(gname, Q.F32)
        if qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        elif qtype == Q.F32:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    _add_tokenizer(w, hf["vocab_size"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def reference_dir(gguf_path: Path, hf_dir: Path, out: Path) -> Path:
    """The HF checkpoint with the GGUF's weights as the gguf package dequantizes them: what transformers
    runs as the oracle of a quantized file."""
    from safetensors.torch import save_file

    _, sd = read_gguf(gguf_path)
    out.mkdir(exist_ok=True)
    shutil.copy(hf_dir / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors")
    return out


# The kept formats, fused tensors among them: Q8_0 q/k/v and MLP output, F16 gate/up and o, a Q8_0 token
# table (the tied head of phi4_mini reads it).
KEPT = {"attn_qkv": Q.Q8_0, "ffn_up": Q.F16, "attn_output": Q.F16, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}


def _types(cfg_layers: int) -> dict[str, Q]:
    out = {"token_embd.weight": KEPT["token_embd"]}
    for i in range(cfg_layers):
        out |= {f"blk.{i}.{k}.weight": v for k, v in KEPT.items() if k != "token_embd"}
    return out


@pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")
@pytest.mark.parametrize("name", ["phi3", "phi3_window", "phi4_mini"])
def test_a_gguf_in_the_converters_layout_kept_quantized_gives_transformers_tokens(
    tiny_models, tmp_path, name
):
    hf_dir = Path(tiny_models[name])
    path = write_phi3_gguf(hf_dir, tmp_path / f"{name}.gguf", _types(2))
    hf_cfg, sd = read_gguf(path)
    cfg, want_cfg = ModelConfig.from_hf(hf_cfg), ModelConfig.from_hf(read_hf_config(hf_dir))
    for field in ("head_dim", "rotary_dim", "max_position_embeddings", "tie_word_embeddings", "num_kv_heads"):
        assert getattr(cfg, field) == getattr(want_cfg, field), field
    for key in ("long", "original_max_position_embeddings"):
        assert cfg.rope_scaling[key] == want_cfg.rope_scaling[key], key
    f32 = lambda c: torch.tensor(c.rope_scaling["ext_factors"], dtype=torch.float32)  # noqa: E731  (as stored)
    assert torch.equal(f32(cfg), f32(want_cfg))
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(want_cfg.rope_scaling["attention_factor"])
    assert "model.layers.0.self_attn.qkv_proj.weight" in sd and "model.layers.0.mlp.gate_up_proj.weight" in sd
    want = hf_greedy(str(reference_dir(path, hf_dir, tmp_path / "reference")), PROMPTS, T)
    llm = LLM(path, kv_cache_tokens=4096)
    layer = llm.model.layers[0]
    assert isinstance(layer.qkv, PackedProjection) and layer.qkv.qtypes == [Q.Q8_0]  # q, k, v: one run
    assert isinstance(layer.gate_up, PackedProjection) and layer.gate_up.qtypes == [Q.F16]
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


# ---- llama.cpp's converter itself (slow) ------------------------------------------------------------------

LLAMA_CPP = Path(
    os.environ.get("HYDRAGEN_LLAMA_CPP_SOURCE", "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
)


@pytest.mark.slow
@pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp's converter is not at {LLAMA_CPP} (set HYDRAGEN_LLAMA_CPP_SOURCE to a llama.cpp tree)",
)
@pytest.mark.parametrize("name, outtype", [("phi3", "f16"), ("phi4_mini", "q8_0")])
def test_llama_cpps_converter_output_gives_transformers_tokens(tmp_path, name, outtype) -> None:
    """A tiny Phi-3 / Phi-4-mini converted by llama.cpp's convert_hf_to_gguf.py (with its own gguf-py), then
    loaded kept in the file's format. The converter needs a tokenizer it knows: the embedded model's
    (49,152 tokens, so the tiny model takes that vocabulary)."""
    import transformers

    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer
    from tests.conftest import TINY

    spec = dict(TINY[name])
    arch, old_rope = spec.pop("arch"), spec.pop("old_rope", None)
    spec |= {"vocab_size": 49152} | (old_rope or {})
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(bos_token_id=1, eos_token_id=2, **spec)
    torch.manual_seed(7)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    hf_dir = tmp_path / name
    model.save_pretrained(hf_dir)
    load_tokenizer(default_model_path())._first.save_pretrained(hf_dir)
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"  # the converter's BPE path (else SentencePiece)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    out = tmp_path / f"{name}.gguf"
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    convert = [sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out)]
    run = subprocess.run([*convert, "--outtype", outtype], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    want = hf_greedy(str(reference_dir(out, hf_dir, tmp_path / "reference")), PROMPTS, T)
    llm = LLM(out, kv_cache_tokens=4096)
    assert isinstance(llm.model.layers[0].qkv, PackedProjection)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")
def test_a_tensor_parallel_rank_reads_its_heads_and_columns_of_each_fused_part(tiny_models, tmp_path) -> None:
    """Two ranks of the Phi-3 GGUF (Q8_0 attn_qkv, F16 fused ffn_up): each holds exactly its q heads, its
    KV head and its MLP columns of each part, kept in the file's blocks or dequantized."""
    from tests.unit.tp.test_tp_sharding import _check_rank

    path = write_phi3_gguf(Path(tiny_models["phi3"]), tmp_path / "phi3.gguf", _types(2))
    full, cfg, _ = load_model(path, CPU, torch.float32, dequantize=True)
    for rank in range(2):
        _check_rank(path, 2, rank, full, cfg, dequantize=True)
        _check_rank(path, 2, rank, full, cfg)
