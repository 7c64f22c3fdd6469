"""Sliding windows and soft-capping in one step's attention (``step_attention``, the C++ op and the torch
twin) against float64 attention under a mask built from the work items alone.

A window W lets a token at position p see the keys at positions (p - W, p] of its context (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). The steps are packed from work items as the
engine packs them (shared runs read by several items, decode tokens at different positions under one
shared unit, prefill chunks whose own keys are a causal unit or a segment, an extend, draft trees), with
windows smaller than a page, straddling the shared unit and larger than every context. A soft-cap c makes
each scaled score s into c * tanh(s / c). And the work a window leaves out is not read: counted in the
built metadata, never timed.
"""

from __future__ import annotations

import pytest
import torch

from hydragen.attention import step_work
from hydragen.attention.layer_spec import AttentionSpec, LayerSpecs
from hydragen.attention.step_attention import StepAttentionMeta, step_attention
from hydragen.engine.packing import pack
from hydragen.engine.step_plan import SharedRun, StepPlan, Work
from tests.unit.attention.test_step_attention import (  # noqa: F401  (a fixture: two threads)
    CUTS,
    _two_threads,
    make_qkv,
    mixed_step,
    oracle,
    seen_by,
)

IMPLS = ["cpp", "torch"]
PAGE = 4


@pytest.fixture(params=["default", "fine-tile", "fine-own"])
def cuts(request, monkeypatch):
    """How the build cuts the step (test_step_attention's CUTS): as it is, and in small items through the
    tile kernel / the op's own loop, so windows meet every kind of item."""
    for name, value in CUTS[request.param].items():
        monkeypatch.setattr(step_work, name, value)
    return request.param


