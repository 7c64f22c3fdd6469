"""Step attention (one call per layer for a packed step) against float64 attention over explicit key sets.

The reference reads the step's description directly (not the built metadata): for every token it lists the
pool slots it sees (its segment's visible keys, then every covering unit's keys) and runs
``reference_attention`` over exactly those keys. Both implementations must match it and each other. Draft
trees are packed from work items as the engine packs them and checked against a mask built from the work
items alone (each token: its context, its ancestors and itself).
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from hydragen.attention import step_attention as sa_module
from hydragen.attention import step_work
from hydragen.attention.reference import reference_attention
from hydragen.attention.step_attention import StepAttentionMeta, step_attention
from hydragen.engine.packing import pack
from hydragen.engine.step_plan import SharedRun, StepPlan, Work
from hydragen.native import build as cpp_build

IMPLS = ["cpp", "torch"]
HEADS_DIMS = [(9, 3, 64), (8, 1, 128), (4, 4, 20), (6, 2, 20)]  # GQA 9:3, MQA 8:1, MHA, GQA with odd D


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # exercises the work sharing without oversubscribing a shared box
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------------------------------


def visible_slots(units, segments, num_tokens) -> list[list[int]]:
    """For each token, the pool slots it attends to, straight from the semantics of the contract."""
    slots: list[list[int]] = [[] for _ in range(num_tokens)]
    for lo, hi, runs, visible in segments:
        keys = [s for a, b in runs for s in range(a, b)]
        for j in range(hi - lo):
            slots[lo + j] += keys[: min(visible + j, len(keys))]
    for kv_lo, kv_hi, tok_lo, tok_hi, causal in units:
        for i in range(tok_hi - tok_lo):
            slots[tok_lo + i] += list(range(kv_lo, kv_lo + i + 1 if causal else kv_hi))
    return slots


def oracle(q, k, v, units, segments, scale, softcap=None):
    """float64 attention of each token over its explicit key list (padded, masked by suffix_lens)."""
    t = q.shape[0]
    slots = visible_slots(units, segments, t)
    width = max((len(s) for s in slots), default=0)
    idx = torch.zeros(t, max(width, 1), dtype=torch.long)
    for i, s in enumerate(slots):
        idx[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    lens = torch.tensor([len(s) for s in slots])
    out, _ = reference_attention(
        q.unsqueeze(1), [], [], k[idx], v[idx], suffix_lens=lens, scale=scale, softcap=softcap
    )
    return out[:, 0]


# --------------------------------------------------------------------------------------------------
# Step builders: a paged pool whose pages are handed out shuffled (runs are rarely contiguous)
# --------------------------------------------------------------------------------------------------


class Pages:
    def __init__(self, num_pages: int, page: int, gen: torch.Generator):
        self.page = page
        self.free = torch.randperm(num_pages, generator=gen).tolist()

    def runs(self, n: int) -> list[tuple[int, int]]:
        """n slots on fresh pages, as slot runs (consecutive pages coalesce)."""
        out: list[tuple[int, int]] = []
        while n > 0:
            p = self.free.pop()
            take = min(n, self.page)
            lo = p * self.page
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], lo + take)
            else:
                out.append((lo, lo + take))
            n -= take
        return out

    def contiguous(self, n: int) -> tuple[int, int]:
        """A run of n slots on consecutive pages (taken from the free list's lowest pages)."""
        pages = -(-n // self.page)
        for start in sorted(self.free):
            if all(start + i in self.free for i in range(pages)):
                for i in range(pages):
                    self.free.remove(start + i)
                return start * self.page, start * self.page + n
        raise AssertionError("test pool too small")


def mixed_step(seed: int = 0):
    """Decode tokens under nested shared nodes, prefill chunks (causal segment, causal unit), an extend,
    tokens that see nothing, segments with zero runs."""
    gen = torch.Generator().manual_seed(seed)
    pages = Pages(96, 4, gen)
    node_a, node_b = pages.contiguous(13), pages.contiguous(7)  # shared nodes, B nested under A
    node_c = pages.runs(9)  # a node held by one sequence: read in place through its pages
    units, segments = [], []
    # tokens 0..4: decode; A over 0..3, B over 1..2; token 3 has no private tail at all. Node D, also over
    # 0..3, lies on scattered pages: one unit per run, all with A's token range.
    units += [(*node_a, 0, 4, 0), (*node_b, 1, 3, 0)]
    units += [(*run, 0, 4, 0) for run in pages.runs(10)]
    for t, tail in enumerate([5, 11, 1, 0]):
        runs = pages.runs(tail)
        segments.append((t, t + 1, runs, tail))
    segments.append((4, 5, node_c + pages.runs(6), 15))
    segments.append((5, 6, [], 0))  # token 5 sees nothing at all
    # tokens 6..24: a 19-token prefill chunk under node A, with a private earlier part of 5 keys.
    earlier, own = pages.runs(5), pages.runs(19)
    units.append((*node_a, 6, 25, 0))
    segments.append((6, 25, earlier + own, 5 + 1))
    # tokens 25..32: an 8-token chunk whose own keys are a causal unit, under node B; its segment is empty.
    own = pages.contiguous(8)
    units += [(*own, 25, 33, 1), (*node_b, 25, 33, 0)]
    segments.append((25, 33, [], 1))
    # tokens 33..35: a 3-token extend of a running sequence with 10 keys before it.
    segments.append((33, 36, pages.runs(13), 10 + 1))
    # tokens 36..38: a segment whose first token sees nothing (visible 0) and no unit covers.
    segments.append((36, 39, pages.runs(2), 0))
    return units, segments, 39, 96 * 4


def make_qkv(num_tokens, slots, hq, hkv, d, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    return q, k, v


# --------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------

# How the build cuts the step into work items. "fine" cuts units into 4-token tiles, causal units into
# diagonal squares + rectangles, segments and units into 8-key chunks, so every kind of item occurs in a
# small step; "tile" / "own" force every unit's piece through the tile kernel (matrix products per KV head) /
# the op's own loop (a segment's pieces always take the loop).
FINE = dict(
    PIECE_TOKENS=4, MAX_PIECE_KEYS=8, SEGMENT_CHUNK_KEYS=8, TOKENS_PER_BLOCK=3, SPLIT_BLOCKS_PER_THREAD=10**6
)
CUTS = {
    "default": {},
    "fine-tile": dict(FINE, TILE_MIN_ROWS=0, TILE_MIN_KEYS=0),
    "fine-own": dict(FINE, TILE_MIN_ROWS=-1),
    "fine-tensor-index": dict(FINE, SMALL_STEP_PARTS=-1),  # the token -> partial rows index by tensor ops
}


@pytest.fixture(params=list(CUTS))
def cuts(request, monkeypatch):
    for name, value in CUTS[request.param].items():
        monkeypatch.setattr(step_work, name, value)
    return request.param


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d", HEADS_DIMS)
def test_mixed_step_fp32_matches_reference(impl, hq, hkv, d, cuts):
    units, segments, t, slots = mixed_step()
    q, k, v = make_qkv(t, slots, hq, hkv, d, torch.float32)
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    scale = d**-0.5
    out = step_attention(q, k, v, meta, scale, impl=impl)
    assert out.dtype == torch.float32 and out.shape == q.shape
    want = oracle(q, k, v, units, segments, scale)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.all(out[5] == 0) and torch.all(out[36] == 0)  # tokens that see nothing


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 20)])
def test_mixed_step_half_precision(impl, dtype, hq, hkv, d, cuts):
    units, segments, t, slots = mixed_step(seed=3)
    q, k, v = make_qkv(t, slots, hq, hkv, d, dtype)
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    out = step_attention(q, k, v, meta, d**-0.5, impl=impl)
    assert out.dtype == dtype
    want = oracle(q, k, v, units, segments, d**-0.5)  # exact attention of the rounded inputs
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128), (6, 2, 20)])
def test_a_16bit_cache_under_fp32_queries_is_exact_on_its_values(impl, cache, hq, hkv, d, cuts):
    """A 16-bit KV pool read by float32 queries: float32 attention over the cache's exact (rounded) values,
    with float32 out, whatever path each piece takes (own loop, tile kernel, split decode)."""
    units, segments, t, slots = mixed_step(seed=5)
    q, k, v = make_qkv(t, slots, hq, hkv, d, torch.float32)
    k16, v16 = k.to(cache), v.to(cache)
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    out = step_attention(q, k16, v16, meta, d**-0.5, impl=impl)
    assert out.dtype == torch.float32
    want = oracle(q, k16.float(), v16.float(), units, segments, d**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    assert k16.dtype == cache  # the pool itself is never widened


def test_cpp_equals_torch_on_a_random_tree(cuts):
    """A wide random tree (nested units over DFS ranges, paged tails) and a prefill chunk: impls agree."""
    gen = torch.Generator().manual_seed(7)
    pages = Pages(400, 16, gen)
    rows = 24
    units, segments = [], []

    def split(lo, hi, depth):
        if depth == 3 or hi - lo < 2:
            return
        node = pages.contiguous(int(torch.randint(1, 40, (1,), generator=gen)))
        units.append((*node, lo, hi, 0))
        mid = int(torch.randint(lo + 1, hi, (1,), generator=gen))
        split(lo, mid, depth + 1)
        split(mid, hi, depth + 1)

    split(0, rows, 0)
    for r in range(rows):
        tail = int(torch.randint(0, 70, (1,), generator=gen))
        segments.append((r, r + 1, pages.runs(tail), tail))
    segments.append((rows, rows + 30, pages.runs(20) + pages.runs(30), 21))
    units.append((*units[0][:2], rows, rows + 30, 0))
    t = rows + 30
    q, k, v = make_qkv(t, 400 * 16, 9, 3, 64, torch.float32)
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    a = step_attention(q, k, v, meta, 0.125, impl="cpp")
    b = step_attention(q, k, v, meta, 0.125, impl="torch")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.double(), oracle(q, k, v, units, segments, 0.125), atol=2e-6, rtol=1e-5)


