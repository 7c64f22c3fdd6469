"""Tests of ``hydragen.attention.shared_prefix_attention`` against a naive float64 oracle.

The oracle below is written independently of ``hydragen.attention.reference_attention``: it walks every
sequence, gathers that sequence's prefix groups and visible suffix keys, and runs a max-subtracted softmax
per query row in float64.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from hydragen.attention import reference_attention, shared_prefix_attention

sp_module = importlib.import_module("hydragen.attention.shared_prefix")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # Hundreds of tiny kernels: intra-op threading only adds overhead (and stalls badly on a busy box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


IMPLS = ["fused", "torch", None]  # None: leave ``impl`` at its default
IMPL_IDS = ["fused", "torch", "default"]


# --------------------------------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------------------------------


def oracle(
    q, prefix_ks, prefix_vs, suffix_k, suffix_v, suffix_lens=None, scale=None, window=None, softcap=None
):
    """Naive float64 attention. Returns (out [B, Nq, Hq, D], lse [B, Nq, Hq]), both float64.

    ``window`` W: keys count positions from 0 through the prefix levels then the suffix; query i of a
    sequence with n valid suffix keys sits at position P + n - Nq + i and sees only keys at positions
    > its position - W. ``softcap`` c: every scaled score s becomes c * tanh(s / c)."""
    b_total, nq, hq, d = q.shape
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.zeros(b_total, nq, hq, d, dtype=torch.float64)
    lse = torch.full((b_total, nq, hq), -math.inf, dtype=torch.float64)
    for b in range(b_total):
        qb = q[b].double().permute(1, 0, 2)  # [Hq, Nq, D]
        scores, values = [], []
        for k, v in zip(prefix_ks, prefix_vs, strict=True):
            group = b // (b_total // k.shape[0])
            heads = torch.arange(hq) // (hq // k.shape[2])  # query head -> kv head
            kb = k[group].double()[:, heads].permute(1, 0, 2)  # [Hq, P, D]
            vb = v[group].double()[:, heads].permute(1, 0, 2)
            scores.append(qb @ kb.transpose(1, 2) * scale)  # [Hq, Nq, P]; every prefix key visible
            values.append(vb)
        if suffix_k is not None:
            s = suffix_k.shape[1]
            n = s if suffix_lens is None else int(suffix_lens[b])
            heads = torch.arange(hq) // (hq // suffix_k.shape[2])
            kb = suffix_k[b].double()[:, heads].permute(1, 0, 2)
            vb = suffix_v[b].double()[:, heads].permute(1, 0, 2)
            sc = qb @ kb.transpose(1, 2) * scale  # [Hq, Nq, S]
            for i in range(nq):
                sc[:, i, max(n - nq + i + 1, 0) :] = -math.inf  # query i sees suffix keys j <= n - nq + i
            scores.append(sc)
            values.append(vb)
        if not scores or sum(x.shape[2] for x in scores) == 0:
            continue  # no keys at all: out 0, lse -inf
        sc = torch.cat(scores, dim=2)  # [Hq, Nq, T]
        vals = torch.cat(values, dim=1)  # [Hq, T, D]
        if softcap is not None:  # the masked suffix keys stay -inf: tanh(-inf) * c would unmask them
            sc = torch.where(torch.isneginf(sc), sc, torch.tanh(sc / softcap) * softcap)
        if window is not None:
            prefix = sum(k.shape[1] for k in prefix_ks)
            n = 0 if suffix_k is None else (suffix_k.shape[1] if suffix_lens is None else int(suffix_lens[b]))
            for i in range(nq):
                position = prefix + n - nq + i
                sc[:, i, : max(0, position - window + 1)] = -math.inf  # keys at positions <= position - W
        mx = sc.amax(dim=2, keepdim=True)  # -inf for a row that sees no key
        blind = torch.isneginf(mx)
        e = torch.exp(sc - torch.where(blind, 0.0, mx))
        total = e.sum(dim=2, keepdim=True)
        row_lse = torch.where(blind, -math.inf, mx + torch.log(total))[..., 0]  # [Hq, Nq]
        row_out = torch.where(blind, 0.0, (e @ vals) / torch.where(blind, 1.0, total))  # [Hq, Nq, D]
        lse[b] = row_lse.T
        out[b] = row_out.permute(1, 0, 2)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Case construction
# --------------------------------------------------------------------------------------------------


def make_case(
    b, nq, hq, hkv, d, levels, s, lens=None, dtype=torch.float32, seed=0, q_mult=1.0, lens_dtype=torch.int64
):
    """levels: list of (G, P); s: suffix length or None (no suffix); lens: list or None."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = (rnd(b, nq, hq, d) * q_mult).to(dtype)
    prefix_ks = [rnd(g, p, hkv, d).to(dtype) for g, p in levels]
    prefix_vs = [rnd(g, p, hkv, d).to(dtype) for g, p in levels]
    suffix_k = suffix_v = None
    if s is not None:
        suffix_k = rnd(b, s, hkv, d).to(dtype)
        suffix_v = rnd(b, s, hkv, d).to(dtype)
    suffix_lens = None if lens is None else torch.tensor(lens, dtype=lens_dtype)
    return dict(
        q=q,
        prefix_ks=prefix_ks,
        prefix_vs=prefix_vs,
        suffix_k=suffix_k,
        suffix_v=suffix_v,
        suffix_lens=suffix_lens,
    )


