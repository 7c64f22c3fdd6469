"""Gemma 2 and Gemma 3 (text): the decoder's Gemma switches against transformers, their configs (HF and
llama.cpp's GGUF metadata), and what is refused (the vision checkpoint, an mmproj file).

The decoder is checked here through a plain attention callback that computes each layer's spec (scale,
window, soft-cap) itself, over contexts several windows long: it checks the decoder alone, whatever the
attention kernels compute. The engine's own runs are in tests/unit/engine/test_engine_tiny.py."""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch

from hydragen.attention.layer_spec import AttentionSpec, model_layer_specs
from hydragen.kv.layout import KVLayout, window_groups
from hydragen.model.config import ModelConfig
from hydragen.model.errors import ModelFileError
from hydragen.model.gguf import read_gguf
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
    assert cfg.kv_groups == (0, 1, 0, 1)


def test_gemma3_config_new_and_old_layouts() -> None:
    hf = _hf_config("gemma3")
    cfg = parse_config(hf, _where())
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.final_logit_softcap is None
    assert [s.window for s in cfg.layer_specs] == [64, 64, None, 64, 64, None]
    assert all(s.soft_cap is None and s.scale == 24**-0.5 for s in cfg.layer_specs)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10_000.0, None)
    assert [cfg.uses_local_rope(i) for i in range(6)] == [True, True, False, True, True, False]
    assert cfg.kv_groups == (0, 0, 1, 2, 2, 1)
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
    assert window_groups([True, False] * 3) == (0, 1, 0, 1, 0, 1)
    assert window_groups([True] * 4) == window_groups([False] * 4) == (0,) * 4
    gemma3_1b = window_groups([(i + 1) % 6 != 0 for i in range(26)])
    layout = KVLayout(gemma3_1b)
    assert (layout.groups, layout.rows) == (7, 4)  # 28 rows a page for 26 layers
    full = {g for g, i in zip(gemma3_1b, range(26), strict=True) if (i + 1) % 6 == 0}
    assert len(full) == 1 and all(gemma3_1b.count(g) <= 4 for g in set(gemma3_1b))


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

    spec = {k: v for k, v in TINY[name].items() if k not in ("random_norms",)}
    arch = spec.pop("arch")
    cls = getattr(transformers, spec.pop("config_class", arch.replace("ForCausalLM", "Config")))
    d = cls(bos_token_id=1, eos_token_id=2, **spec).to_dict()
    d["architectures"] = [arch]
    return json.loads(json.dumps(d))


def _where():
    from pathlib import Path

    return Path("config.json")