def window_step(seed: int = 0) -> tuple[StepPlan, int]:
    """Items on shuffled 4-slot pages. Six items hold a 10-page shared prefix (positions 0..39), read by one
    shared run: decode tokens at positions 40, 47, 62 and 101, a 3-token extend at 50, and a draft tree at
    44. Outside it: a 24-token prefill chunk at 44 whose own keys are one causal unit (consecutive pages),
    a 20-token chunk at 60 whose own keys are a segment over scattered pages, and a lone decode at 30."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(150, generator=gen).tolist()  # pages 150.. stay for the consecutive chunk
    shared = [free.pop() for _ in range(10)]

    def item(start, k, rows, parents=None, head=()):
        pages = list(head)
        while len(pages) * PAGE < start + k:
            pages.append(free.pop())
        tokens = tuple(int(x) for x in torch.randint(0, 50, (k,), generator=gen))
        return Work(None, tuple(pages), start, tokens, rows, parents)

    consecutive = [free.pop() for _ in range(11)] + list(range(150, 157))  # positions 44..67: slots in a row
    work = (
        item(40, 1, 1, head=shared),
        item(47, 1, 1, head=shared),
        item(62, 1, 1, head=shared),
        item(101, 1, 1, head=shared),
        item(50, 3, 1, head=shared),
        item(44, 6, 6, (-1, 0, 0, 1, -1, 4), head=shared),
        item(44, 24, 0, head=consecutive),
        item(60, 20, 1),
        item(30, 1, 1),
    )
    cuts = (10,) * 6 + (0,) * 3
    return StepPlan(work, (), (SharedRun(0, 10, 0, 6),), cuts), 160 * PAGE


def depth(w: Work, j: int) -> int:
    return len(seen_by(w, j)) - 1


def window_mask(plan: StepPlan, slots: int, window: int | None) -> torch.Tensor:
    """bool [T, slots]: token j of item w (at position start + its depth) reads the slots of its context
    positions and its own seen tokens' positions, those within the window only; from the items alone."""
    rows = []
    for w in plan.work:
        slot = lambda p, w=w: w.pages[p // PAGE] * PAGE + p % PAGE  # noqa: E731
        for j in range(len(w.tokens)):
            at = w.start + depth(w, j)
            keys = [(slot(p), p) for p in range(w.start)]
            keys += [(slot(w.start + a), w.start + depth(w, a)) for a in seen_by(w, j)]
            row = torch.zeros(slots, dtype=torch.bool)
            row[[s for s, p in keys if window is None or p > at - window]] = True
            rows.append(row)
    return torch.stack(rows)


def masked_attention(q, k, v, mask, scale, softcap=None):
    """float64 attention of q [T, Hq, D] over the whole pool under mask [T, S], scores soft-capped."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", probs, vv)


def windowed(plan: StepPlan, window: int | None):
    """The plan packed as the engine packs a layer of this window: (its metadata, the batch)."""
    batch, _ = pack(plan, PAGE, "cpu", LayerSpecs.per_layer([AttentionSpec(0.1, window=window)]))
    return batch.meta, batch


# windows: a key, under a page, straddling the shared run and the chunks, larger than every context
WINDOWS = [1, 3, 9, 37, 1000]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 20)])
def test_windowed_step_matches_the_masked_reference(impl, window, softcap, hq, hkv, d, cuts):
    plan, slots = window_step()
    meta, batch = windowed(plan, window)
    assert meta.window == window
    q, k, v = make_qkv(meta.num_tokens, slots, hq, hkv, d, torch.float32)
    q = q * 3  # large scores: the soft-cap changes them
    out = step_attention(q, k, v, meta, d**-0.5, impl=impl, softcap=softcap)
    want = masked_attention(q, k, v, window_mask(plan, slots, window), d**-0.5, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)  # peaked scores: fp32's rounding


def test_the_mask_and_positions_are_the_items():
    """The oracle's premises: the packed positions are start + depth, and the windows really cut (W = 3
    leaves the 101st position's decode token 3 keys; W = 1000 is full attention)."""
    plan, slots = window_step()
    _, batch = windowed(plan, 3)
    at = 0
    for w in plan.work:
        assert batch.positions[at : at + len(w.tokens)].tolist() == [
            w.start + depth(w, j) for j in range(len(w.tokens))
        ]
        at += len(w.tokens)
    assert window_mask(plan, slots, 3)[3].sum() == 3
    assert torch.equal(window_mask(plan, slots, 1000), window_mask(plan, slots, None))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_windowed_step_half_precision(impl, dtype, cuts):
    plan, slots = window_step(seed=2)
    meta, _ = windowed(plan, 9)
    q, k, v = make_qkv(meta.num_tokens, slots, 8, 2, 64, dtype)
    out = step_attention(q, k, v, meta, 0.125, impl=impl, softcap=3.0)
    assert out.dtype == dtype
    want = masked_attention(q, k, v, window_mask(plan, slots, 9), 0.125, 3.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16])
def test_windowed_16bit_cache_under_fp32_queries(impl, cache):
    plan, slots = window_step(seed=5)
    meta, _ = windowed(plan, 16)
    q, k, v = make_qkv(meta.num_tokens, slots, 9, 3, 64, torch.float32)
    k, v = k.to(cache), v.to(cache)
    out = step_attention(q, k, v, meta, 0.125, impl=impl, softcap=2.0)
    want = masked_attention(q, k.float(), v.float(), window_mask(plan, slots, 16), 0.125, 2.0)
    torch.testing.assert_close(out.double(), want, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128), (6, 2, 20)])
