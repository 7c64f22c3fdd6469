"""Prompt-lookup drafts: the C++ op against its Python twin, siblings as sources, the per-sequence buffers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from hydragen.native.build import ngram_propose_op
from hydragen.spec.ngram import NgramProposer, ngram_drafts_reference

op = ngram_propose_op()
needs_op = pytest.mark.skipif(op is None, reason="the C++ ops are unavailable")


def test_the_reference_on_hand_made_cases():
    ctx = [1, 2, 3, 4, 9, 1, 2, 3]  # "1 2 3" occurred before, followed by 4 9
    assert ngram_drafts_reference([ctx], [3], [[0]], 2, 3) == [[4, 9, 1]]
    assert ngram_drafts_reference([ctx], [1], [[0]], 2, 3) == [[4]]
    assert ngram_drafts_reference([[5, 6, 7]], [3], [[0]], 1, 2) == [[]]  # no earlier occurrence
    # the latest occurrence wins; the longest n first
    assert ngram_drafts_reference([[1, 2, 8, 1, 2, 9, 7, 1, 2]], [2], [[0]], 2, 2) == [[9, 7]]
    assert ngram_drafts_reference([[3, 1, 2, 5, 4, 1, 2, 6, 3, 1, 2]], [1], [[0]], 2, 3) == [[5]]
    # a sibling's context is a source after its own
    assert ngram_drafts_reference([[7, 8], [7, 8, 4, 5]], [2, 0], [[0, 1], [1]], 1, 2) == [[4, 5], []]


@needs_op
def test_the_op_equals_its_twin_on_random_contexts():
    rng = random.Random(3)
    for _ in range(200):
        batch = rng.randint(1, 6)
        vocab = rng.choice([2, 3, 5, 50])
        contexts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(batch)]
        limits = [rng.randint(0, 6) for _ in range(batch)]
        sources = [[i] + rng.sample([j for j in range(batch) if j != i], rng.randint(0, batch - 1)) for i in
                   range(batch)]  # fmt: skip
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        want = ngram_drafts_reference(contexts, limits, sources, lo, hi)
        width = max(map(len, sources))
        bufs = [torch.tensor(c + [0] * 3, dtype=torch.int32) for c in contexts]  # room past the length
        drafts, counts = op(
            bufs,
            torch.tensor([len(c) for c in contexts]),
            torch.tensor(limits),
            torch.tensor([s + [-1] * (width - len(s)) for s in sources]),
            lo,
            hi,
        )
        got = [drafts[i, : counts[i]].tolist() for i in range(batch)]
        assert got == want, (contexts, limits, sources, lo, hi)
        assert (drafts[counts.unsqueeze(1) <= torch.arange(drafts.shape[1])] == -1).all()


def _seq(seq_id, request, context):
    out = SimpleNamespace(generated=context[3:])
    return SimpleNamespace(
        seq_id=seq_id, request=SimpleNamespace(request_id=request), context=list(context), out=out,
        generated=out.generated, context_len=len(context),
    )  # fmt: skip


@pytest.mark.parametrize("native", [True, False])
def test_the_proposer_keeps_each_context_and_grows_it(native):
    if native and op is None:
        pytest.skip("the C++ ops are unavailable")
    p = NgramProposer(2, 3, native=native)
    a = _seq(1, "r", [1, 2, 3, 4, 1, 2])
    b = _seq(2, "r", [1, 2, 3, 9, 9, 1])
    drafts, counts = p.propose([a, b], [2, 2])
    assert counts == [2, 0] and drafts[0, :2].tolist() == [3, 4]
    # b grows by a token: its buffer takes only the new one; now "1 2" follows... its own "1 2 3"
    b.generated.append(2)
    b.context.append(2)
    b.context_len += 1
    drafts, counts = p.propose([a, b], [1, 3])
    assert counts == [1, 3] and drafts[1, :3].tolist() == [3, 9, 9]
    # siblings: a request's samples look in each other's contexts
    c = _seq(3, "q", [5, 6, 7, 8])
    d = _seq(4, "q", [5, 6, 0, 6, 7])
    _, counts = p.propose([c, d], [2, 2], siblings=False)
    assert counts == [0, 0]
    drafts, counts = p.propose([c, d], [2, 2], siblings=True)
    assert counts == [0, 1] and drafts[1, :1].tolist() == [8]
    p.forget([1, 2, 3, 4])
    assert not p._buffers


@needs_op
def test_proposing_for_64_sequences_of_2k_tokens_is_one_call():
    """The batch is searched in one C++ call over buffers kept between steps (its time is measured by
    ``hydragen bench spec``; here only that it does not rebuild the contexts: a second call with one more
    token each copies one token a sequence)."""
    rng = random.Random(0)
    seqs = [_seq(i, str(i), [rng.randrange(500) for _ in range(2048)]) for i in range(64)]
    p = NgramProposer(2, 4)
    p.propose(seqs, [8] * 64)
    before = [p._buffers[s.seq_id].tokens for s in seqs]
    for s in seqs:
        s.generated.append(1)
        s.context.append(1)
        s.context_len += 1
    p.propose(seqs, [8] * 64)
    assert all(p._buffers[s.seq_id].tokens is t for s, t in zip(seqs, before, strict=True))
    assert all(p._buffers[s.seq_id].length == 2049 for s in seqs)
