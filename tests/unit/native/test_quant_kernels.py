"""The quantized-matmul ops against their twin (hydragen/model/quant_twin.py): every GGUF type hydragen
computes in, on every instruction-set path this CPU has (HYDRAGEN_QUANT_ISA's levels), every batch shape
the kernels treat differently (1-4 rows per call, 64-row tasks, partial 16-row tiles), and each fused
prologue and epilogue."""

from __future__ import annotations

import contextlib
import sys

import gguf
import numpy as np
import pytest
import torch

from hydragen.model.gguf_quantize import quantize, random_blocks
from hydragen.model.qtensor import PACKED_TYPES, QuantTensor
from hydragen.model.quant_twin import quant_linear_reference, quantize_activations
from hydragen.native import build as cpp_build
from hydragen.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")

Q = gguf.GGMLQuantizationType
ALL = PACKED_TYPES + (Q.F16, Q.BF16, Q.F32)
# The paths this CPU can run: the best it has and every level below.
ISAS = [
    level
    for name, level in quant.ISA_LEVELS.items()
    if quant.available() and level <= quant.ISA_LEVELS[quant.isa_name(0)]
]


def _tensor(qtype, rows, cols, seed=0, std=0.5) -> QuantTensor:
    rng = np.random.default_rng(seed)
    data = random_blocks(qtype, rows, cols, std, rng)
    return QuantTensor(int(qtype), torch.from_numpy(data), cols)


def _cols(qtype, blocks=3) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0] * blocks if qtype in PACKED_TYPES else 96 * blocks + 5


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _close(got, want, x, parts, bits=15):
    """Within float32 summation error of the magnitudes involved: |got - want| <= 1e-5 * (|x| @ |W|^T)."""
    xa = (quantize_activations(x, bits) if parts[0].qtype in PACKED_TYPES else x).abs().double()
    mag = torch.cat([xa @ p.dequantize().abs().double().T for p in parts], dim=1)
    err = (got.double() - want.double()).abs()
    assert (err <= 1e-5 * mag + 1e-6).all(), float((err / (mag + 1e-30)).max())


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_packed_rows_read_back_as_the_gguf_package_dequantizes(qtype) -> None:
    t = _tensor(qtype, 37, _cols(qtype))
    packed = quant.pack(t.data, t.qtype)
    got = quant.rows(packed, t.qtype, t.cols, torch.arange(37))
    assert torch.equal(got, t.dequantize())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_stacked_parts_pack_as_their_concatenation(qtype) -> None:
    """A load packs q/k/v or gate/up from where each part lies in the file (no stacked copy first): parts of
    any row count (a tile shared across their boundary), and a column slice's strided rows, pack as the
    stacked copy does."""
    a, b, c = (_tensor(qtype, rows, _cols(qtype), seed=rows) for rows in (21, 6, 37))
    stacked = quant.pack(torch.cat([a.data, b.data]), qtype)
    assert torch.equal(quant.pack_stacked([a.data, b.data], qtype), stacked)
    cols = 2 * _cols(qtype) // 3
    strided, part = c.col_slice(0, cols).data, a.col_slice(0, cols).data
    assert not strided.is_contiguous()
    want = quant.pack(torch.cat([strided.contiguous(), part.contiguous()]), qtype)
    assert torch.equal(quant.pack_stacked([strided, part], qtype), want)
    with pytest.raises(RuntimeError, match="cannot be stacked"):
        quant.pack_stacked([a.data, strided], qtype)


@pytest.mark.parametrize("bits", [15, 8])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: quant.ISA_NAMES[i])
@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 70])
def test_kernel_matches_the_twin(qtype, isa, m, bits) -> None:
    cols = _cols(qtype) if qtype in PACKED_TYPES else 96 * 3 + 5
    t = _tensor(qtype, 37, cols, seed=m)  # 37 rows: two whole 16-row tiles and a partial one
    data = quant.pack(t.data, t.qtype) if qtype in PACKED_TYPES else t.data
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] *= 1e4  # one group at the top of the range: 15-bit integers near their bound
    got = quant.linear(x, [data], [t.qtype], [37], act_bits=bits, isa=isa)
    _close(got, quant_linear_reference(x, [t], act_bits=bits), x, [t], bits)