def test_softcap_alone_on_the_mixed_step(impl, hq, hkv, d, cuts):
    """No window: every kind of unit and segment of the step attention tests, soft-capped."""
    units, segments, t, slots = mixed_step()
    q, k, v = make_qkv(t, slots, hq, hkv, d, torch.float32)
    q = q * 4
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    out = step_attention(q, k, v, meta, d**-0.5, impl=impl, softcap=1.5)
    want = oracle(q, k, v, units, segments, d**-0.5, softcap=1.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    assert (oracle(q, k, v, units, segments, d**-0.5) - want).abs().max() > 1e-2  # it caps
    assert torch.all(out[5] == 0)  # a token that sees nothing still gets zeros


def test_cpp_equals_torch_windowed_bf16():
    plan, slots = window_step(seed=7)
    meta, _ = windowed(plan, 5)
    q, k, v = make_qkv(meta.num_tokens, slots, 8, 2, 64, torch.bfloat16)
    a = step_attention(q, k, v, meta, 0.125, impl="cpp", softcap=4.0)
    b = step_attention(q, k, v, meta, 0.125, impl="torch", softcap=4.0)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# ---- decode tokens at different positions under one shared unit ---------------------------------------


def shared_decode(positions: list[int], shared_pages: int, seed: int = 0) -> tuple[StepPlan, int]:
    """One decode token per item at ``positions``, all holding the same ``shared_pages`` pages (one run)."""
    gen = torch.Generator().manual_seed(seed)
    total = shared_pages + sum(-(-(p + 1) // PAGE) for p in positions)
    free = torch.randperm(total, generator=gen).tolist()
    shared = [free.pop() for _ in range(shared_pages)]
    work = []
    for p in positions:
        pages = list(shared)
        while len(pages) * PAGE < p + 1:
            pages.append(free.pop())
        work.append(Work(None, tuple(pages), p, (1,), 1))
    n = len(positions)
    return StepPlan(tuple(work), (), (SharedRun(0, shared_pages, 0, n),), (shared_pages,) * n), total * PAGE


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tile", [True, False])
def test_a_shared_unit_is_still_read_once_with_a_bound_per_row(impl, tile, monkeypatch):
    """Eight decode tokens at positions 45 .. 80 under a 40-position shared run, W = 30: the run is one
    piece over all the tokens (a matrix product, each row masked below its own bound: the tile kernel and
    the op's own loop), from the first key any of them sees; the tokens past it see none of it."""
    if tile:
        monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0)
        monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    monkeypatch.setattr(step_work, "SPLIT_BLOCKS_PER_THREAD", 0)  # no key chunks: one piece per node
    positions = [45, 48, 52, 57, 60, 66, 71, 80]
    plan, slots = shared_decode(positions, 10)
    meta, _ = windowed(plan, 30)
    # positions 16..39 of the run (one unit per slot run of its scattered pages) are the ones any token sees
    # (45 - 30 + 1 = 16); tokens at 71 and 80 see none of it
    assert all(u[2:] == (0, 8, 0) for u in meta.unit_list)
    assert meta.unit_positions()[0] == 16 and sum(u[1] - u[0] for u in meta.unit_list) == 24
    pieces = meta.pieces.tolist()
    assert len(pieces) == 1 and pieces[0][:2] == [0, 8] and pieces[0][5:] == [24, 0, 1, 16]  # 24 keys from 16
    q, k, v = make_qkv(meta.num_tokens, slots, 8, 2, 32, torch.float32)
    out = step_attention(q, k, v, meta, 0.2, impl=impl)
    want = masked_attention(q, k, v, window_mask(plan, slots, 30), 0.2)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_value_below_a_row_s_bound_stays_out_of_it(impl, tile, bad, monkeypatch):
    """A V row holding an inf or NaN at a key some rows of a shared piece see and others have below their
    window: it reaches the rows that see it, and no other."""
    if tile:
        monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0)
        monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    monkeypatch.setattr(step_work, "SPLIT_BLOCKS_PER_THREAD", 0)
    positions = [41, 44, 50, 55]
    plan, slots = shared_decode(positions, 10, seed=3)
    meta, _ = windowed(plan, 20)  # first positions 22, 25, 31, 36
    q, k, v = make_qkv(meta.num_tokens, slots, 4, 2, 16, torch.float32)
    pages = plan.work[0].pages
    v[pages[28 // PAGE] * PAGE + 28 % PAGE, :, 3] = bad  # position 28: seen by the first two tokens only
    out = step_attention(q, k, v, meta, 0.3, impl=impl)
    assert not torch.isfinite(out[:2]).all()
    mask = window_mask(plan, slots, 20)
    want = masked_attention(q[2:], k, v.nan_to_num(0.0, 0.0, 0.0), mask[2:], 0.3)
    torch.testing.assert_close(out[2:].double(), want, atol=2e-6, rtol=1e-5)


# ---- what a window leaves out is not read -------------------------------------------------------------


def keys_read_per_token(meta) -> list[int]:
    """For each token, the keys the items covering it read: a piece or block reads keys [0, kmax) of its
    runs, kmax = min(first + tokens - 1, total), once for all its tokens (counted for each)."""
    seen = [0] * meta.num_tokens
    for item in meta.pieces.tolist() + meta.blocks.tolist():
        t0, t1, _, _, first, total = item[:6]
        for t in range(t0, t1):
            seen[t] += max(0, min(first + t1 - t0 - 1, total))
    return seen


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sliding_layer_reads_the_window_not_the_context(threads, monkeypatch):
    """Four decode tokens near position 8,000 under a 4,096-position shared run, each with a private tail,
    a 256-token prefill chunk at 6,000 (a causal unit over its own keys) and a 12-token extend: with W = 256
    each token's items read at most W + 2 x 32 keys (a tile's spread), none of the shared run's, where full
    attention reads each whole context. Small steps cut the window into key chunks as they cut a context."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # how the cut sizes a small step
    pages_per = lambda n: -(-n // 16)  # noqa: E731
    shared = list(range(256))  # 4,096 positions on 16-slot pages
    nxt = [1000]

    def fresh(n):
        out = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    work = []
    for p in (7990, 8003, 8100, 8191):
        work.append(Work(None, tuple(shared + fresh(pages_per(p + 1) - 256)), p, (1,), 1))
    work.append(Work(None, tuple(fresh(pages_per(6256))), 6000, tuple(range(256)), 0))
    work.append(Work(None, tuple(fresh(pages_per(3012))), 3000, tuple(range(12)), 1))
    plan = StepPlan(tuple(work), (), (SharedRun(0, 256, 0, 4),), (256,) * 4 + (0, 0))
    contexts = [p + 1 for p in (7990, 8003, 8100, 8191)] + list(range(6001, 6257)) + list(range(3001, 3013))
    for window in (256, None):
        batch, _ = pack(plan, 16, "cpu", LayerSpecs.per_layer([AttentionSpec(0.1, window=window)]))
        per_token = keys_read_per_token(batch.meta)
        if window is None:
            assert all(r >= c for r, c in zip(per_token, contexts, strict=True))
            continue
        assert max(per_token) <= window + 2 * step_work.PIECE_TOKENS
        assert all(r >= min(c, window) for r, c in zip(per_token, contexts, strict=True))
        assert not batch.meta.unit_list or all(u[2] >= 4 for u in batch.meta.unit_list)  # no shared-run unit
        assert sum(per_token) <= len(per_token) * (window + 2 * step_work.PIECE_TOKENS)


def test_window_metadata_is_checked():
    units = [(0, 4, 0, 1, 0)]
    segments = [(0, 1, [(4, 6)], 2)]
    with pytest.raises(ValueError, match="first key's position"):
        StepAttentionMeta.build(units, segments, 1, "cpu", window=2, positions=[5])
    with pytest.raises(ValueError, match="positions"):
        StepAttentionMeta.build([(0, 4, 0, 1, 0, 0)], [(0, 1, [(4, 6)], 2, 4)], 1, "cpu", window=2)
    with pytest.raises(ValueError, match="1 positions for 2 tokens"):
        StepAttentionMeta.build([], [(0, 2, [], 0, 0)], 2, "cpu", window=2, positions=[5])
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        StepAttentionMeta.build([], [(0, 1, [], 0, 0)], 1, "cpu", window=0, positions=[5])
    units, segments = [(0, 4, 0, 1, 0, 0)], [(0, 1, [(4, 6)], 2, 4)]
    meta = StepAttentionMeta.build(units, segments, 1, "cpu", window=2, positions=[5])
    assert meta.unit_list == [] and meta.segment_list == [(0, 1, [(4, 6)], 2)]  # positions 0..3 out of sight
    q, k, v = make_qkv(1, 8, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        step_attention(q, k, v, meta, 0.1, softcap=0.0)