def test_token_rows_index_is_the_same_from_lists_and_tensors(monkeypatch):
    """The CSR of each token's partial rows, built with plain lists (small steps) and with tensor ops."""
    monkeypatch.setattr(step_work, "MAX_PIECE_KEYS", 8)
    monkeypatch.setattr(step_work, "SEGMENT_CHUNK_KEYS", 8)  # the segments' keys in pieces too
    monkeypatch.setattr(step_work, "PIECE_TOKENS", 4)
    gen = torch.Generator().manual_seed(3)
    pages = Pages(200, 16, gen)
    units = [(*pages.contiguous(30), 0, 12, 0), (*pages.contiguous(20), 4, 12, 0), (40, 60, 12, 32, 1)]
    segments = [(r, r + 1, pages.runs(int(torch.randint(0, 50, (1,), generator=gen))), 5) for r in range(12)]
    segments.append((12, 32, pages.runs(20), 1))
    work = step_work._WorkItems([run for seg in segments for run in seg[2]])
    for kv_lo, kv_hi, tok_lo, tok_hi, causal in units:
        if causal:
            work.add_causal(kv_lo, kv_hi, tok_lo, tok_hi)
        else:
            work.add_shared(tok_lo, tok_hi, [(kv_lo, kv_hi)])
    first_run = 0
    for seg in segments:
        work.add_segment(*seg, first_run=first_run)
        first_run += len(seg[2])
    assert work.rows > 32  # many rows, several per token
    small = step_work._token_rows_small(work.pieces, 32)
    big = step_work._token_rows(work.pieces, work.rows, 32)
    assert torch.equal(small[0], big[0]) and torch.equal(small[1], big[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_no_units_plain_paged_decode(impl, cuts):
    """Sharing off: every sequence's whole KV through its pages; the metadata is reused by every layer."""
    gen = torch.Generator().manual_seed(2)
    pages = Pages(200, 16, gen)
    lens = [1, 37, 64, 100, 250, 16]
    segments = [(i, i + 1, pages.runs(n), n) for i, n in enumerate(lens)]
    meta = StepAttentionMeta.build([], segments, len(lens), "cpu")
    assert meta.units.shape == (0, 5)
    assert (meta.num_parts == 0) == (cuts == "default")  # fine cuts turn long contexts into key chunks
    for layer in range(2):
        q, k, v = make_qkv(len(lens), 200 * 16, 8, 1, 64, torch.float32, seed=layer)
        out = step_attention(q, k, v, meta, 0.125, impl=impl)
        torch.testing.assert_close(out.double(), oracle(q, k, v, [], segments, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keys", [600, 129, 512, 3000])
def test_one_decode_token_is_read_by_every_thread(impl, keys):
    """A lone decode token (n = 1): its context is cut at every multiple of SEGMENT_CHUNK_KEYS, each chunk but
    the last a piece any thread may take, the last read by its block, which merges them all."""
    gen = torch.Generator().manual_seed(3)
    pages = Pages(200, 16, gen)
    segments = [(0, 1, pages.runs(keys), keys)]
    meta = StepAttentionMeta.build([], segments, 1, "cpu")
    chunk = step_work.SEGMENT_CHUNK_KEYS
    pieces = (keys - 1) // chunk
    assert meta.pieces.shape[0] == pieces and all(p[5] == chunk for p in meta.pieces.tolist())
    assert meta.blocks.shape[0] == 1 and int(meta.blocks[0, 5]) == keys - pieces * chunk
    q, k, v = make_qkv(1, 200 * 16, 9, 3, 64, torch.float32, seed=4)
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    torch.testing.assert_close(out.double(), oracle(q, k, v, [], segments, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("holders", [2, 4, 40])
def test_a_shared_node_of_a_small_step_is_read_by_every_thread(impl, holders, monkeypatch):
    """n samples of a long prompt: its node, read by a few decode tokens, is cut into key chunks as a lone
    token's context is, so every thread reads a share (one piece left the other threads idle, and sharing a
    2,048-token node among 4 tokens ran at 0.7x the in-place reads); a step of many blocks keeps it whole."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    gen = torch.Generator().manual_seed(5)
    pages = Pages(400, 16, gen)
    node = pages.contiguous(2048)
    units = [(*node, 0, holders, 0)]
    segments = [(i, i + 1, pages.runs(8), 8) for i in range(holders)]
    meta = StepAttentionMeta.build(units, segments, holders, "cpu")
    small = holders < step_work.SPLIT_BLOCKS_PER_THREAD * 2
    keys = sorted({p[5] for p in meta.pieces.tolist()})  # every piece is the node's (the tails are short)
    assert keys == ([512] if small else [2048])  # 4 chunks of 512 keys on 2 threads, else the node whole
    q, k, v = make_qkv(holders, 400 * 16, 9, 3, 64, torch.float32, seed=6)
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    torch.testing.assert_close(out.double(), oracle(q, k, v, units, segments, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [0, 1])
def test_peaked_scores_over_many_key_chunks_match_the_reference(impl, causal, monkeypatch):
    """Scores spanning tens of units (most weights many orders below the largest, the row maximum moving
    between the tile kernel's 60-key chunks, causal rows stopping inside one): float64 attention's output."""
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    gen = torch.Generator().manual_seed(11)
    pages = Pages(64, 16, gen)
    node = pages.contiguous(300)
    units = [(node[0], node[0] + 40, 0, 40, 1)] if causal else [(*node, 0, 40, 0)]
    segments = [(i, i + 1, pages.runs(3), 3) for i in range(40)]
    q, k, v = make_qkv(40, 64 * 16, 9, 3, 64, torch.float32, seed=12)
    q *= 3.0  # scores of order +-25 after the 1/8 scale: most weights far below the maximum
    k[node[0] + 150] *= 4.0  # one key far above the rest, in a later chunk than the first maxima
    meta = StepAttentionMeta.build(units, segments, 40, "cpu")
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    want = oracle(q, k, v, units, segments, 0.125)
    # float32 scores of size s are each off by about s * 2**-24, so the bound grows with them: both impls
    # are 2.7e-6 from float64 at the same element here.
    torch.testing.assert_close(out.double(), want, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tile", [True, False])
def test_a_nan_key_gives_nan_to_the_rows_that_see_it_only(impl, tile, monkeypatch):
    """A NaN in the cache (a broken model) must reach the rows that read it, where sampling reports it,
    and no other row: never taken for a row that saw no key (which the merge would then drop)."""
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0 if tile else -1)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    gen = torch.Generator().manual_seed(13)
    pages = Pages(64, 16, gen)
    node = pages.contiguous(200)
    units = [(*node, 0, 32, 0)]
    segments = [(i, i + 1, pages.runs(2), 2) for i in range(40)]  # tokens 32.. see their tails only
    q, k, v = make_qkv(40, 64 * 16, 9, 3, 64, torch.float32, seed=14)
    k[node[0] + 100, 1] = float("nan")  # KV head 1: query heads 3, 4, 5
    meta = StepAttentionMeta.build(units, segments, 40, "cpu")
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    assert torch.isnan(out[:32, 3:6]).all()
    assert torch.isfinite(out[:32, :3]).all() and torch.isfinite(out[:32, 6:]).all()
    assert torch.isfinite(out[32:]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("own_keys_as", ["causal unit", "segment"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_non_finite_value_reaches_only_the_rows_that_see_its_key(
    impl, tile, bad, own_keys_as, kv_dtype, monkeypatch
):
    """An inf (a float16 cache overflows to it) or NaN in a V row, inside a prefill's causal diagonal: the
    rows before its key give it probability 0, and 0 x inf is NaN, so they must not multiply it at all (a
    prefill row's NaN would become K/V that the prefix cache shares with other requests)."""
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0 if tile else -1)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    n = 70
    q, k, v = make_qkv(n, 128, 9, 3, 64, torch.float32, seed=3)
    k, v = k.to(kv_dtype), v.to(kv_dtype)  # float16: the widened copy of each chunk holds the inf
    if own_keys_as == "causal unit":
        units, segments = [(0, n, 0, n, 1)], [(0, n, [], 0)]
    else:
        units, segments = [], [(0, n, [(0, n)], 1)]
    meta = StepAttentionMeta.build(units, segments, n, "cpu")
    v[50, 1, 7] = 1.5
    clean = step_attention(q, k, v, meta, 0.125, impl=impl)
    v[50, 1, 7] = bad  # KV head 1: query heads 3, 4, 5; tokens 50.. see it
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    torch.testing.assert_close(out[:50], clean[:50], atol=1e-6, rtol=1e-5)
    assert not torch.isfinite(out[50:, 3:6, 7]).any()
    assert torch.isfinite(out[:, :3]).all() and torch.isfinite(out[:, 6:]).all()
    if impl == "cpp":
        assert torch.equal(out[:50], clean[:50])  # the key's other entries give the same rounding either way


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tile", [True, False])
def test_a_nan_key_inside_a_causal_diagonal_stays_with_the_rows_that_see_it(impl, tile, monkeypatch):
    """The same for K: ATen's flash kernel adds the mask to the scores, and NaN + -inf is NaN."""
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0 if tile else -1)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    n = 70
    q, k, v = make_qkv(n, 128, 9, 3, 64, torch.float32, seed=4)
    meta = StepAttentionMeta.build([], [(0, n, [(0, n)], 1)], n, "cpu")  # the own keys as the segment's run
    clean = step_attention(q, k, v, meta, 0.125, impl=impl)
    k[50, 1, 7] = float("nan")
    out = step_attention(q, k, v, meta, 0.125, impl=impl)
    torch.testing.assert_close(out[:50], clean[:50], atol=1e-6, rtol=1e-5)
    assert torch.isnan(out[50:, 3:6]).all()
    assert torch.isfinite(out[:, :3]).all() and torch.isfinite(out[:, 6:]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nothing_visible_anywhere_gives_zeros(impl):
    segments = [(0, 2, [], 0), (2, 3, [(4, 4)], 5)]  # no runs; an empty run
    meta = StepAttentionMeta.build([(3, 3, 0, 3, 0)], segments, 3, "cpu")  # an empty unit is dropped
    q, k, v = make_qkv(3, 8, 4, 2, 16, torch.float32)
    out = step_attention(q, k, v, meta, 0.25, impl=impl)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_query_and_empty_step(impl):
    units, segments, t, slots = mixed_step(seed=5)
    q, k, v = make_qkv(t, slots, 9, 3, 64, torch.float32)
    q_wide = torch.cat([q, q], dim=2)[:, :, :64]  # a view with a row stride of 2 * Hq * D
    meta = StepAttentionMeta.build(units, segments, t, "cpu")
    torch.testing.assert_close(
        step_attention(q_wide, k, v, meta, 0.125, impl=impl), step_attention(q, k, v, meta, 0.125, impl=impl)
    )
    empty = StepAttentionMeta.build([], [], 0, "cpu")
    assert step_attention(q[:0], k, v, empty, 0.125, impl=impl).shape == (0, 9, 64)


@pytest.mark.parametrize("impl", IMPLS)
def test_inference_mode_and_grad_inputs(impl, monkeypatch):
    """The runner calls under inference_mode; a query that requires grad, or a pool allocated under
    inference_mode, must not trip autograd in the op's worker threads (they do not inherit the caller's grad
    mode), on any path a piece can take."""
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    monkeypatch.setattr(step_work, "PIECE_TOKENS", 2)  # many tile pieces, so every thread runs some
    units = [(0, 300, 0, 64, 0), (300, 364, 0, 64, 1)]
    segments = [(i, i + 1, [(400 + 4 * i, 404 + 4 * i)], 4) for i in range(64)]
    q, k, v = make_qkv(64, 700, 9, 3, 64, torch.float32)
    meta = StepAttentionMeta.build(units, segments, 64, "cpu")
    want = oracle(q, k, v, units, segments, 0.125)
    with torch.inference_mode():
        k_pool, v_pool = k.clone(), v.clone()  # a pool allocated under inference_mode
        got = step_attention(q.clone(), k_pool, v_pool, meta, 0.125, impl=impl)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    with torch.no_grad():
        got = step_attention(q.requires_grad_(), k_pool, v_pool, meta, 0.125, impl=impl)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Draft trees: packed from work items, against float64 attention under an explicit mask
# --------------------------------------------------------------------------------------------------

TREE_PAGE = 4


def draft_tree_step(seed: int = 0):
    """A step of work items on shuffled pages (page size 4), as the engine packs it: three items hold a
    3-page prefix read by one shared run (a draft tree with two roots, an ordinary decode, and a tree that
    starts exactly at the run's end), then a 20-token prefill chunk whose own keys are one causal unit, an
    18-token random tree outside any run (as many tokens as a unit-read chunk), and a 3-token extend."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(96, generator=gen).tolist()  # pages 96..127 stay for the consecutive chunk
    shared = [free.pop() for _ in range(3)]

    def item(start, k, rows, parents=None, head=()):
        pages = list(head)
        while len(pages) * TREE_PAGE < start + k:
            pages.append(free.pop())
        tokens = tuple(int(x) for x in torch.randint(0, 50, (k,), generator=gen))
        return Work(None, tuple(pages), start, tokens, rows, parents)

    random_tree = [-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, 18)]
    work = (
        item(17, 8, 8, (-1, 0, 0, 1, 1, 2, -1, 6), head=shared),
        item(14, 1, 1, head=shared),
        item(12, 4, 2, (-1, 0, 1, 1), head=shared),
        item(6, 20, 0, head=[free.pop()] + list(range(96, 103))),  # positions 4..27 on consecutive slots
        item(9, 18, 18, tuple(random_tree)),
        item(5, 3, 1),
    )
    return StepPlan(work, (), (SharedRun(0, 3, 0, 3),), (3, 3, 3, 0, 0, 0)), 128 * TREE_PAGE


def seen_by(w: Work, j: int) -> list[int]:
    """The item's own tokens that token j sees, from the work item alone: its ancestors and itself in a
    tree, tokens 0..j otherwise."""
    if w.parents is None:
        return list(range(j + 1))
    out = [j]
    while w.parents[out[-1]] != -1:
        out.append(w.parents[out[-1]])
    return out


def explicit_mask(plan: StepPlan, slots: int) -> torch.Tensor:
    """bool [T, slots]: token t may read pool slot s. Every token reads its context [0, start) and the
    slots of the item's tokens it sees; nothing here looks at units, segments or shared runs."""
    rows = []
    for w in plan.work:
        slot = lambda p, w=w: w.pages[p // TREE_PAGE] * TREE_PAGE + p % TREE_PAGE  # noqa: E731
        for j in range(len(w.tokens)):
            row = torch.zeros(slots, dtype=torch.bool)
            row[[slot(p) for p in range(w.start)] + [slot(w.start + a) for a in seen_by(w, j)]] = True
            rows.append(row)
    return torch.stack(rows)


def masked_attention(q, k, v, mask, scale):
    """float64 softmax attention of q [T, Hq, D] over the whole pool k/v [S, Hkv, D] under mask [T, S]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", probs, vv)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 20)])
def test_draft_trees_in_a_mixed_step_match_a_masked_reference(impl, hq, hkv, d, cuts):
    """Trees inside a shared run and outside, next to a decode, a causal prefill chunk and an extend: every
    token's output is float64 attention under its explicit mask (context, then its ancestors and itself),
    and each tree token sits at position start + depth."""
    plan, slots = draft_tree_step()
    batch, starts = pack(plan, TREE_PAGE, "cpu")
    causal = [u for u in batch.meta.unit_list if u[4]]
    assert len(causal) == 1 and causal[0][3] - causal[0][2] == 20  # the prefill chunk's own keys
    for w, t0 in zip(plan.work, starts, strict=True):
        want = [w.start + len(seen_by(w, j)) - 1 for j in range(len(w.tokens))]
        assert batch.positions[t0 : t0 + len(w.tokens)].tolist() == want
    assert batch.logit_rows.numel() == 8 + 1 + 2 + 18 + 1
    q, k, v = make_qkv(batch.meta.num_tokens, slots, hq, hkv, d, torch.float32)
    out = step_attention(q, k, v, batch.meta, d**-0.5, impl=impl)
    want = masked_attention(q, k, v, explicit_mask(plan, slots), d**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


def test_draft_trees_cpp_equals_torch():
    plan, slots = draft_tree_step(seed=4)
    batch, _ = pack(plan, TREE_PAGE, "cpu")
    q, k, v = make_qkv(batch.meta.num_tokens, slots, 8, 2, 64, torch.bfloat16)
    a = step_attention(q, k, v, batch.meta, 0.125, impl="cpp")
    b = step_attention(q, k, v, batch.meta, 0.125, impl="torch")
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "parents,match",
    [((-1, 0), "one parent per token"), ((-1, 1, 0), "parent 1 is neither"), ((-2, 0, 0), "parent -2")],
)
def test_bad_draft_trees_are_named(parents, match):
    with pytest.raises(ValueError, match=match):
        pack(StepPlan((Work(None, (0,), 0, (1, 2, 3), 1, parents),)), TREE_PAGE, "cpu")


# --------------------------------------------------------------------------------------------------
# Bad input and fallbacks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "units,segments,num_tokens,match",
    [
        ([], [(0, 1, [], 1), (2, 3, [], 1)], 3, "starts at token 2, expected 1"),
        ([], [(0, 1, [], 1)], 2, "cover tokens \\[0, 1\\) but the step has 2"),
        ([], [(0, 1, [(5, 3)], 1)], 1, "bad slot run"),
        ([], [(0, 1, [], -1)], 1, "visible must be >= 0"),
        ([(0, 4, 0, 2, 0)], [(0, 1, [], 1)], 1, "outside the step"),
        ([(0, 4, 0, 1, 1)], [(0, 1, [], 1)], 1, "must be square"),
        ([(0, 4, 0, 1, 2)], [(0, 1, [], 1)], 1, "causal must be 0 or 1"),
        ([(0, 4, 0)], [(0, 1, [], 1)], 1, "must be \\(kv_lo"),
        ([("a", 4, 0, 1, 0)], [(0, 1, [], 1)], 1, "integers"),
        ([], [(0, 1, [(0, 1, 2)], 1)], 1, "integer pairs"),
        ([], [(0, 1, [])], 1, "must be \\(tok_lo"),
    ],
)
def test_bad_metadata_is_named(units, segments, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        StepAttentionMeta.build(units, segments, num_tokens, "cpu")


def test_bad_tensors_are_named():
    meta = StepAttentionMeta.build([(0, 10, 0, 2, 0)], [(0, 2, [(10, 12)], 2)], 2, "cpu")
    q, k, v = make_qkv(2, 12, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="holds? 11 slots|k/v hold 11 slots"):
        step_attention(q, k[:11], v[:11], meta, 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        step_attention(q[:, :3], k, v, meta, 1.0)
    with pytest.raises(ValueError, match="3 tokens"):
        step_attention(torch.cat([q, q[:1]]), k, v, meta, 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        step_attention(q, k.half(), v, meta, 1.0)
    with pytest.raises(ValueError, match="narrower one under float32 q"):
        step_attention(q.half(), k.bfloat16(), v.bfloat16(), meta, 1.0)
    with pytest.raises(ValueError, match="narrower one under float32 q"):
        step_attention(q.bfloat16(), k, v, meta, 1.0)
    with pytest.raises(ValueError, match="impl must be"):
        step_attention(q, k, v, meta, 1.0, impl="fast")


def test_no_cpp_env_falls_back_to_torch(monkeypatch):
    meta = StepAttentionMeta.build([(0, 10, 0, 2, 0)], [(0, 2, [(10, 12)], 2)], 2, "cpu")
    q, k, v = make_qkv(2, 12, 4, 2, 8, torch.float32)
    want = step_attention(q, k, v, meta, 1.0, impl="torch")
    monkeypatch.setenv("HYDRAGEN_NO_CPP", "1")
    assert cpp_build.step_attention_op() is None
    torch.testing.assert_close(step_attention(q, k, v, meta, 1.0), want)
    with pytest.raises(RuntimeError, match="HYDRAGEN_NO_CPP"):
        step_attention(q, k, v, meta, 1.0, impl="cpp")


def test_stale_build_lock_does_not_hang():
    """A build killed mid-way leaves torch's lock file behind; the next load must not wait for it forever."""
    assert cpp_build.step_attention_op() is not None
    where = cpp_build.build_folder()
    (where / "lock").touch()
    done = threading.Event()
    threading.Thread(target=lambda: (cpp_build._build(), done.set()), daemon=True).start()
    assert done.wait(timeout=60), "loading waited on a stale lock file"
    assert not (where / "lock").exists()


_LOCK_HOLDER = """
import sys
from pathlib import Path
from hydragen.native import build
with build._build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
"""


class _Stderr(io.StringIO):
    """A stand-in for sys.stderr that signals its first write."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()

    def write(self, text: str) -> int:
        count = super().write(text)
        self.written.set()
        return count


def _wait_for_the_lock(where, monkeypatch) -> tuple[subprocess.Popen, _Stderr, threading.Event]:
    """A child process holds the build lock of `where` (the real lock code); this process then waits for it
    in a thread, with stderr captured. Returns the child, the captured stderr and an event set once the
    thread holds the lock."""
    command = [sys.executable, "-c", _LOCK_HOLDER, str(where)]
    holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    err = _Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    entered = threading.Event()

    def wait() -> None:
        with cpp_build._build_lock(where):
            entered.set()

    threading.Thread(target=wait, daemon=True).start()
    return holder, err, entered


def _blocked_on(lock) -> bool:
    """Whether /proc/locks shows a process blocked on `lock` (a "->" line names the file's inode)."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.wait(timeout=60) == 0


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's flock and /proc/locks")
def test_a_load_that_waits_for_another_process_compiling_says_so_once(tmp_path, monkeypatch):
    """The first load compiles for a minute or more under the build lock, and every other process that
    loads the ops meanwhile waits for it: each says on stderr, once, before it waits, that it waits for
    that process to finish compiling, and which lock it waits on (it was silent for 49 s)."""
    where = tmp_path / "ext" / "hydragen_ops_0123456789abcdef"
    where.mkdir(parents=True)
    holder, err, entered = _wait_for_the_lock(where, monkeypatch)
    try:
        assert err.written.wait(timeout=60), "waited without a word"
        assert not entered.is_set()  # said before it had the lock
        lock = where / "hydragen.lock"
        waits_for = f"waiting for process {holder.pid} to finish compiling the C++ CPU ops"
        assert err.getvalue() == f"hydragen: {waits_for} (build lock {lock})\n"
    finally:
        _release(holder)
    assert entered.wait(timeout=60)
    assert err.getvalue().count("\n") == 1  # once
    assert lock.read_text() == ""  # released: no holder named


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's flock and /proc/locks")
def test_a_load_that_waits_while_another_process_loads_the_library_stays_quiet(tmp_path, monkeypatch):
    """With the library built, the holder is only loading it (milliseconds): a process that waits for the
    lock then says nothing."""
    where = tmp_path / "ext" / "hydragen_ops_0123456789abcdef"
    where.mkdir(parents=True)
    (where / f"{where.name}.so").touch()
    holder, err, entered = _wait_for_the_lock(where, monkeypatch)
    try:
        deadline = time.monotonic() + 60
        while not _blocked_on(where / "hydragen.lock"):  # the thread is past its message, if any
            assert time.monotonic() < deadline, "the thread never blocked on the lock"
            time.sleep(0.01)
    finally:
        _release(holder)
    assert entered.wait(timeout=60)
    assert err.getvalue() == ""


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    """No compiler or any build error: auto warns once and runs the torch twin; impl='cpp' names it."""

    def no_compiler():
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(cpp_build, "_ops", None)
    monkeypatch.setattr(cpp_build, "_error", None)
    monkeypatch.setattr(cpp_build, "_build", no_compiler)
    monkeypatch.setattr(sa_module, "_warned", False)
    monkeypatch.delenv("HYDRAGEN_NO_CPP", raising=False)
    meta = StepAttentionMeta.build([(0, 10, 0, 2, 0)], [(0, 2, [(10, 12)], 2)], 2, "cpu")
    q, k, v = make_qkv(2, 12, 4, 2, 8, torch.float32)
    want = step_attention(q, k, v, meta, 1.0, impl="torch")
    with pytest.warns(UserWarning, match="No such file"):
        torch.testing.assert_close(step_attention(q, k, v, meta, 1.0), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call stays quiet
        step_attention(q, k, v, meta, 1.0)
    with pytest.raises(RuntimeError, match="unavailable: RuntimeError: error: command 'c\\+\\+' failed"):
        step_attention(q, k, v, meta, 1.0, impl="cpp")


def test_the_package_ships_every_source_the_build_compiles():
    """The ops are compiled on the user's machine, so an installed package must hold every .cpp and every
    header the build copies (a wheel with the .cpp files only would fail to build, and run the slow twins)."""
    import fnmatch
    import re
    from pathlib import Path

    from tests.helpers.paths import ROOT

    text = (ROOT / "pyproject.toml").read_text()  # no tomllib on 3.10
    section = text.split("[tool.setuptools.package-data]", 1)[1]
    patterns = re.findall(r'"([^"]+)"', re.search(r"^hydragen = \[(.*?)\]", section, re.M).group(1))
    package = Path(cpp_build.__file__).resolve().parents[1]
    for source in cpp_build.SOURCES + cpp_build.HEADERS:
        relative = source.resolve().relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"{relative} is not package data"


def test_build_key_tracks_source_and_flags(monkeypatch):
    key = cpp_build.build_key()
    assert cpp_build.step_attention_op() is not None  # loading must not change the key (torch edits its args)
    assert key == cpp_build.build_key()
    monkeypatch.setattr(cpp_build, "CFLAGS", (*cpp_build.CFLAGS, "-DHYDRAGEN_TEST"))
    assert cpp_build.build_key() != key
    flagged = cpp_build.build_key()
    monkeypatch.setenv("HYDRAGEN_CPP_FLAGS", "-mno-avx512f  -DNAME='a b'")  # another vector width, own build
    assert cpp_build.cflags() == (*cpp_build.CFLAGS, "-mno-avx512f", "-DNAME=a b")
    assert cpp_build.build_key() not in (key, flagged)


def test_another_checkout_of_the_same_source_loads_the_cached_build(monkeypatch, tmp_path, capsys):
    """The build folder is keyed by the source's content, not its path: a second checkout (a worktree, a
    clone, a venv) of the same version loads the existing library instead of recompiling it."""
    assert cpp_build.step_attention_op() is not None  # the build exists
    where = cpp_build.build_folder()
    built = (where / f"{cpp_build.library_name()}.so").stat().st_mtime_ns
    other = tmp_path / "checkout"
    other.mkdir()
    for source in cpp_build.SOURCES:
        (other / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(cpp_build, "SOURCES", tuple(other / source.name for source in cpp_build.SOURCES))
    capsys.readouterr()
    assert cpp_build._build() is not None
    assert "compiled" not in capsys.readouterr().err
    assert (where / f"{cpp_build.library_name()}.so").stat().st_mtime_ns == built


# --------------------------------------------------------------------------------------------------
# The C++ op's exactness guarantees (bit for bit, not within a tolerance)
# --------------------------------------------------------------------------------------------------


def _cpp_or_skip():
    if cpp_build.step_attention_op() is None:
        pytest.skip(f"the C++ op is unavailable: {cpp_build.build_error()}")


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 20])
@pytest.mark.parametrize("tile", [True, False])
def test_a_16bit_cache_reads_exactly_its_float32_widening(cache, d, tile, monkeypatch):
    """A 16-bit cache is widened to float32 as it is read, exactly (every 16-bit value is a float32), and past
    the loads each kernel's 16-bit instantiation does its float32 one's arithmetic: the output is the float32
    op's on the widened cache, bit for bit, through segment blocks and a shared node's pieces (the tile kernel
    or attend()), with head dims that fill whole vectors and one that leaves a tail.

    On every CPU, because the ops are compiled with -ffp-contract=off (native/build.py): with GCC's default,
    a product and an add that the inliner put in one basic block were fused, and where depended on the
    instantiation and on -march=native. Tuned for Sapphire Rapids, attend<float, float> fused the running sum
    `l * alpha + sum` into one FMA and attend<float, Half> did not: on a Xeon with AVX512-FP16 this test's
    four cases of then (segments only) failed, 3.6-6.3 % of the outputs 1 ulp apart (up to 1.19e-7). Built
    here with -mtune=sapphirerapids, every case fails without the flag and passes with it."""
    _cpp_or_skip()
    monkeypatch.setattr(step_work, "TILE_MIN_ROWS", 0 if tile else -1)
    monkeypatch.setattr(step_work, "TILE_MIN_KEYS", 0)
    gen = torch.Generator().manual_seed(11)
    pages = Pages(200, 16, gen)
    lengths = torch.randint(1, 300, (5,), generator=gen).tolist()
    segments = [(r, r + 1, pages.runs(n), 1000) for r, n in enumerate(lengths)]
    segments.append((5, 17, pages.runs(40), 29))
    units = [(*pages.contiguous(90), 0, 12, 0)]  # a shared node over tokens 0-11: 36 rows a KV head
    q, k, v = make_qkv(17, 200 * 16, 9, 3, d, torch.float32, seed=12)
    k16, v16 = k.to(cache), v.to(cache)
    meta = StepAttentionMeta.build(units, segments, 17, "cpu")
    narrow = step_attention(q, k16, v16, meta, d**-0.5, impl="cpp")
    wide = step_attention(q, k16.float(), v16.float(), meta, d**-0.5, impl="cpp")
    assert torch.equal(narrow, wide)


@pytest.mark.parametrize("d", [32, 64])
def test_query_heads_sharing_v_rows_give_the_per_row_bits(d):
    """Up to 4 query heads of a KV head take its V rows together; each row's arithmetic is the per-row path's:
    the same rows computed with 5 query heads per KV head (the per-row path) give the same bits. Which head
    dims share V rows depends on the registers (step_attention.cpp's shared_pv): 3 heads x 64 columns fit
    AVX-512's but not AVX2's, 3 x 32 fit both, so d = 32 keeps the test meaningful on an AVX2 build."""
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(13)
    pages = Pages(200, 16, gen)
    lengths = torch.randint(1, 300, (6,), generator=gen).tolist()
    segments = [(r, r + 1, pages.runs(n), 1000) for r, n in enumerate(lengths)]
    q5, k, v = make_qkv(6, 200 * 16, 15, 3, d, torch.float32, seed=14)
    meta = StepAttentionMeta.build([], segments, 6, "cpu")
    heads = [h * 5 + j for h in range(3) for j in range(3)]  # 3 of each KV head's 5 query heads
    per_row = step_attention(q5, k, v, meta, 0.125, impl="cpp")[:, heads]
    shared = step_attention(q5[:, heads].contiguous(), k, v, meta, 0.125, impl="cpp")
    assert torch.equal(shared, per_row)


def test_the_thread_count_does_not_change_a_bit():
    """Items are handed out dynamically, but each writes its own partial and the merge order is fixed."""
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(15)
    pages = Pages(400, 16, gen)
    units = [(*pages.contiguous(70), 0, 8, 0)]
    lengths = torch.randint(1, 600, (8,), generator=gen).tolist()
    segments = [(r, r + 1, pages.runs(n), 1000) for r, n in enumerate(lengths)]
    segments.append((8, 30, pages.runs(22), 1))
    q, k, v = make_qkv(30, 400 * 16, 9, 3, 64, torch.float32, seed=16)
    meta = StepAttentionMeta.build(units, segments, 30, "cpu")
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(step_attention(q, k, v, meta, 0.125, impl="cpp"))
    torch.set_num_threads(2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_k_and_v_with_different_layouts_are_read_within_their_rows(tmp_path):
    """K and V need only the same shape: with K's heads further apart than V's (a view of a wider tensor) the
    op must still read no byte past V's last row. V ends right before an unreadable page, so a stray read
    crashes the child process that runs the op."""
    _cpp_or_skip()
    script = tmp_path / "guard.py"
    script.write_text(
        """
import ctypes, mmap
import numpy as np, torch
from hydragen.attention.step_attention import StepAttentionMeta, step_attention
torch.set_num_threads(1)
S, H, D = 64, 2, 64
nbytes = S * H * D * 4
page = mmap.PAGESIZE
assert nbytes % page == 0
buf = mmap.mmap(-1, nbytes + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
libc = ctypes.CDLL(None)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert libc.mprotect(ctypes.c_void_p(addr + nbytes), page, 0) == 0
v = torch.from_numpy(np.frombuffer(buf, dtype=np.float32, count=S * H * D)).view(S, H, D)
v.copy_(torch.randn(S, H, D))
k = torch.randn(S, H, 2 * D)[..., :D]
q = torch.randn(1, 6, D)
meta = StepAttentionMeta.build([], [(0, 1, [(S - 40, S)], 40)], 1, "cpu")
out = step_attention(q, k, v, meta, 0.125, impl="cpp")
ref = step_attention(q, k, v.clone(), meta, 0.125, impl="torch")
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
print("ok")
"""
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("keys", [100, 250, 254, 256, 257, 500, 512, 700])
@pytest.mark.parametrize("drafts", [4, 8])
def test_a_token_of_a_longer_segment_is_bit_for_bit_its_decode_row(keys, drafts):
    """Speculative decoding verifies drafts as the tokens of one segment (the next input, then the drafts,
    each seeing one more key): on the C++ op each token's output equals, bit for bit, the output of the same
    query decoded alone over the same keys, also where the segment's keys cross a multiple of
    SEGMENT_CHUNK_KEYS that the token's own keys do not reach (its last chunk then read by a piece)."""
    if cpp_build.step_attention_op() is None:
        pytest.skip("the C++ op is unavailable")
    gen = torch.Generator().manual_seed(keys + drafts)
    pages = Pages(200, 16, gen)
    runs = pages.runs(keys + drafts)
    q, k, v = make_qkv(drafts + 1, 200 * 16, 9, 3, 64, torch.float32, seed=keys)
    chain = StepAttentionMeta.build([], [(0, drafts + 1, runs, keys)], drafts + 1, "cpu")
    together = step_attention(q, k, v, chain, 0.125, impl="cpp")
    for j in range(drafts + 1):
        alone = StepAttentionMeta.build(
            [], [(0, 1, step_work.cut_runs(runs, 0, keys + j), keys + j)], 1, "cpu"
        )
        row = step_attention(q[j : j + 1], k, v, alone, 0.125, impl="cpp")
        assert torch.equal(row[0], together[j]), (keys, drafts, j)
