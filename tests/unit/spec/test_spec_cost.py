"""The cost rule: which drafts a step verifies, from the step's cost and each sequence's acceptance."""

from __future__ import annotations

import pytest
import torch

from hydragen.spec.cost import StepCost, choose


def test_step_cost_interpolates_extrapolates_and_never_falls():
    cost = StepCost([1, 2, 4, 8], [1.0, 0.9, 1.2, 2.0])  # 0.9: noise below t(1), raised to it
    assert cost.seconds == [1.0, 1.0, 1.2, 2.0]
    assert cost.at(3) == pytest.approx(1.1) and cost.at(16) == pytest.approx(3.6)
    with pytest.raises(ValueError):
        StepCost([4], [1.0])


def test_measure_times_the_grid_up_to_the_rows_needed():
    seen = []
    cost = StepCost.measure(lambda rows, repeats: seen.append((rows, repeats)) or 1.0 + rows, 10)
    assert [r for r, _ in seen] == [1, 2, 3, 4, 5, 6, 8, 10] and cost.at(7) == pytest.approx(8.0)
    assert all(n == 3 for _, n in seen)  # small steps: best of three


def _rate(base, drafts, accept, cost):
    gained = sum(sum(a**j for j in range(1, d + 1)) for d, a in zip(drafts, accept, strict=True))
    return (base + gained) / cost.at(base + sum(drafts))


def test_flat_cost_verifies_what_is_likely_and_steep_cost_nothing():
    counts = [4, 4, 0]
    accept = [0.9, 0.2, 0.9]
    flat = StepCost([1, 64], [1.0, 1.0 + 0.001 * 63])
    steep = StepCost([1, 64], [1.0, 64.0])  # every row costs a whole step: nothing pays
    taken = choose(counts, accept, 3, flat)
    assert taken[0] == 4 and taken[2] == 0 and 0 <= taken[1] <= 4
    assert choose(counts, accept, 3, steep) == [0, 0, 0]
    assert choose(counts, [0.0] * 3, 3, flat) == [0, 0, 0]


def test_the_choice_is_the_best_rate_over_every_prefix_of_the_ranking():
    """Against brute force over every draft count per sequence (small cases): the rule's rate is the
    best, and never below verifying nothing."""
    import itertools

    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        b = int(torch.randint(1, 4, (1,), generator=gen))
        counts = torch.randint(0, 4, (b,), generator=gen).tolist()
        accept = (torch.rand(b, generator=gen, dtype=torch.float64) * 0.95).tolist()
        slope = float(torch.rand(1, generator=gen)) * 0.5
        cost = StepCost([1, 2, 4, 8, 16, 32], [1.0 + slope * (r - 1) ** 1.2 for r in [1, 2, 4, 8, 16, 32]])
        base = int(torch.randint(1, 8, (1,), generator=gen))
        taken = choose(counts, accept, base, cost)
        best = max(_rate(base, d, accept, cost) for d in itertools.product(*[range(c + 1) for c in counts]))
        got = _rate(base, taken, accept, cost)
        assert got >= _rate(base, [0] * b, accept, cost) - 1e-12
        assert got == pytest.approx(best, rel=1e-9) or got >= best - 1e-9
