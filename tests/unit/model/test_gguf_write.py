"""The GGUF writer, family by family: each family's file laid out as llama.cpp's converter lays it out (the
architecture's own tensor names, q/k permuted only for Llama, Qwen3's QK-norms, Gemma's four norms stored as
1 + w and its windows and soft-caps), read back by hydragen's
reader with every Hugging Face tensor equal to what was written, and run to transformers' greedy tokens; the
llama-quantize type rules as they differ between families."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.model.config import ModelConfig
from hydragen.model.gguf import read_gguf
from hydragen.model.gguf_write import (
    checkpoint_maker,
    model_types,
    scheme_type,
    tensor_shapes,
    write_gguf,
    writer_family,
)
from hydragen.model.presets import PRESETS
from tests.conftest import TINY, save_tiny

Q = gguf.GGMLQuantizationType
# tests/conftest.py's tiny checkpoints of the families with a GGUF form -> llama.cpp's architecture
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "phi4_mini": "phi3"}
ARCH |= {"gemma2": "gemma2", "gemma3": "gemma3"}
FAMILIES = list(ARCH)
# The tiny Gemmas as llama.cpp can hold them: query_pre_attn_scalar = head_dim (llama.cpp derives the scale,
# its files keep none), and windows shorter than the tests' sequences (7 + 8 tokens), so that a window read
# on the wrong layers changes the tokens. Gemma 3 keeps conftest's two local layers to one global (not
# llama.cpp's default six: the file carries the pattern).
GEMMA = {
    name: TINY[name] | dict(query_pre_attn_scalar=TINY[name]["head_dim"], sliding_window=window)
    for name, window in (("gemma2", 5), ("gemma3", 4))
}
# every prompt longer than the tiny Phi models' LongRoPE original length (4), where transformers' factor set
# is the one hydragen runs the model with (model/rope.py, longrope_scaling)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [11, 12, 13, 40, 41], [7, 8, 9, 10, 11]]


def _checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    return json.loads((Path(path) / "config.json").read_text()), load_file(Path(path) / "model.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, str]:
    """Each family's tiny checkpoint: conftest's, the Gemmas as ``GEMMA`` has them."""
    root = tmp_path_factory.mktemp("gguf_write_gemma")
    return {n: save_tiny(GEMMA[n], root / n) if n in GEMMA else tiny_models[n] for n in FAMILIES}


@pytest.fixture(scope="module")
def written(checkpoints, tmp_path_factory):
    """Each family's tiny checkpoint written by the writer, as F32 and as Q8_0."""
    root = tmp_path_factory.mktemp("gguf_write")
    out = {}
    for name in FAMILIES:
        hf, sd = _checkpoint(checkpoints[name])
        cfg = ModelConfig.from_hf(hf)
        for scheme in ("F32", "Q8_0"):
            out[name, scheme] = write_gguf(
                root / f"{name}.{scheme}.gguf", cfg, scheme, checkpoint_maker(sd, cfg)
            )
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_is_laid_out_in_its_llama_cpp_architecture(checkpoints, written, name) -> None:
    """The file's architecture is the family's, and every tensor name is one that llama.cpp's gguf package
    lists for that architecture (gguf.MODEL_TENSORS): Qwen3's QK-norms, Qwen2's q/k/v biases, Phi-3's fused
    attn_qkv and ffn_up and its LongRoPE factor tensors."""
    reader = gguf.GGUFReader(written[name, "F32"])
    arch = reader.fields["general.architecture"].contents()
    assert arch == ARCH[name]
    known = gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]
    cfg = ModelConfig.from_hf(_checkpoint(checkpoints[name])[0])
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) + suffix
        for t in known
        for i in range(cfg.num_layers)
        for suffix in (".weight", ".bias")
    }
    names = [t.name for t in reader.tensors]
    assert set(names) <= allowed, set(names) - allowed
    assert ("blk.0.attn_q_norm.weight" in names) == (name in ("qwen3", "gemma3"))
    gemma = arch.startswith("gemma")
    assert ("blk.0.post_attention_norm.weight" in names) == ("blk.3.post_ffw_norm.weight" in names) == gemma
    assert ("blk.0.attn_q.bias" in names) == (name == "qwen2")
    assert ("blk.0.attn_qkv.weight" in names) == ("blk.0.attn_q.weight" not in names) == (arch == "phi3")
    assert ("rope_factors_long.weight" in names) == (arch == "phi3")
    assert reader.fields[f"{arch}.attention.key_length"].contents() == cfg.head_dim
    assert (f"{arch}.vocab_size" in reader.fields) == (name == "llama")  # Llama's converter adds it
    if gemma:  # tied (no output), the window, and the pattern as a flag per layer (not llama.cpp's default)
        assert "output.weight" not in names
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
        assert meta[f"{arch}.attention.sliding_window"] == GEMMA[name]["sliding_window"]
        every = TINY[name].get("sliding_window_pattern", 2)
        pattern = [bool((i + 1) % every) for i in range(cfg.num_layers)]
        assert meta.get(f"{arch}.attention.sliding_window_pattern") == (pattern if every != 2 else None)
        caps = {"gemma2": (2.0, 3.0), "gemma3": (None, None)}[name]
        assert (
            meta.get(f"{arch}.attn_logit_softcapping"),
            meta.get(f"{arch}.final_logit_softcapping"),
        ) == caps
        assert meta.get(f"{arch}.rope.freq_base_swa") == (10_000.0 if name == "gemma3" else None)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_reader_reads_back_what_was_written(checkpoints, written, name) -> None:
    """F32: every Hugging Face tensor exactly, q/k put back in HF order where llama.cpp permutes them. Q8_0:
    the matrices are their Q8_0 rounding (the file's bytes), the vectors exact."""
    hf, sd = _checkpoint(checkpoints[name])
    cfg = ModelConfig.from_hf(hf)
    family = writer_family(cfg)
    config, got = read_gguf(written[name, "F32"])
    back = ModelConfig.from_hf(config)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "longrope":  # its factors come back as float32
        f32 = lambda c: np.float32(c.rope_scaling["ext_factors"])  # noqa: E731
        assert np.array_equal(f32(back), f32(cfg)) and back.rotary_dims == cfg.rotary_dims
        assert back.rope_scaling["attention_factor"] == pytest.approx(cfg.rope_scaling["attention_factor"])
        back, cfg = (dataclasses.replace(c, rope_scaling=None) for c in (back, cfg))
    assert back == cfg
    assert config["architectures"] == hf["architectures"]
    assert set(got) == {hf_name for _, hf_name, _ in family.gguf_tensors(cfg)}
    # the values the file holds: a Gemma norm as 1 + w (the loader adds nothing to a GGUF's)
    sd = {k: v.float() + family.hf_norm_offset if v.dim() == 1 else v.float() for k, v in sd.items()}
    for key, t in got.items():
        assert torch.equal(t, sd[key]), key
    # the file itself: Llama's q rows permuted, Qwen's and Phi's as they are
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(written[name, "F32"]).tensors}
    q = "attn_qkv" if "blk.0.attn_qkv.weight" in raw else "attn_q"
    stored_q, hf_q = raw[f"blk.0.{q}.weight"], sd[family.hf_name(f"blk.0.{q}.weight")].numpy()
    assert np.array_equal(stored_q, hf_q) == (not family.gguf_permuted_qk)

    _, q8 = read_gguf(written[name, "Q8_0"])
    tensors = gguf.GGUFReader(written[name, "Q8_0"]).tensors
    types = {family.hf_name(t.name): t.tensor_type for t in tensors if not t.name.startswith("rope_")}
    assert Q.Q8_0 in types.values()
    for key, t in q8.items():
        w = sd[key].float().numpy()
        if w.ndim == 1:
            assert types[key] == Q.F32 and np.array_equal(t.numpy(), w), key
        else:  # Q8_0, or F16 where rows are not whole 32-blocks (Qwen2's 60-wide o projection)
            rounded = gguf.quants.dequantize(gguf.quants.quantize(w, types[key]), types[key])
            assert np.array_equal(t.numpy(), rounded), key