@pytest.mark.parametrize("bits", [15, 8])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: quant.ISA_NAMES[i])
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_one_row_gives_the_bits_of_that_row_in_a_batch(qtype, isa, bits) -> None:
    """A batch-1 projection runs neighbouring tiles in pairs (one broadcast per activation for both); the
    result must be the same bits as the row computed in a batch, tile by tile, whatever the threads' split
    (5 tiles: pairs, a single full tile, a partial one)."""
    t = _tensor(qtype, 75, _cols(qtype), seed=7)
    data = quant.pack(t.data, t.qtype)
    x = torch.randn(3, t.cols, generator=torch.Generator().manual_seed(7))
    batch = quant.linear(x, [data], [t.qtype], [75], act_bits=bits, isa=isa)
    for threads in (1, 2, 3):
        with _threads(threads):
            for m in range(3):
                one = quant.linear(x[m : m + 1], [data], [t.qtype], [75], act_bits=bits, isa=isa)
                assert torch.equal(one, batch[m : m + 1]), (threads, m)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: quant.ISA_NAMES[i])
def test_mixed_parts_with_norm_rope_and_residual(isa) -> None:
    """q/k/v of three types in one call (Q4_K_M's q/k Q4_K, v Q6_K), RMSNorm before, rotary on q and k."""
    cols, d = 512, 64
    parts = [_tensor(Q.Q4_K, 128, cols, 1), _tensor(Q.Q4_K, 64, cols, 2), _tensor(Q.Q6_K, 64, cols, 3)]
    x = torch.randn(5, cols)
    norm = torch.rand(cols) + 0.5
    pos = torch.arange(5, dtype=torch.float32)[:, None] * torch.rand(d // 2)
    cos = torch.cat([pos, pos], 1).cos()
    sin = torch.cat([-pos.sin(), pos.sin()], 1)
    rope = (cos, sin, 192)
    got = quant.linear(
        x,
        [quant.pack(p.data, p.qtype) for p in parts],
        [p.qtype for p in parts],
        [128, 64, 64],
        norm=norm,
        eps=1e-5,
        rope=rope,
        isa=isa,
    )
    want = quant_linear_reference(x, parts, norm=norm, eps=1e-5, rope=rope)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    residual = torch.randn(5, 256)
    before = residual.clone()
    out = quant.linear(
        x,
        [quant.pack(p.data, p.qtype) for p in parts],
        [p.qtype for p in parts],
        [128, 64, 64],
        residual=residual,
        isa=isa,
    )
    assert out.data_ptr() == residual.data_ptr()
    want = quant_linear_reference(x, parts, residual=before)
    assert torch.allclose(residual, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: quant.ISA_NAMES[i])
def test_swiglu_epilogue(isa) -> None:
    gate_up = _tensor(Q.Q4_1, 96, 128, 4)
    x = torch.randn(3, 128)
    got = quant.linear(
        x, [quant.pack(gate_up.data, gate_up.qtype)], [gate_up.qtype], [96], swiglu=True, isa=isa
    )
    want = quant_linear_reference(x, [gate_up], swiglu=True)
    assert got.shape == (3, 48)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("half", [48, 40, 1536])
def test_swiglu_is_torchs_silu_bit_for_bit(half) -> None:
    """The fused SwiGLU is at::silu(gate) * up exactly (ATen's vector formula, its scalar one for a tail
    that is not a whole number of register pairs), over gate values from far negative to far positive.

    Exact where libtorch runs its kernels at the width the ops were compiled for (its default on the same
    CPU). Where it runs another (ATEN_CPU_CAPABILITY, or ops built with HYDRAGEN_CPP_FLAGS=-mno-avx512f),
    its register pairs end elsewhere, so an element may take the other exp (Sleef's vector expf or the scalar
    std::exp, each within 1 ulp: 2 ulp = 2.4e-7 apart) and the three roundings after it (1 + e, x / (1 + e),
    * up) may each go the other way (2 x 6e-8 apart each): within 1e-6 relative, and 1e-30 absolute where
    exp(-x) overflows on one side only (x / inf = 0 beside x / 3.4e38 ~ 1e-37). Measured with AVX2 ops under
    AVX-512 libtorch: 19 of the 120,176 elements differ (all at half = 48), by at most 2.0e-7 relative."""
    same_width = cpp_build.vec_capability() == torch.backends.cpu.get_cpu_capability()
    gate_up = _tensor(Q.Q8_0, 2 * half, 64, 5, std=4.0)
    packed = quant.pack(gate_up.data, gate_up.qtype)
    for m in (1, 3, 70):
        x = 8 * torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        y = quant.linear(x, [packed], [gate_up.qtype], [2 * half])
        got = quant.linear(x, [packed], [gate_up.qtype], [2 * half], swiglu=True)
        assert y[:, :half].abs().max() > 20  # exp(-x) saturating both ways is in range
        want = torch.nn.functional.silu(y[:, :half]) * y[:, half:]
        if same_width:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_packed_weights_on_huge_pages_are_the_same_bytes(monkeypatch) -> None:
    """The weight arena (native/csrc/weight_arena.h) changes where the tiles live, never what they hold:
    the padding rows of a partial tile stay zero, every tensor starts a cache line, and tensors cut from one
    region stay valid after their neighbours die."""
    ts = [_tensor(q, 37, _cols(q)) for q in (Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q8_0)]
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "0")
    plain = [quant.pack(t.data, t.qtype) for t in ts]
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "1")
    arena = [quant.pack(t.data, t.qtype) for t in ts]
    for a, b in zip(arena, plain, strict=True):
        assert a.data_ptr() % 64 == 0
        assert torch.equal(a, b)
    del arena[:2]
    for t, a in zip(ts[2:], arena, strict=True):
        assert torch.equal(quant.rows(a, t.qtype, t.cols, torch.arange(37)), t.dequantize())
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="HYDRAGEN_HUGE_PAGES='maybe' must be 1 or 0"):
        quant.huge_pages()


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the arena maps regions on Linux only")
def test_a_large_packed_matrix_has_a_mapping_of_its_own(monkeypatch) -> None:
    """From 8 MiB a packed matrix is mapped on its own (weight_arena.h): it starts a 2 MiB page, it does not
    cut the shared region short (the small matrices packed before and after it sit side by side), its bytes
    are plain packing's, and freeing it unmaps it while its small neighbours live."""
    gen = torch.Generator().manual_seed(0)
    big_raw = torch.randint(0, 256, (256, 34 * 1024), dtype=torch.uint8, generator=gen)  # Q8_0, 8.9 MB
    small = _tensor(Q.Q8_0, 16, 64)
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "0")
    plain = quant.pack(big_raw, Q.Q8_0)
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "1")
    before = quant.pack(small.data, small.qtype)
    big = quant.pack(big_raw, Q.Q8_0)
    after = quant.pack(small.data, small.qtype)
    assert torch.equal(big, plain)
    assert big.data_ptr() % (2 << 20) == 0
    assert after.data_ptr() == before.data_ptr() + before.numel()  # 64 bytes a row: already whole lines
    addr = big.data_ptr()
    assert _mapped(addr)
    del big
    assert not _mapped(addr)
    assert torch.equal(after, before)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_packed_weights_are_advised_huge_pages(monkeypatch) -> None:
    """The region a packed matrix is cut from is advised MADV_HUGEPAGE (the "hg" flag of its mapping, which an
    ordinary allocation lacks even under THP "always"): a decode step streaming the weights then walks one TLB
    entry per 2 MiB."""
    monkeypatch.setenv("HYDRAGEN_HUGE_PAGES", "1")
    t = _tensor(Q.Q4_K, 64, 256 * 64)  # 4.5 MB of tiles
    packed = quant.pack(t.data, t.qtype)
    addr = packed.data_ptr()
    eligible = None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                eligible = line.split()[1:]
    if eligible is None:
        pytest.skip("this kernel's smaps has no VmFlags")
    assert "hg" in eligible