def run(case, impl, **kwargs):
    if impl is not None:
        kwargs["impl"] = impl
    return shared_prefix_attention(
        case["q"],
        case["prefix_ks"],
        case["prefix_vs"],
        case["suffix_k"],
        case["suffix_v"],
        case["suffix_lens"],
        **kwargs,
    )


def run_oracle(case, scale=None, **kwargs):
    return oracle(
        case["q"],
        case["prefix_ks"],
        case["prefix_vs"],
        case["suffix_k"],
        case["suffix_v"],
        case["suffix_lens"],
        scale=scale,
        **kwargs,
    )


def check_against_oracle(case, impl, atol, rtol, lse_atol=None, lse_rtol=None, scale=None):
    kwargs = {} if scale is None else {"scale": scale}
    out, lse = run(case, impl, return_lse=True, **kwargs)
    ref_out, ref_lse = run_oracle(case, scale=scale)
    q = case["q"]
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    assert lse.dtype == torch.float32
    assert lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isinf(out).any()
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(
        lse.double(),
        ref_lse,
        atol=lse_atol if lse_atol is not None else atol,
        rtol=lse_rtol if lse_rtol is not None else rtol,
    )
    return out, lse


# (id, B, Nq, Hq, Hkv, D, levels [(G, P)], S or None, suffix_lens or None)
CASES = [
    ("mha_noprefix", 2, 3, 4, 4, 16, [], 5, None),
    ("gqa9_3_d40_G1_decode_ragged", 4, 1, 9, 3, 40, [(1, 7)], 6, [6, 3, 0, 1]),
    ("mqa8_1_d72_two_levels", 4, 3, 8, 1, 72, [(1, 5), (2, 3)], 8, [8, 2, 5, 0]),
    ("gqa6_2_d80_three_levels_G1_2_B", 4, 2, 6, 2, 80, [(1, 4), (2, 3), (4, 2)], 4, [4, 1, 0, 3]),
    ("d128_prefill_causal", 2, 5, 4, 2, 128, [(1, 3)], 5, None),
    ("d17_prefill_ragged", 3, 4, 3, 1, 17, [(3, 2)], 4, [4, 2, 0]),
    ("suffix_none", 4, 2, 4, 2, 16, [(1, 5), (4, 3)], None, None),
    ("suffix_none_one_level", 2, 3, 9, 3, 17, [(2, 6)], None, None),
    ("s0", 2, 1, 4, 2, 16, [(1, 4)], 0, None),
    ("s0_lens0", 2, 2, 4, 2, 16, [(1, 4), (2, 2)], 0, [0, 0]),
    ("nq_gt_lens", 3, 4, 6, 3, 24, [(1, 3)], 6, [2, 6, 1]),
    ("lens_none_nq_lt_s", 2, 3, 4, 4, 32, [(1, 2)], 7, None),
    ("lens_none_nq_gt_s", 2, 5, 4, 2, 16, [(2, 3)], 3, None),
    ("decode_lens_none", 3, 1, 8, 1, 40, [(1, 4), (3, 2)], 5, None),
    ("empty_middle_level", 4, 2, 6, 3, 20, [(1, 4), (2, 0), (4, 3)], 3, [3, 0, 2, 1]),
    ("empty_first_level", 2, 1, 4, 1, 16, [(1, 0), (2, 5)], 4, [4, 2]),
    ("inner_coarser_levels", 4, 3, 4, 2, 16, [(4, 2), (2, 5), (1, 3)], 5, [5, 3, 4, 0]),
    ("b6_G1_3_6", 6, 2, 9, 3, 8, [(1, 3), (3, 2), (6, 1)], 3, [3, 0, 1, 2, 3, 2]),
    ("b1_tiny", 1, 1, 1, 1, 8, [(1, 2)], 1, None),
    ("nq_eq_s_ragged_mqa", 2, 6, 8, 1, 16, [(1, 4), (2, 2)], 6, [3, 6]),
    ("prefix_only_decode", 8, 1, 4, 2, 16, [(1, 9), (2, 3), (8, 1)], None, None),
]
CASE_IDS = [c[0] for c in CASES]


