"""The sampler draws exactly from the filtered distribution, reproducibly per (seed, step), whatever
the batch."""

from __future__ import annotations

import pytest
import torch

from hydragen.engine import sampler as sampler_module
from hydragen.engine import truncation
from hydragen.engine.sampler import Sampler, derive_seed
from hydragen.engine.sampling_params import SamplingParams
from hydragen.native import build as native_build
from tests.helpers.sampling_helpers import reference


@pytest.fixture(autouse=True, params=["native", "torch"])
def truncation_impl(request, monkeypatch):
    """Every test runs with the C++ ops (the whole sampling step, the truncated draw) and with their torch
    twins (the ops' oracle)."""
    if request.param == "torch":
        monkeypatch.setattr(truncation, "_native_op", lambda probs: None)
        monkeypatch.setattr(sampler_module, "_sample_step_op", lambda logits: None)
    elif native_build.sample_truncated_op() is None:
        pytest.skip(f"the C++ ops are unavailable: {native_build.build_error()}")
    return request.param


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


# ---- the truncated sampler against a float64 definition -------------------------------------------

V = 1000  # not a multiple of the block size: the padding is exercised too
# (temperature, top_k, top_p, min_p)
SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.0, 0, 0.95, 0.0),
    (0.8, 40, 0.95, 0.0),
    (1.0, 0, 0.95, 0.05),
    (0.7, 40, 0.9, 0.05),
    (1.3, 5, 1.0, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.9, 3000, 0.5, 0.0),  # top_k above the vocabulary: off
]


def realistic_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Zipf-like logits with a random spread: some rows peaked, some flat, as a language model's."""
    gen = torch.Generator().manual_seed(seed)
    rank_logit = -torch.log(torch.arange(1, V + 1, dtype=torch.float32))
    out = []
    for _ in range(rows):
        sharp = float(torch.empty(1).uniform_(0.5, 4.0, generator=gen))
        row = rank_logit * sharp + torch.randn(V, generator=gen) * 0.5
        out.append(row[torch.randperm(V, generator=gen)])
    return torch.stack(out)


def run(sampler, logits, settings, seeds=None, steps=None, num_logprobs=None):
    b = logits.shape[0]
    t, k, p, mp = (torch.tensor(col) for col in zip(*settings, strict=True))
    seeds = torch.tensor([derive_seed(1, i) for i in range(b)]) if seeds is None else seeds
    steps = torch.zeros(b, dtype=torch.long) if steps is None else steps
    flags = (bool((t > 0).any()), bool((k > 0).any()), bool((p < 1).any()))
    return sampler.sample(
        logits, t.float(), k, p.float(), seeds, steps, *flags, mp.float(), bool((mp > 0).any()), num_logprobs
    )