@pytest.mark.parametrize("bits", [15, 8])
def test_activation_quantization_is_the_kernels(bits) -> None:
    """Groups of 32 with scale max|x| / QMAX, rounded half to even; an all-zero group stays zero; the 15-bit
    integers' error is 1/16191 of the group's largest value, the int8 ones' 1/127."""
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1.0, 1.0, 32)
    q = quantize_activations(x, bits)
    assert q[0, 32:].eq(0).all()
    step = 1.0 / {15: 16191, 8: 127}[bits]
    assert (q[0, :32] - x[0, :32]).abs().max() <= step / 2 * 1.0001


@pytest.mark.parametrize("bits", [15, 8])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: quant.ISA_NAMES[i])
def test_every_path_quantizes_activations_as_the_twin_bit_for_bit(isa, bits) -> None:
    """Through a Q8_0 identity (each output reads one input's integer times its group's scale, exactly), the
    kernels' activation integers are the twin's on every instruction-set path: random groups, an all-zero
    group, a group with a NaN (ignored by the scale), and ties rounded half to even (a group whose largest
    value is QMAX has scale 1, so k + 0.5 is a tie)."""
    k = 192
    blocks = np.zeros((k, k // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for r in range(k):
        blocks[r, r // 32, 2 + r % 32] = 1
    packed = quant.pack(torch.from_numpy(blocks.reshape(k, -1)), int(Q.Q8_0))
    qmax = {15: 16191.0, 8: 127.0}[bits]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(bits)) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 32:64] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # ties at both signs ...
    x[2, 31] = qmax  # ... with scale 1
    x[3, 64:96] = torch.tensor([-qmax] + [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4 + [-4.5, 4.5, 6.5])
    got = quant.linear(x, [packed], [int(Q.Q8_0)], [k], act_bits=bits, isa=isa)
    assert torch.equal(got, quantize_activations(x, bits))
    x[4, 100] = float("nan")  # its group's scale ignores it; the other groups are untouched
    with_nan = quant.linear(x, [packed], [int(Q.Q8_0)], [k], act_bits=bits, isa=isa)
    keep = torch.ones(k, dtype=torch.bool)
    keep[96:128] = False
    assert torch.equal(with_nan[:4], got[:4]) and torch.equal(with_nan[4, keep], got[4, keep])


def test_the_quantizers_round_trip_within_their_step() -> None:
    """The numpy K-quant writers (model/gguf_quantize.py) give blocks the gguf package reads back close to
    the input: within one quantization step of each sub-block."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    for qtype, levels in ((Q.Q2_K, 3), (Q.Q3_K, 7), (Q.Q4_K, 15), (Q.Q5_K, 31), (Q.Q6_K, 63)):
        back = gguf.quants.dequantize(quantize(x, qtype), qtype).reshape(x.shape)
        sub = 16 if qtype in (Q.Q2_K, Q.Q3_K, Q.Q6_K) else 32
        spread = np.ptp(x.reshape(-1, sub), axis=1).repeat(sub).reshape(x.shape)
        assert (np.abs(back - x) <= spread / levels * 1.6 + 1e-3).all(), qtype.name


def test_isa_cap_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HYDRAGEN_QUANT_ISA", "avx2")
    assert quant.requested_isa() == 2
    monkeypatch.setenv("HYDRAGEN_QUANT_ISA", "avx9000")
    with pytest.raises(ValueError, match="HYDRAGEN_QUANT_ISA='avx9000' is not one of scalar, avx2"):
        quant.requested_isa()


def test_bad_shapes_are_refused() -> None:
    t = _tensor(Q.Q4_0, 16, 64)
    packed = quant.pack(t.data, t.qtype)
    with pytest.raises(RuntimeError, match="wrong shape for 96 columns"):
        quant.linear(torch.randn(1, 96), [packed], [t.qtype], [16])
    with pytest.raises(RuntimeError, match="is not supported"):
        quant.linear(torch.randn(1, 64), [packed], [20], [16])
