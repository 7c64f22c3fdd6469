"""The q/k/v projection's epilogue (native/csrc/quant_matmul.cpp, ``hq::QkvEpilogue``): the bias, RMSNorm over
each head of q and k, and the rotary on each head's leading columns, against a float64 reference; Gemma's
GeGLU and output norms against torch; and the families they let into the one-call layer stack (Qwen2's
biases, Qwen3's QK-norm, Phi-4-mini's partial rotary, Gemma's sandwich norms, GeGLU and local rotary)
giving the per-op path's tokens and logprobs bit for bit."""

from __future__ import annotations

import pytest
import torch

from hydragen.model import layer_stack
from hydragen.model.config import ModelConfig
from hydragen.model.gguf_write import checkpoint_maker, write_gguf
from hydragen.native import quant
from tests.conftest import TINY, save_tiny
from tests.unit.model.test_quant_model import assert_one_call_is_the_per_op_path

pytestmark = pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")


def _reference(y, bias, q_norm, k_norm, eps, head_dim, q_cols, k_cols, cos, sin) -> torch.Tensor:
    """The model's order in float64: bias, per-head RMSNorm of q and k, rotate-half on each head's leading
    ``cos.shape[1]`` columns of q and k."""
    y = y.double().clone()
    if bias is not None:
        y += bias.double()
    t = y.shape[0]
    for norm, start, cols in ((q_norm, 0, q_cols), (k_norm, q_cols, k_cols)):
        if norm is None:
            continue
        heads = y[:, start : start + cols].view(t, -1, head_dim)
        rms = torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
        y[:, start : start + cols] = (heads * rms * norm.double()).reshape(t, cols)
    if cos is not None:
        d = cos.shape[1]
        heads = y[:, : q_cols + k_cols].view(t, -1, head_dim)
        part = heads[..., :d].clone()
        swapped = torch.cat([part[..., d // 2 :], part[..., : d // 2]], dim=-1)
        heads[..., :d] = part * cos.double().unsqueeze(1) + swapped * sin.double().unsqueeze(1)
    return y


@pytest.mark.parametrize(
    "bias,qk_norm,rot", [(True, False, 16), (False, True, 16), (False, False, 12), (True, True, 12)]
)
def test_the_epilogue_is_the_models_order_in_one_call(bias, qk_norm, rot) -> None:
    g = torch.Generator().manual_seed(0)
    t, d, q_cols, k_cols = 5, 16, 4 * 16, 2 * 16
    ld = q_cols + 2 * k_cols
    y = torch.randn(t, ld, generator=g)
    b = torch.randn(ld, generator=g) if bias else None
    qn, kn = (
        (1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g))
        if qk_norm
        else (None,) * 2
    )
    angles = torch.randn(t, rot // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, dim=1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=1)  # rotate-half's signed sin
    want = _reference(y, b, qn, kn, 1e-6, d, q_cols, k_cols, cos, sin)
    got = torch.ops.hydragen.qkv_epilogue(y.clone(), b, qn, kn, 1e-6, d, q_cols, k_cols, cos, sin)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6), float((got.double() - want).abs().max())
    assert torch.equal(
        got[:, q_cols + k_cols :], y[:, q_cols + k_cols :] + (0 if b is None else b[q_cols + k_cols :])
    )


def test_the_epilogue_refuses_heads_that_do_not_fit() -> None:
    y = torch.zeros(2, 96)
    with pytest.raises(RuntimeError, match="whole heads of 16"):
        torch.ops.hydragen.qkv_epilogue(y, None, None, None, 1e-6, 16, 40, 16, None, None)
    with pytest.raises(RuntimeError, match="q_norm must be a contiguous float32 vector of 16"):
        torch.ops.hydragen.qkv_epilogue(y, None, torch.ones(8), None, 1e-6, 16, 32, 16, None, None)
    wide = torch.ones(2, 24)  # a rotary wider than the head
    with pytest.raises(RuntimeError, match="rope tables"):
        torch.ops.hydragen.qkv_epilogue(y, None, None, None, 1e-6, 16, 32, 16, wide, wide)


def test_geglu_and_the_output_norm_are_torchs_to_float32_rounding() -> None:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    y = 3 * torch.randn(7, 2 * 37, generator=g)  # 37: whole vectors and a scalar tail
    gate, up = y.double().chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = torch.ops.hydragen.geglu_rows(y)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), float((got.double() - want).abs().max())
    w = 1 + 0.1 * torch.randn(37, generator=g)
    x = torch.randn(5, 37, generator=g)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(torch.ops.hydragen.rms_norm_rows(x, w, 1e-6).double(), ref, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def family_ggufs(tmp_path_factory) -> dict[str, str]:
    """conftest's tiny Qwen2, Qwen3, Phi-4-mini and Gemma 3 in Q8_0 (every projection packed)."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("epilogue")
    out = {}
    for name in ("qwen2", "qwen3", "phi4_mini", "gemma2", "gemma3"):
        # Gemma as llama.cpp holds it (its scale is head_dim's), windows shorter than the prompts
        gemma = dict(query_pre_attn_scalar=TINY[name].get("head_dim"), sliding_window=8)
        spec = TINY[name] | (gemma if name.startswith("gemma") else {})
        path = save_tiny(spec, root / name)
        import json
        from pathlib import Path

        cfg = ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
        sd = load_file(Path(path) / "model.safetensors")
        out[name] = str(write_gguf(root / f"{name}.gguf", cfg, "Q8_0", checkpoint_maker(sd, cfg)))
    return out


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi4_mini", "gemma2", "gemma3"])
def test_the_families_it_fuses_run_every_layer_in_one_call_exactly(family_ggufs, name, monkeypatch) -> None:
    """Qwen2 (q/k/v biases), Qwen3 (QK-norm), Phi-4-mini (RoPE on 12 of 16 dims), Gemma 2 (sandwich norms,
    GeGLU, soft-caps, windows on alternate layers) and Gemma 3 (QK-norm, local layers on their own RoPE
    table) take the one-call stack, and their tokens and logprobs equal the per-op path's: prefill, decode,
    n > 1, a shared prefix several windows long."""
    llm = assert_one_call_is_the_per_op_path(family_ggufs[name], list(range(5, 50)), 10, monkeypatch)
    assert layer_stack.packed_stack(llm.engine.runner.model) is not None
