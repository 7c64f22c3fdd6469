"""The sampler draws exactly from the filtered distribution, reproducibly per (seed, step)."""

from __future__ import annotations

import torch

from hydragen.engine.sampler import Sampler, derive_seed


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, n=20000, seed=3):
    b = n
    rows = logits.expand(b, -1)
    sampler = Sampler()
    seeds = torch.tensor([derive_seed(seed, i) for i in range(b)])
    return sampler(
        rows,
        torch.full((b,), temperature),
        torch.full((b,), top_k),
        torch.full((b,), top_p),
        seeds,
        torch.zeros(b, dtype=torch.long),
        temperature > 0,
        top_k > 0,
        top_p < 1,
    )


def test_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    counts = torch.bincount(_draw(logits, temperature=0.7), minlength=5).double()
    expected = torch.softmax(logits[0].double() / 0.7, -1) * counts.sum()
    assert counts[4] == 0
    chi2 = ((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum()
    assert chi2 < 20, (counts, expected)  # 3 degrees of freedom: p < 0.001 at 16.3


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0]])
    assert set(_draw(logits, top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    # top_p just above p0 keeps tokens 0 and 1 only (1 is needed to reach the mass).
    assert set(_draw(logits, top_p=float(p[0]) + 1e-3).tolist()) == {0, 1}
    assert set(_draw(logits, top_p=float(p[0]) - 1e-3).tolist()) == {0}


def test_greedy_and_reproducible():
    logits = torch.randn(1, 100)
    assert set(_draw(logits, temperature=0.0, n=8).tolist()) == {int(logits.argmax())}
    assert torch.equal(_draw(logits, n=64, seed=5), _draw(logits, n=64, seed=5))
    assert not torch.equal(_draw(logits, n=64, seed=5), _draw(logits, n=64, seed=6))