def test_swept_uniforms_reproduce_the_reference_distribution(monkeypatch):
    """With the uniforms swept evenly over (0, 1), each kept token is drawn its probability times the
    number of draws (to within one), tokens come in ascending id (the CDF order), and no other token
    is ever drawn: the filtering and the masses are exact."""
    draws, rows = 1024, 3
    sampler = Sampler()
    sweep = (torch.arange(draws) * (1 << 24) // draws).repeat(rows)
    monkeypatch.setattr(sampler, "uniform_bits", lambda seeds, steps: sweep)
    logits = realistic_logits(rows)
    for setting in SETTINGS:
        batch = logits.repeat_interleave(draws, dim=0)
        tokens = run(sampler, batch, [setting] * (rows * draws)).tokens.view(rows, draws)
        for row, drawn in zip(logits, tokens, strict=True):
            ref = reference(row, *setting)
            counts = torch.bincount(drawn, minlength=V).double()
            assert bool((drawn[1:] >= drawn[:-1]).all())
            assert set(drawn.tolist()) <= set(ref.nonzero().squeeze(1).tolist()), setting
            assert float((counts - ref * draws).abs().max()) <= 1.0 + 1e-6, setting


def test_hashed_uniforms_match_the_reference_in_one_mixed_batch():
    """Many seeds, every setting in the same batch: a chi-square test per setting against float64."""
    draws = 1500
    row = realistic_logits(1, seed=3)[0]
    settings = [s for s in SETTINGS for _ in range(draws)]
    tokens = run(Sampler(), row.expand(len(settings), -1).contiguous(), settings).tokens
    for i, setting in enumerate(SETTINGS):
        counts = torch.bincount(tokens[i * draws : (i + 1) * draws], minlength=V).double()
        expected = reference(row, *setting) * draws
        assert counts[expected == 0].sum() == 0, setting
        big = expected >= 5
        cells_obs = torch.cat([counts[big], counts[~big].sum().view(1)])
        cells_exp = torch.cat([expected[big], expected[~big].sum().view(1)])
        keep = cells_exp > 0
        chi2 = float(((cells_obs - cells_exp)[keep] ** 2 / cells_exp[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (setting, chi2, dof)


def test_rows_are_batch_invariant():
    """A row's token depends only on its own logits, settings, seed and step: alone, in a batch of 64
    mixed settings (greedy rows included) and in a shuffled batch of 256."""
    sampler = Sampler()
    settings = [(0.0, 0, 1.0, 0.0), *SETTINGS] * 8  # 80 rows
    settings = settings[:64]
    logits = realistic_logits(64, seed=5)
    seeds = torch.tensor([derive_seed(9, i) for i in range(64)])
    steps = torch.arange(64) * 7
    batch = run(sampler, logits, settings, seeds, steps).tokens
    for i in range(64):
        alone = run(sampler, logits[i : i + 1], settings[i : i + 1], seeds[i : i + 1], steps[i : i + 1])
        assert alone.tokens.item() == batch[i].item(), settings[i]
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0)) % 64
    big = run(sampler, logits[order], [settings[i] for i in order], seeds[order], steps[order]).tokens
    assert torch.equal(big, batch[order])


def test_retry_passes_give_the_same_tokens(monkeypatch, truncation_impl):
    """Forcing rows past the first pass (the best 64 blocks) through the threshold passes, down to the
    last one that reads every token (the exact fallback), changes no token."""
    if truncation_impl == "native":
        pytest.skip("the C++ op reads every token in one pass; this checks the torch twin's passes")
    sampler = Sampler()
    logits = realistic_logits(48, seed=7)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(48)]
    expected = run(sampler, logits, settings).tokens
    passes = []
    candidates = truncation.candidates
    monkeypatch.setattr(
        truncation, "candidates", lambda probs, *a: passes.append(probs.shape[0]) or candidates(probs, *a)
    )
    for first_k, floors in ((1, (0.9, 0.0)), (2, (0.5, 1e-2, 1e-3, 0.0)), (64, (0.0,))):
        passes.clear()
        monkeypatch.setattr(truncation, "FIRST_K", first_k)
        monkeypatch.setattr(
            truncation,
            "retry_floors",
            lambda top_p, f=floors: torch.tensor(f).unsqueeze(1).expand(-1, len(top_p)),
        )
        assert torch.equal(run(sampler, logits, settings).tokens, expected), floors
        if first_k == 1:
            assert len(passes) == 1 + len(floors), "rows must have reached the last pass"
        if first_k == 2:
            assert len(passes) >= 3, "rows must have gone through several passes"


def test_ties_stay_together_at_every_cut(monkeypatch):
    draws = 1 << 10
    sampler = Sampler()
    sweep = torch.arange(draws) * (1 << 24) // draws
    monkeypatch.setattr(sampler, "uniform_bits", lambda seeds, steps: sweep)
    logits = torch.full((V,), -20.0)
    logits[[7, 3, 900, 41, 5]] = torch.tensor([4.0, 2.0, 2.0, 2.0, 1.0])  # 3, 900, 41 tie

    def support(setting):
        return set(run(sampler, logits.expand(draws, -1).contiguous(), [setting] * draws).tokens.tolist())

    assert support((1.0, 2, 1.0, 0.0)) == {7, 3, 900, 41}  # three tokens tie at the 2nd value
    p = torch.softmax(logits.double(), -1)
    # top_p reaches into the tied group: the whole group stays.
    assert support((1.0, 0, float(p[7] + p[3] * 0.5), 0.0)) == {7, 3, 900, 41}
    assert support((1.0, 0, float(p[7]) * 0.99, 0.0)) == {7}
    # min_p exactly at the tied value keeps the group.
    assert support((1.0, 0, 1.0, float(p[3] / p[7]) * (1 - 1e-6))) == {7, 3, 900, 41}

    # A tie group of 100 straddles the first pass's 64 tokens and the top_p cut falls inside it.
    logits = torch.full((V,), -20.0)
    logits[:3] = torch.tensor([5.0, 4.5, 4.0])
    logits[100:200] = 1.0
    p = torch.softmax(logits.double(), -1)
    assert support((1.0, 0, float(p[:3].sum() + p[100:200].sum() / 2), 0.0)) == {0, 1, 2, *range(100, 200)}


def test_greedy_rows_mixed_with_random_rows():
    sampler = Sampler()
    logits = realistic_logits(16, seed=2)
    logits[0, [11, 12]] = logits[0].max() + 1  # a tie for the maximum: argmax takes the first
    settings = [(0.0, 0, 1.0, 0.0) if i % 2 == 0 else SETTINGS[2] for i in range(16)]
    tokens = run(sampler, logits, settings).tokens
    assert tokens[0] == 11
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_logprobs_match_log_softmax():
    sampler = Sampler()
    logits = realistic_logits(12, seed=4) * 3
    settings = [(0.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 40, 0.95, 0.05)] * 4
    out = run(sampler, logits, settings, num_logprobs=5)
    logp = torch.log_softmax(logits.double(), -1)
    chosen = logp.gather(1, out.tokens.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs.double(), chosen, atol=1e-5)
    top = logp.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-5)
    only_chosen = run(sampler, logits, settings, num_logprobs=0)
    assert only_chosen.top_ids is None and torch.equal(only_chosen.tokens, out.tokens)


