"""Triton decode kernels against float64 attention: on CPU through the interpreter, on CUDA compiled.

Triton reads TRITON_INTERPRET when ``@triton.jit`` runs (its own library functions are decorated when
triton is imported), so conftest sets it before anything imports triton; the kernel module is imported
lazily, in the ``tk`` fixture. Shapes are tiny on CPU; the ``real`` tests use the paper's
shapes and run only where CUDA is available.
"""

from __future__ import annotations

import os

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.attention.reference import reference_attention
from hydragen.attention.step_work import cut_runs
from hydragen.attention.tree_plan import build_tree_plan
from hydragen.engine.model_runner import ModelRunner
from tests.helpers.paths import SRC

if not torch.cuda.is_available():  # conftest does this too: it must happen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error bounds of the output: bf16 outputs are rounded to bf16 (~4e-3 alone), and on a GPU the
# probabilities are rounded to bf16 for the P @ V tensor-core dot. LSEs are fp32 from fp32-accumulated
# exact products in every mode, so they are held tight: a merge weight off by 1% shows there.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}
LSE_TOL = 1e-5


@pytest.fixture(scope="module")
def tk():
    from hydragen.attention import triton_kernels

    if DEV == "cpu" and not triton_kernels.is_interpreted():
        pytest.skip("TRITON_INTERPRET=0 on a machine without CUDA: the kernels cannot run")
    return triton_kernels


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(x).any()
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def make_pool(slots: int, hkv: int, d: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype).to(DEV)
    return k, v


def reference(q, k, v, runs: list[list[tuple[int, int]]], scale: float):
    """float64 attention of q[b] over the concatenation of pool slot runs ``runs[b]``; (out, lse)."""
    outs, lses = [], []
    for b, rs in enumerate(runs):
        idx = torch.cat([torch.arange(s, e) for s, e in rs] + [torch.zeros(0, dtype=torch.long)]).to(k.device)
        if len(idx) == 0:
            outs.append(torch.zeros(q.shape[1], q.shape[2], dtype=torch.float64, device=q.device))
            lses.append(torch.full((q.shape[1],), float("-inf"), dtype=torch.float64, device=q.device))
            continue
        o, lse = reference_attention(q[b : b + 1, None], [], [], k[idx][None], v[idx][None], scale=scale)
        outs.append(o[0, 0])
        lses.append(lse[0, 0])
    return torch.stack(outs), torch.stack(lses)