@pytest.mark.parametrize("name", FAMILIES)
def test_the_written_file_generates_transformers_greedy_tokens(checkpoints, written, name) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    want = [
        hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]
    llm = LLM(str(written[name, "F32"]), kv_cache_tokens=1024)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_llama_quantize_treats_qwen3_by_category_and_never_as_70b() -> None:
    """Qwen3-8B's Q4_K_M mix (llama.cpp's src/llama-quant.cpp has no Qwen rule): QK-norms stay F32, attn_v and
    ffn_down Q6_K in the more-bits layers, the untied output Q6_K; an 80-layer Qwen3 is no 70B (its loader
    types none), where an 80-layer Qwen2 is one with or without KV groups and a Llama only with them."""
    cfg = ModelConfig.from_hf(PRESETS["qwen3-8b"])
    types = model_types("Q4_K_M", cfg)
    assert types["blk.0.attn_q_norm.weight"] == types["blk.35.attn_k_norm.weight"] == Q.F32
    assert [i for i in range(36) if types[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == [
        i for i in range(36) if types[f"blk.{i}.ffn_down.weight"] == Q.Q6_K
    ]
    assert (
        types["blk.3.attn_v.weight"]
        == types["blk.6.attn_v.weight"]
        == types["blk.31.attn_v.weight"]
        == Q.Q6_K
    )
    assert types["blk.5.attn_v.weight"] == types["blk.5.attn_q.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    tied = model_types("Q4_K_M", ModelConfig.from_hf(PRESETS["qwen3-1.7b"]))
    assert "output.weight" not in tied and tied["token_embd.weight"] == Q.Q6_K

    def v(family: str, gqa: int) -> Q:
        from hydragen.model.registry import family_named

        return scheme_type(
            "Q4_K_S", "blk.10.attn_v.weight", 4096, 80, False, gqa, family=family_named(family)
        )

    assert v("qwen3", 8) == v("llama", 1) == Q.Q4_K
    assert v("qwen2", 1) == v("qwen2", 8) == v("llama", 8) == Q.Q5_K
    # a fused attn_qkv (Phi-3's) is quantized as llama-quantize's attn_v category: Phi-4-mini's Q4_K_M mix
    phi = model_types("Q4_K_M", ModelConfig.from_hf(PRESETS["phi-4-mini"]))
    assert "blk.0.attn_q.weight" not in phi and "blk.0.ffn_gate.weight" not in phi
    assert {phi[f"blk.{i}.{t}.weight"] for i in (3, 6) for t in ("attn_qkv", "ffn_down")} == {Q.Q6_K}
    assert phi["blk.5.attn_qkv.weight"] == phi["blk.3.ffn_up.weight"] == Q.Q4_K
    assert phi["token_embd.weight"] == Q.Q6_K and "output.weight" not in phi  # tied
    assert scheme_type("Q8_0", "blk.0.attn_q.bias", 1, 32, False, ndim=1) == Q.F32
    assert scheme_type("F16", "blk.0.attn_q_norm.weight", 128, 32, False, ndim=1) == Q.F32


def test_a_tiny_qwen3_in_q4_k_m_loads_and_keeps_its_norms_in_f32(tmp_path) -> None:
    """A random Qwen3 in llama-quantize's mix: Q4_K/Q6_K matrices kept quantized, QK-norms read as floats."""
    from hydragen.model.gguf_write import random_maker
    from hydragen.model.linear import PackedProjection
    from hydragen.model.loader import load_model

    shape = PRESETS["qwen3-1.7b"] | dict(num_hidden_layers=2, vocab_size=512)
    cfg = ModelConfig.from_hf(shape)
    path = write_gguf(tmp_path / "qwen3.gguf", cfg, "Q4_K_M", random_maker())
    assert dict(tensor_shapes(cfg))["blk.1.attn_k_norm.weight"] == (128,)
    net, got, _ = load_model(path, torch.device("cpu"), torch.float32)
    assert got.family == "qwen3" and got.qk_norm and got.tie_word_embeddings
    assert isinstance(net.layers[1].qkv, PackedProjection)
    assert set(net.layers[1].qkv.qtypes) == {int(Q.Q4_K), int(Q.Q6_K)}  # attn_v in a more-bits layer
    assert torch.equal(net.layers[1].q_norm, torch.ones(128))


def test_a_tiny_phi_4_mini_in_q4_k_m_loads_its_fused_tensors_as_parts(tmp_path) -> None:
    """A random Phi-4-mini in llama-quantize's mix: the fused attn_qkv one Q6_K run in a more-bits layer, read
    as q, k and v; partial rotary from rope.dimension_count."""
    from hydragen.model.gguf_write import random_maker
    from hydragen.model.linear import PackedProjection
    from hydragen.model.loader import load_model

    shape = PRESETS["phi-4-mini"] | dict(num_hidden_layers=2, vocab_size=512, bos_token_id=1, eos_token_id=2)
    cfg = ModelConfig.from_hf(shape)
    path = write_gguf(tmp_path / "phi.gguf", cfg, "Q4_K_M", random_maker())
    net, got, _ = load_model(path, torch.device("cpu"), torch.float32)
    assert got == cfg and got.rotary_dims == 96
    assert isinstance(net.layers[1].qkv, PackedProjection) and net.layers[1].qkv.qtypes == [int(Q.Q6_K)]


def test_every_preset_has_a_gguf_layout() -> None:
    from hydragen.model.presets import config_for_random_weights

    for name, hf in PRESETS.items():
        cfg = ModelConfig.from_hf(config_for_random_weights(name)[0])
        assert cfg == ModelConfig.from_hf(hf) and model_types("Q4_K_M", cfg), name
        assert writer_family(cfg).gguf_metadata(cfg) is not None, name  # the family can write this shape


def test_linear_rope_scaling_and_mistral_are_written_as_llama_cpp_writes_them(tiny_models, tmp_path) -> None:
    """A linear RoPE factor goes into ``{arch}.rope.scaling.*`` and reads back; Mistral has no architecture
    of its own in llama.cpp, whose converter writes it as ``llama``, and so does the writer."""
    from hydragen.model.gguf_write import random_maker

    hf = PRESETS["qwen3-1.7b"] | dict(num_hidden_layers=1, vocab_size=512, bos_token_id=1, eos_token_id=2)
    hf |= dict(rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_hf(hf)
    config, _ = read_gguf(write_gguf(tmp_path / "linear.gguf", cfg, "Q8_0", random_maker()))
    assert ModelConfig.from_hf(config) == cfg and cfg.rope_scaling["factor"] == 4.0
    mistral = ModelConfig.from_hf(_checkpoint(tiny_models["mistral"])[0])
    assert writer_family(mistral).gguf_architecture == "llama"


def test_gemma_presets_take_llama_quantizes_types_and_what_llama_cpp_cannot_hold_is_refused() -> None:
    """Gemma 3 1B's Q4_K_M (tied; 1,152-wide rows are no whole 256-blocks): the embedding Q8_0, 1,152-wide
    matrices Q5_0, every norm F32; Gemma 2 2B's tied embedding Q6_K. A query_pre_attn_scalar llama.cpp would
    not derive, or a Gemma 2 without soft-caps, is refused by the writer."""
    g3 = model_types("Q4_K_M", ModelConfig.from_hf(PRESETS["gemma-3-1b"]))
    assert "output.weight" not in g3 and g3["token_embd.weight"] == Q.Q8_0
    assert g3["blk.5.attn_q.weight"] == g3["blk.5.ffn_gate.weight"] == Q.Q5_0  # 1,152 columns
    assert (
        g3["blk.5.attn_output.weight"] == Q.Q4_K
        and g3["blk.5.ffn_down.weight"] == Q.Q6_K != g3["blk.4.ffn_down.weight"]
    )
    assert {g3[f"blk.7.{n}.weight"] for n in ("post_attention_norm", "post_ffw_norm", "attn_k_norm")} == {
        Q.F32
    }
    g2 = model_types("Q4_K_M", ModelConfig.from_hf(PRESETS["gemma-2-2b"]))
    assert "output.weight" not in g2 and g2["token_embd.weight"] == Q.Q6_K
    for name in ("gemma2", "gemma3"):
        hf = TINY[name] | {"architectures": [TINY[name]["arch"]], "model_type": name}
        cfg = ModelConfig.from_hf(hf)  # query_pre_attn_scalar 24, head_dim 16 or 32
        with pytest.raises(ValueError, match="query_pre_attn_scalar"):
            writer_family(cfg).gguf_metadata(cfg)
    capless = ModelConfig.from_hf(PRESETS["gemma-2-2b"] | {"attn_logit_softcapping": None})
    with pytest.raises(ValueError, match="soft-cap"):
        writer_family(capless).gguf_metadata(capless)