@pytest.mark.parametrize("width", [64 * 50, 64 * 50 + 13])
def test_top_values_equals_topk(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=gen)
    x[:, ::97] = 5.0  # ties across blocks
    padded = truncation.pad_to_blocks(x, float("-inf"))
    for k in (1, 5, 40, 200):
        values, ids = truncation.top_values(padded, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values)


def test_min_p_is_validated_and_accepted_by_the_server():
    from hydragen.server.protocol import CompletionRequest

    assert SamplingParams(min_p=0.05).min_p == 0.05
    for bad in (-0.1, 1.5, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)
    body = CompletionRequest(model="m", prompt="hi", min_p=0.1)
    assert body.sampling_params(16, None).min_p == 0.1


def test_seed_zero_is_not_degenerate():
    """mix32(0) == 0: without salts, seed 0's first draw was u ~ 0 (the lowest-id token every time)."""
    sampler = Sampler()
    seeds = torch.tensor([derive_seed(s, i) for s in range(4) for i in range(4)])
    u = sampler.uniforms(seeds, torch.zeros_like(seeds))
    assert bool((u > 1e-3).all()) and bool((u < 1 - 1e-3).all())
    assert derive_seed(0, 0) != 0


@pytest.mark.parametrize("vocab", [64 * 40, 64 * 40 + 13, 49152])
def test_native_op_draws_the_torch_twins_tokens(vocab, truncation_impl):
    """The C++ op and the torch twin give the same token for every row: peaked, flat, tied and underflowing
    distributions; top_p alone (wide nuclei reach the twin's retry passes), with top_k and with min_p."""
    if truncation_impl == "torch":
        pytest.skip("compares the two implementations")
    gen = torch.Generator().manual_seed(vocab)
    rows = 96
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.1, 12.0, rows).unsqueeze(1)
    logits[::4] = logits[::4].round()  # ties
    logits[1::5, ::3] = -1e4  # probabilities that underflow to 0
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05

    def some(share):
        return torch.rand(rows, generator=gen) < share

    top_p = torch.where(some(0.8), torch.rand(rows, generator=gen).clamp_min(1e-3), 1.0)
    top_k = torch.where(some(0.3), torch.randint(1, 200, (rows,), generator=gen), 0)
    min_p = torch.where(some(0.3), torch.rand(rows, generator=gen) * 0.3, 0.0)
    seeds = torch.randint(0, 2**32, (rows,), generator=gen)
    steps = torch.randint(0, 1000, (rows,), generator=gen)
    args = (logits, temperature, top_k, top_p, seeds, steps, True, True, True, min_p, True)
    sampler = Sampler(native=False)  # the truncated-draw op alone (the whole step is compared below)
    native = sampler.sample(*args).tokens
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(truncation, "_native_op", lambda probs: None)
        twin = sampler.sample(*args).tokens
    assert torch.equal(native, twin)