def case_from(spec, **kwargs):
    _, b, nq, hq, hkv, d, levels, s, lens = spec
    return make_case(b, nq, hq, hkv, d, levels, s, lens, **kwargs)


# --------------------------------------------------------------------------------------------------
# Correctness against the oracle
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_fp32_matches_oracle(spec, impl):
    check_against_oracle(case_from(spec, seed=CASE_IDS.index(spec[0])), impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_return_lse_false_returns_same_output(spec, impl):
    case = case_from(spec, seed=3)
    out = run(case, impl)
    assert isinstance(out, torch.Tensor)
    out2, _ = run(case, impl, return_lse=True)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


LOW_PRECISION_CASES = [
    c
    for c in CASES
    if c[0]
    in {
        "mha_noprefix",
        "gqa9_3_d40_G1_decode_ragged",
        "mqa8_1_d72_two_levels",
        "gqa6_2_d80_three_levels_G1_2_B",
        "d128_prefill_causal",
        "d17_prefill_ragged",
        "suffix_none",
        "nq_gt_lens",
        "lens_none_nq_lt_s",
        "empty_middle_level",
        "s0",
    }
]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOW_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("spec", LOW_PRECISION_CASES, ids=[c[0] for c in LOW_PRECISION_CASES])
def test_low_precision_matches_oracle(spec, dtype, impl):
    # The oracle sees the same (rounded) inputs, upcast to float64; the remaining error is the kernel's
    # internal rounding plus the final rounding of the output to ``dtype``.
    tol = LOW_TOL[dtype]
    check_against_oracle(case_from(spec, dtype=dtype, seed=7), impl, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("scale", [0.3, 1.0, 2])
def test_explicit_scale(scale, impl):
    case = make_case(4, 3, 6, 2, 24, [(1, 5), (2, 2)], 6, [6, 4, 0, 2], seed=11)
    check_against_oracle(case, impl, atol=1e-5, rtol=1e-5, scale=scale)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_default_scale_is_inverse_sqrt_head_dim(impl):
    case = make_case(2, 3, 4, 2, 40, [(1, 5)], 4, [4, 1], seed=12)
    out_default, lse_default = run(case, impl, return_lse=True)
    out_explicit, lse_explicit = run(case, impl, return_lse=True, scale=40**-0.5)
    torch.testing.assert_close(out_default, out_explicit, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_default, lse_explicit, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64, torch.int16], ids=["i32", "i64", "i16"])
def test_suffix_lens_integer_dtypes(lens_dtype, impl):
    case = make_case(3, 2, 4, 2, 16, [(1, 3)], 5, [5, 1, 0], lens_dtype=lens_dtype, seed=13)
    check_against_oracle(case, impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_different_kv_heads_per_level(impl):
    # Each level only has to satisfy "Hq is a multiple of Hkv" on its own.
    gen = torch.Generator().manual_seed(14)
    b, nq, hq, d = 4, 2, 6, 16
    case = dict(
        q=torch.randn(b, nq, hq, d, generator=gen),
        prefix_ks=[torch.randn(1, 4, 1, d, generator=gen), torch.randn(2, 3, 3, d, generator=gen)],
        prefix_vs=[torch.randn(1, 4, 1, d, generator=gen), torch.randn(2, 3, 3, d, generator=gen)],
        suffix_k=torch.randn(b, 3, 2, d, generator=gen),
        suffix_v=torch.randn(b, 3, 2, d, generator=gen),
        suffix_lens=torch.tensor([3, 2, 1, 0]),
    )
    check_against_oracle(case, impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("nq", [1, 3])
def test_non_contiguous_inputs(nq, impl):
    # Same values, different memory layouts: q with strided heads, k/v stored head-major.
    case = make_case(4, nq, 6, 2, 16, [(1, 5), (2, 3)], 5, [5, 2, 0, 4], seed=20)
    ref = run(case, impl, return_lse=True)

    def head_major(x):  # [N, L, H, D] stored as [N, H, L, D]
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    q_wide = torch.zeros(4, nq, 12, 16)
    q_wide[:, :, ::2] = case["q"]
    strided = dict(
        q=q_wide[:, :, ::2],
        prefix_ks=[head_major(k) for k in case["prefix_ks"]],
        prefix_vs=[head_major(v) for v in case["prefix_vs"]],
        suffix_k=head_major(case["suffix_k"]),
        suffix_v=case["suffix_v"].transpose(0, 1).contiguous().transpose(0, 1),
        suffix_lens=case["suffix_lens"],
    )
    assert not strided["q"].is_contiguous() and not strided["suffix_k"].is_contiguous()
    out, lse = run(strided, impl, return_lse=True)
    torch.testing.assert_close(out, ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref[1], atol=1e-6, rtol=1e-6)
    check_against_oracle(strided, impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", CASES[:8], ids=CASE_IDS[:8])
def test_oracle_agrees_with_package_reference(spec):
    case = case_from(spec, seed=21)
    ref_out, ref_lse = reference_attention(
        case["q"],
        case["prefix_ks"],
        case["prefix_vs"],
        case["suffix_k"],
        case["suffix_v"],
        case["suffix_lens"],
    )
    my_out, my_lse = run_oracle(case)
    torch.testing.assert_close(ref_out, my_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ref_lse, my_lse, atol=1e-10, rtol=1e-10)


def test_oracle_sanity_single_key():
    # One visible key: softmax weight 1, output = v, lse = score.
    q = torch.tensor([[[[1.0, 2.0]]]])
    k = torch.tensor([[[[3.0, -1.0]]]])
    v = torch.tensor([[[[5.0, 7.0]]]])
    out, lse = oracle(q, [k], [v], None, None)
    torch.testing.assert_close(out, v.double())
    torch.testing.assert_close(lse, torch.tensor([[[1.0 * 2**-0.5]]], dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# Large logits
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("q_mult", [50.0, 100.0])
@pytest.mark.parametrize(
    "spec",
    [CASES[2], CASES[3], CASES[10], CASES[6]],
    ids=[CASES[2][0], CASES[3][0], CASES[10][0], CASES[6][0]],
)
def test_large_logits_fp32(spec, q_mult, impl):
    case = case_from(spec, seed=5, q_mult=q_mult)
    _, ref_lse = run_oracle(case)
    assert ref_lse[torch.isfinite(ref_lse)].max() > 89  # exp would overflow fp32 without max-subtraction
    # Logits of a few hundred carry fp32 absolute rounding of ~1e-5 each, hence the wider tolerance.
    check_against_oracle(case, impl, atol=1e-4, rtol=1e-4, lse_atol=1e-3, lse_rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("spec", [CASES[2], CASES[3]], ids=[CASES[2][0], CASES[3][0]])
def test_large_logits_low_precision(spec, dtype, impl):
    case = case_from(spec, seed=6, q_mult=30.0, dtype=dtype)
    _, ref_lse = run_oracle(case)
    assert ref_lse[torch.isfinite(ref_lse)].max() > 12  # exp would overflow fp16
    tol = LOW_TOL[dtype]
    out, lse = check_against_oracle(case, impl, atol=tol, rtol=tol, lse_atol=0.5, lse_rtol=tol)
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------
# Merging: empty levels, order independence, splitting levels
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("empty_g", [1, 2, 4])
@pytest.mark.parametrize("suffix", ["ragged", "none"])
def test_empty_level_is_exact_identity(suffix, empty_g, position, dtype, impl):
    b, nq, hq, hkv, d = 4, 2, 6, 3, 16
    s, lens = (4, [4, 0, 1, 3]) if suffix == "ragged" else (None, None)
    case = make_case(b, nq, hq, hkv, d, [(1, 5), (2, 3)], s, lens, dtype=dtype, seed=8)
    out, lse = run(case, impl, return_lse=True)
    empty = torch.zeros(empty_g, 0, hkv, d, dtype=dtype)
    with_empty = dict(case)
    with_empty["prefix_ks"] = list(case["prefix_ks"])
    with_empty["prefix_vs"] = list(case["prefix_vs"])
    with_empty["prefix_ks"].insert(position, empty)
    with_empty["prefix_vs"].insert(position, empty.clone())
    out_e, lse_e = run(with_empty, impl, return_lse=True)
    assert torch.equal(out, out_e)
    assert torch.equal(lse, lse_e)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_all_levels_empty_equals_suffix_only(impl):
    case = make_case(2, 3, 4, 2, 16, [(1, 0), (2, 0)], 4, [4, 2], seed=9)
    out, lse = run(case, impl, return_lse=True)
    bare = dict(case, prefix_ks=[], prefix_vs=[])
    out_b, lse_b = run(bare, impl, return_lse=True)
    assert torch.equal(out, out_b)
    assert torch.equal(lse, lse_b)
    check_against_oracle(case, impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("split", [1, 3, 6])
def test_split_level_matches_single_level(split, g, impl):
    b, nq, hq, hkv, d, p = 4, 3, 6, 2, 24, 7
    case = make_case(b, nq, hq, hkv, d, [(g, p)], 5, [5, 2, 0, 4], seed=10 + split)
    k, v = case["prefix_ks"][0], case["prefix_vs"][0]
    out, lse = run(case, impl, return_lse=True)
    pieces_k, pieces_v = [k[:, :split], k[:, split:]], [v[:, :split], v[:, split:]]
    for order in ([0, 1], [1, 0]):
        split_case = dict(
            case, prefix_ks=[pieces_k[i] for i in order], prefix_vs=[pieces_v[i] for i in order]
        )
        out_s, lse_s = run(split_case, impl, return_lse=True)
        torch.testing.assert_close(out_s, out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse_s, lse, atol=1e-5, rtol=1e-5)
    check_against_oracle(case, impl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_level_order_independent(impl):
    case = make_case(4, 2, 6, 3, 16, [(1, 4), (2, 3), (4, 2)], 3, [3, 1, 0, 2], seed=15)
    out, lse = run(case, impl, return_lse=True)
    for perm in ([2, 1, 0], [1, 0, 2], [0, 2, 1]):
        permuted = dict(
            case,
            prefix_ks=[case["prefix_ks"][i] for i in perm],
            prefix_vs=[case["prefix_vs"][i] for i in perm],
        )
        out_p, lse_p = run(permuted, impl, return_lse=True)
        torch.testing.assert_close(out_p, out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse_p, lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_prefix_level_equals_prefix_moved_into_suffix(impl):
    # A G=B prefix level is just a private prefix: moving it into the front of a full suffix with Nq=1
    # (which sees every suffix key) gives the same attention.
    b, hq, hkv, d = 3, 4, 2, 16
    case = make_case(b, 1, hq, hkv, d, [(1, 3), (b, 4)], 2, None, seed=16)
    out, lse = run(case, impl, return_lse=True)
    merged = dict(
        case,
        prefix_ks=case["prefix_ks"][:1],
        prefix_vs=case["prefix_vs"][:1],
        suffix_k=torch.cat([case["prefix_ks"][1], case["suffix_k"]], 1),
        suffix_v=torch.cat([case["prefix_vs"][1], case["suffix_v"]], 1),
    )
    out_m, lse_m = run(merged, impl, return_lse=True)
    torch.testing.assert_close(out_m, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_m, lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_batch_rows_independent(impl):
    # Each sequence's result depends only on its own queries, groups and suffix: running a single
    # sequence (with its groups sliced out) gives that sequence's row of the batched result.
    case = make_case(4, 3, 6, 2, 16, [(1, 4), (2, 3), (4, 2)], 5, [5, 2, 0, 4], seed=17)
    out, lse = run(case, impl, return_lse=True)
    for bi in range(4):
        single = dict(
            q=case["q"][bi : bi + 1],
            prefix_ks=[k[bi // (4 // k.shape[0])][None] for k in case["prefix_ks"]],
            prefix_vs=[v[bi // (4 // v.shape[0])][None] for v in case["prefix_vs"]],
            suffix_k=case["suffix_k"][bi : bi + 1],
            suffix_v=case["suffix_v"][bi : bi + 1],
            suffix_lens=case["suffix_lens"][bi : bi + 1],
        )
        out_1, lse_1 = run(single, impl, return_lse=True)
        torch.testing.assert_close(out_1[0], out[bi], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse_1[0], lse[bi], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Inter-sequence batching: one kernel call per non-empty level, prefix never expanded
# --------------------------------------------------------------------------------------------------


class CallRecorder:
    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __call__(self, q, k, v, *args, **kwargs):
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), k.numel()))
        return self.fn(q, k, v, *args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("b", [2, 4, 8])
def test_each_level_read_once_independent_of_batch(b, nq, impl, monkeypatch):
    hq, hkv, d = 6, 2, 16
    levels = [(1, 6), (2, 0), (2, 3), (1, 4)]
    lens = [(3 * i) % 6 for i in range(b)]
    case = make_case(b, nq, hq, hkv, d, levels, 5, lens, seed=18)
    recorder = CallRecorder(sp_module.partial_attention)
    monkeypatch.setattr(sp_module, "partial_attention", recorder)
    out, lse = run(case, impl, return_lse=True)
    non_empty = [(g, p) for g, p in levels if p]
    # One call per non-empty level plus one for the suffix, whatever B is.
    assert len(recorder.calls) == len(non_empty) + 1
    # Each level's call gets k/v with first dim G (never B copies) and no more elements than the level;
    # the group's queries are folded into that call's rows (q's first dim is G too).
    expected = sorted([(g, g * p * hkv * d) for g, p in non_empty] + [(b, b * 5 * hkv * d)])
    assert sorted((c[1][0], c[3]) for c in recorder.calls) == expected
    for q_shape, k_shape, v_shape, _ in recorder.calls:
        assert v_shape == k_shape
        assert q_shape[0] == k_shape[0]
        assert math.prod(q_shape) == b * nq * hq * d
    torch.testing.assert_close(out.double(), run_oracle(case)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_call_count_without_suffix(impl, monkeypatch):
    case = make_case(8, 1, 4, 2, 16, [(1, 6), (4, 2), (8, 0)], None, None, seed=19)
    recorder = CallRecorder(sp_module.partial_attention)
    monkeypatch.setattr(sp_module, "partial_attention", recorder)
    run(case, impl)
    assert len(recorder.calls) == 2
    assert [c[1][0] for c in recorder.calls] == [1, 4]


# --------------------------------------------------------------------------------------------------
# Queries that see no key
# --------------------------------------------------------------------------------------------------


def _blind_cases():
    return {
        # No prefix, some sequences with suffix_lens 0 and early queries beyond suffix_lens.
        "ragged_suffix": make_case(3, 3, 4, 2, 16, [], 4, [0, 1, 4]),
        "ragged_suffix_empty_levels": make_case(3, 3, 4, 2, 16, [(1, 0), (3, 0)], 4, [0, 1, 4]),
        "decode_len0": make_case(3, 1, 9, 3, 17, [], 5, [0, 3, 0]),
        "lens_none_nq_gt_s": make_case(2, 4, 4, 4, 8, [], 2, None),
        "no_keys_at_all": make_case(2, 2, 4, 2, 16, [(1, 0)], None, None),
        "no_keys_s0": make_case(2, 2, 4, 2, 16, [], 0, None),
    }


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(_blind_cases()))
def test_query_seeing_no_key(name, dtype, impl):
    case = _blind_cases()[name]
    case = {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in case.items()
    }
    case["prefix_ks"] = [k.to(dtype) for k in case["prefix_ks"]]
    case["prefix_vs"] = [v.to(dtype) for v in case["prefix_vs"]]
    out, lse = run(case, impl, return_lse=True)
    ref_out, ref_lse = run_oracle(case)
    blind = torch.isneginf(ref_lse)
    assert blind.any()
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[blind]).all()
    assert (out[blind] == 0).all()
    assert torch.isfinite(lse[~blind]).all()
    tol = 1e-5 if dtype == torch.float32 else LOW_TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _t(*shape):
    return torch.zeros(*shape)


B, NQ, HQ, HKV, D, S = 4, 2, 6, 2, 8, 3


def _valid():
    return dict(
        q=_t(B, NQ, HQ, D),
        prefix_ks=[_t(1, 3, HKV, D), _t(2, 2, HKV, D)],
        prefix_vs=[_t(1, 3, HKV, D), _t(2, 2, HKV, D)],
        suffix_k=_t(B, S, HKV, D),
        suffix_v=_t(B, S, HKV, D),
        suffix_lens=torch.tensor([3, 2, 1, 0]),
    )


INVALID = {
    "G_not_dividing_B": dict(prefix_ks=[_t(3, 3, HKV, D)], prefix_vs=[_t(3, 3, HKV, D)]),
    "G_zero": dict(prefix_ks=[_t(0, 3, HKV, D)], prefix_vs=[_t(0, 3, HKV, D)]),
    "G_greater_than_B": dict(prefix_ks=[_t(8, 3, HKV, D)], prefix_vs=[_t(8, 3, HKV, D)]),
    "empty_level_G_not_dividing_B": dict(prefix_ks=[_t(3, 0, HKV, D)], prefix_vs=[_t(3, 0, HKV, D)]),
    "prefix_hq_not_multiple_of_hkv": dict(prefix_ks=[_t(1, 3, 4, D)], prefix_vs=[_t(1, 3, 4, D)]),
    "suffix_hq_not_multiple_of_hkv": dict(suffix_k=_t(B, S, 4, D), suffix_v=_t(B, S, 4, D)),
    "prefix_head_dim_mismatch": dict(prefix_ks=[_t(1, 3, HKV, D + 1)], prefix_vs=[_t(1, 3, HKV, D + 1)]),
    "suffix_head_dim_mismatch": dict(suffix_k=_t(B, S, HKV, 16), suffix_v=_t(B, S, HKV, 16)),
    "prefix_kv_shape_mismatch_len": dict(prefix_ks=[_t(1, 3, HKV, D)], prefix_vs=[_t(1, 4, HKV, D)]),
    "prefix_kv_shape_mismatch_heads": dict(prefix_ks=[_t(1, 3, HKV, D)], prefix_vs=[_t(1, 3, 1, D)]),
    "prefix_kv_shape_mismatch_groups": dict(prefix_ks=[_t(1, 3, HKV, D)], prefix_vs=[_t(2, 3, HKV, D)]),
    "prefix_v_head_dim_mismatch": dict(prefix_ks=[_t(1, 3, HKV, D)], prefix_vs=[_t(1, 3, HKV, 16)]),
    "suffix_kv_shape_mismatch": dict(suffix_k=_t(B, S, HKV, D), suffix_v=_t(B, S + 1, HKV, D)),
    "suffix_batch_mismatch": dict(
        suffix_k=_t(2, S, HKV, D), suffix_v=_t(2, S, HKV, D), suffix_lens=torch.tensor([3, 2])
    ),
    "suffix_v_missing": dict(suffix_v=None),
    "suffix_k_missing": dict(suffix_k=None),
    "prefix_level_count_mismatch": dict(prefix_vs=[_t(1, 3, HKV, D)]),
    "suffix_lens_too_large": dict(suffix_lens=torch.tensor([3, 4, 1, 0])),
    "suffix_lens_negative": dict(suffix_lens=torch.tensor([3, -1, 1, 0])),
    "suffix_lens_wrong_length": dict(suffix_lens=torch.tensor([3, 2, 1])),
    "suffix_lens_2d": dict(suffix_lens=torch.tensor([[3, 2, 1, 0]])),
    "suffix_lens_scalar": dict(suffix_lens=torch.tensor(2)),
    "suffix_lens_float": dict(suffix_lens=torch.tensor([3.0, 2.0, 1.0, 0.0])),
    "suffix_lens_bool": dict(suffix_lens=torch.tensor([True, True, False, True])),
    "suffix_lens_complex": dict(suffix_lens=torch.tensor([3, 2, 1, 0], dtype=torch.complex64)),
    "q_3d": dict(q=_t(B, HQ, D)),
    "prefix_k_3d": dict(prefix_ks=[_t(3, HKV, D)], prefix_vs=[_t(3, HKV, D)]),
}


def test_valid_baseline_does_not_raise():
    v = _valid()
    shared_prefix_attention(
        v["q"], v["prefix_ks"], v["prefix_vs"], v["suffix_k"], v["suffix_v"], v["suffix_lens"]
    )


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_inputs_raise_value_error(name, impl):
    args = _valid()
    args.update(INVALID[name])
    with pytest.raises(ValueError):
        run(args, impl)


@pytest.mark.parametrize("impl", ["fused", "torch", "auto"])
@pytest.mark.parametrize("shape", [(2, 0, 6, 16), (0, 1, 6, 16)])
def test_empty_queries_return_empty(impl, shape):
    k = [torch.randn(1, 3, 2, 16)]
    suffix = torch.randn(shape[0], 2, 2, 16)
    out, lse = shared_prefix_attention(torch.zeros(shape), k, k, suffix, suffix, impl=impl, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:3]


# --------------------------------------------------------------------------------------------------
# Sliding windows and soft-capping
# --------------------------------------------------------------------------------------------------

# (window, softcap): windows smaller than one key level, straddling levels, covering everything; a soft-cap
# alone and with a window
WINDOW_CAPS = [(1, None), (2, None), (4, None), (9, None), (1000, None), (None, 2.0), (3, 2.0), (1000, 2.0)]


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("window,softcap", WINDOW_CAPS)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_window_and_softcap_match_oracle(spec, window, softcap, impl):
    """Every shape of the contract (levels, ragged and causal suffixes, no suffix, empty levels, GQA) with
    a window and/or a soft-cap, against the oracle's explicit positions; large logits, so the cap bites."""
    case = case_from(spec, seed=CASE_IDS.index(spec[0]), q_mult=3.0)
    out, lse = run(case, impl, return_lse=True, window=window, softcap=softcap)
    ref_out, ref_lse = run_oracle(case, window=window, softcap=softcap)
    assert out.dtype == case["q"].dtype and not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    if softcap is not None:  # the cap changes the result
        plain = run_oracle(case, window=window)[0]
        assert (plain - ref_out).abs().max() > 1e-3


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_window_and_softcap_low_precision(dtype, impl):
    case = case_from(CASES[3], seed=7, dtype=dtype)
    out = run(case, impl, window=5, softcap=1.5)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), run_oracle(case, window=5, softcap=1.5)[0], atol=tol, rtol=tol)


def test_window_agrees_with_package_reference():
    for spec in CASES[:8]:
        case = case_from(spec, seed=3, q_mult=2.0)
        mine = run_oracle(case, window=3, softcap=1.5)
        theirs = reference_attention(
            case["q"], case["prefix_ks"], case["prefix_vs"], case["suffix_k"], case["suffix_v"],
            case["suffix_lens"], window=3, softcap=1.5,
        )  # fmt: skip
        torch.testing.assert_close(mine[0], theirs[0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(mine[1], theirs[1], atol=1e-12, rtol=1e-12)


def test_window_is_the_last_w_positions_as_transformers_counts_them():
    """A query at position p sees keys at positions p - W + 1 .. p (transformers' sliding_window_overlay,
    ``kv_idx > q_idx - sliding_window``): W = 1 is the query's own key, and a key's value comes through
    exactly when it is in the window."""
    d, b, nq, s = 4, 1, 6, 6
    q = torch.zeros(b, nq, 1, d)  # equal scores: the output is the mean of the visible values
    k = torch.zeros(b, s, 1, d)
    v = torch.arange(s, dtype=torch.float32).view(1, s, 1, 1).expand(b, s, 1, d).contiguous()
    for w in (1, 2, 3, 6):
        out = shared_prefix_attention(q, [], [], k, v, window=w)
        for i in range(nq):
            seen = [j for j in range(s) if i - w < j <= i]
            assert out[0, i, 0, 0].item() == pytest.approx(sum(seen) / len(seen))


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_levels_out_of_every_window_are_not_read(impl, monkeypatch):
    """A level wholly before every query's window costs no call; a level the window enters is read from
    the first key any query sees, once for the whole batch; the suffix likewise."""
    b, nq, hq, hkv, d = 4, 2, 4, 2, 16
    levels = [(1, 40), (2, 12), (4, 3)]  # positions 0..39, 40..51, 52..54; suffix from 55
    case = make_case(b, nq, hq, hkv, d, levels, 6, [6, 5, 6, 4], seed=21)
    recorder = CallRecorder(sp_module.partial_attention)
    monkeypatch.setattr(sp_module, "partial_attention", recorder)
    out = run(case, impl, window=8)
    # queries sit at positions 57 .. 60: the first any sees is 57 - 8 + 1 = 50
    keys = sorted((c[1][0], c[1][2]) for c in recorder.calls)  # (groups or batch, keys) per call
    assert keys == [(2, 2), (4, 3), (4, 6)]  # level 1 from position 50; level 2 whole; the suffix whole
    torch.testing.assert_close(out.double(), run_oracle(case, window=8)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_bad_window_is_refused(bad):
    k = [torch.randn(1, 3, 2, 16)]
    with pytest.raises(ValueError, match="window"):
        shared_prefix_attention(torch.zeros(2, 1, 6, 16), k, k, None, None, window=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "2"])
def test_bad_softcap_is_refused(bad):
    k = [torch.randn(1, 3, 2, 16)]
    with pytest.raises(ValueError, match="softcap"):
        shared_prefix_attention(torch.zeros(2, 1, 6, 16), k, k, None, None, softcap=bad)


def test_unknown_impl_rejected():
    k = [torch.randn(1, 3, 2, 16)]
    with pytest.raises(ValueError, match="impl"):
        shared_prefix_attention(torch.zeros(2, 1, 6, 16), k, k, None, None, impl="bogus")
