"""RoPE: tables looked up once per forward, rotation bit-identical to the plain rotate-half formula."""

from __future__ import annotations

import pytest
import torch

from hydragen.model.rope import Rotary, apply_rotary, inverse_frequencies


def rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The textbook formula, with the negation on x as transformers writes it."""
    freqs = torch.outer(torch.arange(int(positions.max()) + 1, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos()[positions].unsqueeze(1).to(x.dtype)
    sin = emb.sin()[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA3])
def test_rotation_is_bit_identical_to_the_formula(dtype, scaling):
    gen = torch.Generator().manual_seed(0)
    head_dim, theta = 20, 10000.0
    rotary = Rotary(head_dim, theta, scaling, 600, "cpu")
    positions = torch.randint(0, 600, (37,), generator=gen)
    x = torch.randn(37, 3, head_dim, generator=gen).to(dtype)
    cos, sin = rotary.tables(positions, dtype)
    expected = rotate_half_reference(x, positions, inverse_frequencies(head_dim, theta, scaling))
    assert torch.equal(apply_rotary(x, cos, sin), expected)


def test_forward_looks_tables_up_once(tiny_models, monkeypatch):
    from hydragen.model.loader import load_model

    net, cfg, _ = load_model(tiny_models["llama3_mqa"], torch.device("cpu"), torch.float32)
    assert cfg.num_layers > 1
    calls = []
    original = Rotary.tables
    monkeypatch.setattr(Rotary, "tables", lambda self, *a: calls.append(1) or original(self, *a))

    def attend(layer, q, k, v):
        return q

    net(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), attend)
    assert len(calls) == 1