@pytest.mark.parametrize("vocab", [13, 64 * 40 + 13, 49152])
def test_native_step_draws_the_twins_tokens(vocab, truncation_impl):
    """The C++ sampling step (sample_step) gives the tensor code's token for every row of a batch mixing
    greedy rows, temperature 1 and other temperatures, untruncated rows, top_p, top_k, min_p and their
    combinations, ties, underflow, NaN rows, and feature flags that are off while rows carry values."""
    if truncation_impl == "torch":
        pytest.skip("compares the two implementations")
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 120
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.1, 12.0, rows).unsqueeze(1)
    logits[::4] = logits[::4].round()  # ties
    logits[1::5, ::3] = -1e4  # probabilities that underflow to 0
    logits[7] = float("nan")
    logits[11, 5] = float("nan")

    def some(share):
        return torch.rand(rows, generator=gen) < share

    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    temperature = torch.where(some(0.15), 0.0, torch.where(some(0.15), 1.0, temperature))
    top_p = torch.where(some(0.6), torch.rand(rows, generator=gen).clamp_min(1e-3), 1.0)
    top_k = torch.where(some(0.3), torch.randint(1, 200, (rows,), generator=gen), 0)
    top_k[3] = vocab  # a top_k of the whole vocabulary keeps every token
    if vocab < 64:  # one partial block: top_k must stay below the vocabulary to restrict anything
        top_k = top_k.clamp_max(vocab - 1)
    min_p = torch.where(some(0.3), torch.rand(rows, generator=gen) * 0.3, 0.0)
    seeds = torch.randint(0, 2**32, (rows,), generator=gen)
    steps = torch.randint(0, 1000, (rows,), generator=gen)
    for flags in [(True, True, True, True), (True, False, True, False), (True, True, False, True)]:
        any_random, any_top_k, any_top_p, any_min_p = flags
        args = (logits, temperature, top_k, top_p, seeds, steps, any_random, any_top_k, any_top_p)
        native = Sampler().sample(*args, min_p, any_min_p).tokens
        twin = Sampler(native=False).sample(*args, min_p, any_min_p).tokens
        assert torch.equal(native, twin), flags
        for row in (0, 7, 11, rows - 1):  # alone as in the batch
            alone = (logits[row : row + 1], *(a[row : row + 1] for a in args[1:6]), *flags[:3])
            single = Sampler().sample(*alone, min_p[row : row + 1], any_min_p).tokens
            assert torch.equal(single, native[row : row + 1])
    assert not 0 <= int(native[7]) < vocab  # a NaN row gets an impossible token (the runner reports it)
    assert not 0 <= int(native[11]) < vocab  # one NaN logit is enough, greedy or not
    # Every random row at temperature 1: the logits go to the softmax undivided.
    ones = torch.where(temperature > 0, 1.0, 0.0)
    args = (logits, ones, top_k, top_p, seeds, steps, True, True, True)
    native_ones = Sampler().sample(*args, min_p, True).tokens
    assert torch.equal(native_ones, Sampler(native=False).sample(*args, min_p, True).tokens)


def test_greedy_nan_rows_get_an_impossible_token():
    """A greedy row with a NaN logit has no most likely token: -1, not whatever argmax picks, so the request
    ends with an error; the greedy rows beside it are unaffected."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    logits[1, 17] = float("nan")
    zeros = torch.zeros(3)
    steps = torch.zeros(3, dtype=torch.long)
    args = (logits, zeros, steps, zeros + 1, torch.arange(3), steps)
    tokens = Sampler().sample(*args, False, False, False).tokens
    assert int(tokens[1]) == -1
    assert torch.equal(tokens[[0, 2]], logits[[0, 2]].argmax(-1))


def test_nan_rows_get_an_impossible_token():
    """NaN logits (a broken model or input) must not become a plausible token: the row gets an id outside
    the vocabulary, which the model runner reports as that request's error; the other rows are unaffected."""
    sampler = Sampler()
    vocab, rows = 3000, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    settings = [(1.0, 0, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 40, 1.0, 0.0), (1.0, 0, 1.0, 0.05)]
    nan_everywhere = logits.clone()
    nan_everywhere[[2, 3]] = float("nan")
    tokens = run(sampler, logits, settings).tokens
    assert not 0 <= tokens[1] < vocab
    assert all(0 <= t < vocab for t in tokens[[0, 2, 3]].tolist())
    assert torch.equal(run(sampler, logits[[0]], settings[:1]).tokens, tokens[[0]])
    broken = run(sampler, nan_everywhere, settings).tokens
    assert all(not 0 <= t < vocab for t in broken[1:].tolist())


def test_small_batch_uniforms_hash_like_the_tensor_code():
    """Up to SMALL_BATCH rows the uniforms are hashed with Python ints; they equal the tensor version's
    bits for seeds over the whole 64-bit range and steps past 2**31 (where int64 products wrap)."""
    gen = torch.Generator().manual_seed(5)
    seeds = torch.cat([torch.randint(-(2**62), 2**62, (40,), generator=gen), torch.tensor([0, 1, 2**32 - 1])])
    steps = torch.cat([torch.randint(0, 2**40, (40,), generator=gen), torch.tensor([0, 2**31, 2**33 + 7])])
    sampler = Sampler()
    small = torch.cat([sampler.uniform_bits(seeds[i : i + 8], steps[i : i + 8]) for i in range(0, 43, 8)])
    padding = sampler_module.SMALL_BATCH + 1 - seeds.numel()  # one call above the threshold
    wide = sampler.uniform_bits(torch.cat([seeds, seeds[:padding]]), torch.cat([steps, steps[:padding]]))
    assert torch.equal(small, wide[: seeds.numel()])
    assert bool((small >= 0).all()) and bool((small < 2**24).all())