def paged_tails(lengths, first_slot: int, slots: int, page: int, seed: int = 0):
    """Tails of ``lengths`` tokens on shuffled pages of [first_slot, slots): (page table int32 [B, P] on
    DEV, each tail's slot runs). Tails are read through their tables, so scattered pages are the test."""
    g = torch.Generator().manual_seed(seed)
    free = (first_slot // page + torch.randperm(slots // page - first_slot // page, generator=g)).tolist()
    need = [-(-n // page) for n in lengths]
    table = torch.zeros(len(lengths), max(max(need), 1), dtype=torch.int32)
    runs = []
    for b, n in enumerate(lengths):
        pages = [free.pop() for _ in range(need[b])]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        rs: list[tuple[int, int]] = []
        for i in range(n):
            slot = pages[i // page] * page + i % page
            rs = rs[:-1] + [(rs[-1][0], slot + 1)] if rs and rs[-1][1] == slot else rs + [(slot, slot + 1)]
        runs.append(rs)
    return table.to(DEV), runs


def check(out, lse, ref_out, ref_lse, dtype):
    empty = torch.isneginf(ref_lse)
    assert not torch.isnan(lse).any()
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    assert rel_err(out[~empty], ref_out[~empty]) < TOL[dtype]
    assert rel_err(lse[~empty], ref_lse[~empty]) < LSE_TOL


HEADS = [(4, 2, 16), (4, 1, 20), (2, 2, 32)]  # (Hq, Hkv, D): GQA, MQA with D not a power of 2, MHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_tail_kernel_ragged(tk, hq, hkv, d, dtype):
    k, v = make_pool(300, hkv, d, dtype)
    lengths = [5, 0, 37, 1, 70]
    lens = torch.tensor(lengths, device=DEV)
    pages, runs = paged_tails(lengths, 0, 300, 4)
    q = torch.randn(5, hq, d).to(dtype).to(DEV)
    nan = float("nan")  # poisoned outputs: every element must be written
    out = torch.full((5, 1, hq, d), nan, device=DEV)
    lse = torch.full((5, 1, hq), nan, device=DEV)
    out, lse = tk.tail_attention(q, k, v, pages, 4, lens, 0.3, block_n=16, out=out, lse=lse)
    check(out[:, 0], lse[:, 0], *reference(q, k, v, runs, 0.3), dtype)
    # Split-KV: split s of sequence b is its own partial over tail positions [32 s, 32 s + 32).
    out, lse = tk.tail_attention(q, k, v, pages, 4, lens, 0.3, split_len=32, num_splits=3, block_n=16)
    for sp in range(3):
        split_runs = [cut_runs(rs, 32 * sp, 32 * sp + 32) for rs in runs]
        check(out[:, sp], lse[:, sp], *reference(q, k, v, split_runs, 0.3), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_kernel_chunks_and_tiles(tk, dtype):
    """One node split into several KV chunks and query tiles: every partial is attention over its chunk."""
    hq, hkv, d = 4, 1, 16
    k, v = make_pool(120, hkv, d, dtype)
    q = torch.randn(7, hq, d).to(dtype).to(DEV)
    items = [(10, 60, 0, 7), (70, 75, 2, 4)]
    plan = build_tree_plan(
        items, torch.zeros(7, 1, dtype=torch.int32, device=DEV), 4, group=4, num_kv_heads=1, tail_cap=1,
        chunk_tokens=16, block_m=16,
    )  # fmt: skip
    assert plan.num_units == 4 * 2 + 1  # 50 tokens in 4 chunks x 7 sequences in 2 tiles, + 1
    part_o = torch.full((plan.num_parts, hq, d), float("nan"), device=DEV)
    part_lse = torch.full((plan.num_parts, hq), float("nan"), device=DEV)
    tk.shared_attention(
        q, k, v, plan.units, plan.num_parts, 0.25, block_m=16, block_n=16, part_o=part_o, part_lse=part_lse
    )
    rows, runs, qs = [], [], []
    for kv_lo, kv_hi, s0, s1, row in plan.units.tolist():
        for s in range(s0, s1):
            rows.append(row + s - s0)
            runs.append([(kv_lo, kv_hi)])
            qs.append(s)
    assert sorted(rows) == list(range(plan.num_parts))
    check(part_o[rows], part_lse[rows], *reference(q[qs], k, v, runs, 0.25), dtype)


def test_merge_kernel_matches_torch_merge(tk):
    from hydragen.attention.merge import merge_partials

    b, s, hq, d, r = 4, 3, 4, 16, 5
    tail_o, tail_lse = torch.randn(b, s, hq, d, device=DEV), torch.randn(b, s, hq, device=DEV)
    part_o, part_lse = torch.randn(r, hq, d, device=DEV), torch.randn(r, hq, device=DEV)
    tail_lse[0, 1:] = float("-inf")  # empty splits
    tail_o[0, 1:] = 0
    tail_lse[3] = float("-inf")  # a sequence that sees nothing at all
    tail_o[3] = 0
    lists = [[0, 4], [], [1, 2, 3], []]
    seq_ptr = torch.tensor([0, 2, 2, 5, 5], dtype=torch.int32, device=DEV)
    seq_parts = torch.tensor(sum(lists, []), dtype=torch.int32, device=DEV)
    out, lse = tk.merge_attention(tail_o, tail_lse, seq_ptr, seq_parts, part_o, part_lse, group=2)
    for i in range(b):
        outs = [tail_o[i, j] for j in range(s)] + [part_o[p] for p in lists[i]]
        lses = [tail_lse[i, j] for j in range(s)] + [part_lse[p] for p in lists[i]]
        ro, rl = merge_partials(outs, lses)
        assert torch.allclose(out[i], ro, atol=1e-5) and torch.allclose(lse[i], rl, atol=1e-5)
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()


def tree_case(hq, hkv, d, dtype, seed=0):
    """Six sequences in DFS order: a root node split in chunks, two nested children, ragged tails.

    Sequence 0 reads root + child A + grandchild; 1-2 root + A; 3-4 root + B; 5 only its tail; 2 has an
    empty tail (seen through shared nodes only).
    """
    k, v = make_pool(400, hkv, d, dtype, seed)
    items = [(0, 40, 0, 5), (40, 52, 0, 3), (52, 55, 0, 1), (60, 70, 3, 5)]
    lengths = [3, 9, 0, 20, 1, 33]
    pages, tails = paged_tails(lengths, 80, 400, 4, seed)  # tails on scattered pages past the nodes
    runs = [[(s, e) for s, e, i, j in items if i <= b < j] + tails[b] for b in range(6)]
    lens = torch.tensor(lengths, device=DEV)
    q = torch.randn(6, hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    return q, k, v, items, pages, lens, runs


TREE_CASES = [  # (heads, dtype, tail split): None fuses the merge into the tail kernel, 8 splits the tails
    *[(h, torch.float32, split) for h in HEADS for split in (None, 8)],
    (HEADS[0], torch.bfloat16, None),
    (HEADS[1], torch.bfloat16, 8),
    (HEADS[2], torch.float16, None),
]


@pytest.mark.parametrize("heads,dtype,tail_split_len", TREE_CASES)
def test_tree_decode_nested_nodes(tk, heads, dtype, tail_split_len):
    hq, hkv, d = heads
    q, k, v, items, pages, lens, runs = tree_case(hq, hkv, d, dtype)
    plan = build_tree_plan(
        items, pages, 4, group=hq // hkv, num_kv_heads=hkv, tail_cap=40, chunk_tokens=16, block_m=16,
        tail_split_len=tail_split_len,
    )  # fmt: skip
    assert plan.tail_splits == (1 if tail_split_len is None else 5)
    out, lse = tk.tree_decode_attention(q, k, v, plan, lens, 0.2, block_n=16, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    check(out, lse, *reference(q, k, v, runs, 0.2), dtype)


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16])
def test_tree_decode_reads_a_16bit_cache_with_fp32_queries(tk, cache):
    """A 16-bit KV cache under float32 compute: float32 accuracy on the cache's own values."""
    q, k, v, items, pages, lens, runs = tree_case(4, 2, 16, cache, seed=5)
    q = q.float()
    plan = build_tree_plan(items, pages, 4, group=2, num_kv_heads=2, tail_cap=40, chunk_tokens=16, block_m=16)
    out, lse = tk.tree_decode_attention(q, k, v, plan, lens, 0.2, block_n=16, return_lse=True)
    assert out.dtype == torch.float32 and k.dtype == cache
    check(out, lse, *reference(q, k.float(), v.float(), runs, 0.2), torch.float32)


def test_padding_units_do_nothing(tk):
    """Tables may live in fixed-capacity buffers: zero rows past the real units must be no-ops."""
    q, k, v, items, pages, lens, runs = tree_case(4, 2, 16, torch.float32, seed=3)
    plan = build_tree_plan(items, pages, 4, group=2, num_kv_heads=2, tail_cap=40, chunk_tokens=16, block_m=16)
    want = tk.tree_decode_attention(q, k, v, plan, lens, 0.2, block_n=16)
    plan.units = torch.cat([plan.units, torch.zeros(5, 5, dtype=torch.long, device=DEV)])
    assert torch.equal(tk.tree_decode_attention(q, k, v, plan, lens, 0.2, block_n=16), want)


# ---- sliding windows and soft-caps -----------------------------------------------------------------

# tree_case's items with the position of each one's first key: the root at 0..39, child A at 40..51 under
# it, the grandchild at 52..54; child B at 40..49 under the root
POSITIONED = [(0, 40, 0, 5, 0), (40, 52, 0, 3, 40), (52, 55, 0, 1, 52), (60, 70, 3, 5, 40)]
TAIL_START = [55, 52, 52, 50, 50, 0]  # each sequence's first tail position


def windowed_runs(items, tails, lengths, window):
    """Per sequence, the slots it sees under ``window`` (as one-slot runs) and its decode position: the
    last key of its context (its tail's last, or its last shared key for an empty tail)."""
    runs, positions = [], []
    for b, n in enumerate(lengths):
        keys = [(s + i, p + i) for s, e, lo, hi, p in items if lo <= b < hi for i in range(e - s)]
        tail = [x for a, z in tails[b] for x in range(a, z)]
        keys += [(slot, TAIL_START[b] + i) for i, slot in enumerate(tail)]
        at = max(p for _, p in keys)
        assert n == 0 or at == TAIL_START[b] + n - 1
        positions.append(at)
        runs.append([(s, s + 1) for s, p in keys if window is None or p > at - window])
    return runs, positions


@pytest.mark.parametrize(
    "window,softcap,tail_split_len,dtype",
    [
        (1, None, None, torch.float32),
        (3, None, 8, torch.float32),
        (8, None, None, torch.float32),
        (20, 2.0, None, torch.float32),
        (60, None, 8, torch.float32),
        (None, 2.0, None, torch.float32),
        (12, 2.0, 8, torch.bfloat16),
    ],
)
def test_tree_decode_with_a_window_and_a_softcap(tk, window, softcap, tail_split_len, dtype):
    """Nested shared nodes, ragged and empty tails: under a window each sequence sees its last W positions
    (shared rows masked below their own bound in one product, tails started at their first visible key),
    and a soft-cap caps every score; windows from one key to more than every context."""
    hq, hkv, d = 4, 2, 16
    q, k, v, items, pages, lens, _ = tree_case(hq, hkv, d, dtype, seed=2)
    q = q * 3
    _, tails = paged_tails([3, 9, 0, 20, 1, 33], 80, 400, 4, 2)
    runs, positions = windowed_runs(POSITIONED, tails, lens.tolist(), window)
    plan = build_tree_plan(
        POSITIONED if window else items, pages, 4, group=hq // hkv, num_kv_heads=hkv, tail_cap=40,
        chunk_tokens=16, block_m=16, tail_split_len=tail_split_len, window=window, positions=positions,
        tail_start=TAIL_START,
    )  # fmt: skip
    out, lse = tk.tree_decode_attention(
        q, k, v, plan, lens, 0.3, block_n=16, return_lse=True, softcap=softcap
    )
    ref_out, ref_lse = [], []
    for b in range(6):
        o, s = reference_capped(q[b : b + 1], k, v, runs[b], 0.3, softcap)
        ref_out.append(o)
        ref_lse.append(s)
    check(out, lse, torch.cat(ref_out), torch.cat(ref_lse), dtype)


def reference_capped(q, k, v, runs, scale, softcap):
    """``reference`` for one sequence, its scores soft-capped."""
    idx = torch.tensor([s for a, z in runs for s in range(a, z)], dtype=torch.long)
    if len(idx) == 0:
        return torch.zeros(1, *q.shape[1:], dtype=torch.float64), torch.full((1, q.shape[1]), float("-inf"))
    o, lse = reference_attention(q[:, None], [], [], k[idx][None], v[idx][None], scale=scale, softcap=softcap)
    return o[:, 0], lse[:, 0].double()


def test_a_window_plan_leaves_out_what_no_sequence_sees():
    """A 64-key node over four sequences at positions 70, 75, 100 and 130 (their tails from 64), W = 40: the
    node's keys before position 31 are not in the plan, a query tile reads a chunk from its sequences' first
    visible key and not at all when none sees it; the tails start at their windows."""
    pages = torch.zeros(4, 20, dtype=torch.int32)
    plan = build_tree_plan(
        [(100, 164, 0, 4, 0)], pages, 4, group=8, num_kv_heads=1, tail_cap=67, chunk_tokens=16, block_m=16,
        window=40, positions=[70, 75, 100, 130], tail_start=[64] * 4,
    )  # fmt: skip
    # first positions 31, 36, 61, 91; the node from slot 131 (position 31) in chunks of 16; tiles of two
    # sequences (block_m 16 / group 8): the second tile first sees position 61 (slot 161)
    units = [tuple(u[:4]) for u in plan.units.tolist()]
    assert units == [(131, 147, 0, 2), (147, 163, 0, 2), (161, 163, 2, 4), (163, 164, 0, 2), (163, 164, 2, 4)]
    assert plan.unit_kpos.tolist() == [31, 47, 61, 63, 63] and plan.num_parts == 10
    assert plan.seq_first.tolist() == [31, 36, 61, 91] and plan.tail_lo.tolist() == [0, 0, 0, 27]
    with pytest.raises(ValueError, match="position"):
        build_tree_plan([(0, 8, 0, 1, 0)], pages[:1], 4, group=2, num_kv_heads=1, tail_cap=4, window=4)


def test_plan_balances_long_nodes():
    """With no chunk size given, a long node is split only until the programs fill the target."""
    pages = torch.zeros(4, 1, dtype=torch.int32)
    items = [(0, 4096, 0, 4)]
    one = build_tree_plan(items, pages, 16, group=8, num_kv_heads=1, tail_cap=64, target_programs=1)
    many = build_tree_plan(items, pages, 16, group=8, num_kv_heads=1, tail_cap=64, target_programs=10)
    assert one.num_units == 4 and many.num_units == 16  # chunks of 1024, then of 256 (the floor)
    assert many.tail_splits == 1  # a 64-token tail is never split below 256 tokens a split
    long_tails = build_tree_plan(items, pages, 16, group=8, num_kv_heads=1, tail_cap=1024, target_programs=10)
    assert long_tails.tail_splits == 3 and long_tails.tail_split_len == 342  # 4 rows x 3 splits >= 10
    spans = sorted((lo, hi) for lo, hi, *_ in many.units.tolist())
    assert spans[0][0] == 0 and spans[-1][1] == 4096
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # chunks tile the node


PROMPTS = [list(range(11, 30)) + [40, 41, 42], list(range(11, 30)) + [50, 51]]


@pytest.mark.parametrize(
    "options", [{}, dict(chunk_tokens=8, block_m=16, tail_split_len=4)], ids=["default", "chunked"]
)
def test_engine_triton_matches_auto(tiny_models, monkeypatch, tk, options):
    """Greedy tokens and logprobs with attention="triton" equal the CPU path's; shared prompts, n=3."""
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    path = tiny_models["llama"]
    baseline = "auto"
    # 4-token pages: the shared stem and each prompt's own whole pages are nested shared runs.
    ref = LLM(path, device=DEV, attention=baseline, kv_cache_tokens=2048, page_size=4)
    want = ref.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "plan_options", options)
    seen = []  # (shared items, work units) of every Triton call: the shared path must really run
    inner = ModelRunner._triton_attention

    def spy(self, row, q, batch, scale, *rest):
        out = inner(self, row, q, batch, scale, *rest)
        seen.append((batch.shared_items, batch.tree_plan.num_units))
        return out

    monkeypatch.setattr(ModelRunner, "_triton_attention", spy)
    llm = LLM(path, device=DEV, attention="triton", kv_cache_tokens=2048, page_size=4)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert seen and max(items for items, _ in seen) >= 2  # stem + per-prompt nodes: nested sharing
    assert max(units for _, units in seen) >= (4 if options else 2)
    for a, b in zip(got, want, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            for ra, rb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert ra.keys() == rb.keys() and all(abs(ra[t] - rb[t]) < 1e-4 for t in ra)


def test_engine_triton_takes_windows_and_soft_caps(tiny_models, monkeypatch, tk):
    """The tiny llama's first layer sliding (W = 6) and soft-capped, its second full: attention="triton"
    gives the CPU path's greedy tokens and logprobs, with a plan per mask (the full layer's and the sliding
    one's, bounded) and each layer's soft-cap."""
    import dataclasses

    from hydragen.attention.layer_spec import AttentionSpec
    from hydragen.model.config import ModelConfig

    real = ModelConfig.from_hf.__func__

    def from_hf(cls, hf):
        cfg = real(cls, hf)
        s = cfg.head_dim**-0.5
        specs = (AttentionSpec(s, window=6, soft_cap=0.8), AttentionSpec(s))
        return dataclasses.replace(cfg, layer_specs=specs)

    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(from_hf))
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    path = tiny_models["llama"]
    want = LLM(path, device=DEV, kv_cache_tokens=2048, page_size=4).generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "plan_options", dict(chunk_tokens=8, block_m=16, tail_split_len=4))
    seen = []
    inner = ModelRunner._triton_attention

    def spy(self, row, q, batch, scale, softcap=None, kind=0):
        seen.append((kind, softcap, batch.tree_plans[kind].window))
        return inner(self, row, q, batch, scale, softcap, kind)

    monkeypatch.setattr(ModelRunner, "_triton_attention", spy)
    llm = LLM(path, device=DEV, attention="triton", kv_cache_tokens=2048, page_size=4)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert set(seen) == {(0, 0.8, 6), (1, None, None)}
    for a, b in zip(got, want, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            for ra, rb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert ra.keys() == rb.keys() and all(abs(ra[t] - rb[t]) < 1e-4 for t in ra)


def test_triton_missing_is_a_clear_error(tiny_models, monkeypatch):
    import hydragen.engine.config as config_mod

    monkeypatch.setattr(config_mod, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        LLM(tiny_models["llama"], attention="triton", kv_cache_tokens=1024)


COMPILE = """
import json, sys, torch
from hydragen.attention.triton_kernels import compile_report
reports = [compile_report(90, torch.bfloat16, 128, 8), compile_report(80, torch.float16, 20, 4)]
reports.append(compile_report(90, torch.bfloat16, 128, 8, window=True, softcap=True))
print(json.dumps(reports))
"""


def test_kernels_compile_for_hopper_and_ampere():
    """Compiled (not interpreted) for sm_90 and sm_80 with Triton's bundled ptxas: no GPU needed (and for
    sm_90 with the window and soft-cap switches on)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", COMPILE]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    hopper, ampere, windowed = json.loads(run.stdout.strip().splitlines()[-1])
    assert hopper["shared"]["mma"] == "wgmma" and hopper["tail"]["mma"] == "mma"  # tensor cores
    assert ampere["shared"]["mma"] == "mma" and ampere["tail"]["mma"] == "mma"
    assert windowed["shared"]["mma"] == "wgmma" and windowed["tail"]["mma"] == "mma"  # window and soft-cap on
    assert all(k["shared"] <= 160 * 1024 for r in (hopper, ampere, windowed) for k in r.values())


# ---- real shapes, CUDA only ----------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("tail_split_len", [None, 128])
def test_real_shapes_tree_decode(tk, tail_split_len):
    """The paper's shape: Hq=8, Hkv=1, D=128, a 4096-token prefix shared by 64 sequences, bf16."""
    hq, hkv, d, b, prefix = 8, 1, 128, 64, 4096
    dtype = torch.bfloat16
    k, v = make_pool(prefix + 64 + b * 256, hkv, d, dtype)
    items = [(0, prefix, 0, b), (prefix, prefix + 64, 0, b // 2)]  # plus a nested node over half the batch
    lengths = torch.randint(0, 256, (b,)).tolist()
    pages, tails = paged_tails(lengths, prefix + 64, prefix + 64 + b * 256, 16)
    lens = torch.tensor(lengths, device=DEV)
    plan = build_tree_plan(
        items, pages, 16, group=hq // hkv, num_kv_heads=hkv, tail_cap=256, tail_split_len=tail_split_len
    )
    q = torch.randn(b, hq, d, device=DEV).to(dtype)
    out, lse = tk.tree_decode_attention(q, k, v, plan, lens, d**-0.5, return_lse=True)
    runs = [[(s, e) for s, e, i, j in items if i <= x < j] + tails[x] for x in range(b)]
    check(out, lse, *reference(q, k, v, runs, d**-0.5), dtype)


@cuda_only
def test_real_shapes_tail_kernel(tk):
    hq, hkv, d, b = 8, 1, 128, 64
    k, v = make_pool(b * 512, hkv, d, torch.bfloat16)
    lengths = [0] + torch.randint(0, 512, (b - 1,)).tolist()
    pages, runs = paged_tails(lengths, 0, b * 512, 16)
    q = torch.randn(b, hq, d, device=DEV).to(torch.bfloat16)
    out, lse = tk.tail_attention(q, k, v, pages, 16, torch.tensor(lengths, device=DEV), d**-0.5)
    check(out[:, 0], lse[:, 0], *reference(q, k, v, runs, d**-0.5), torch.bfloat16)
