"""Models kept in their file's format: a tiny Llama GGUF written by the tests in every type hydragen
computes in (and as llama.cpp's Q4_K_M mix), loaded compact and checked against the same model run through
the pure-torch twin (hydragen/model/quant_twin.py) and against the float32-dequantized model; the Q4_K_M
layout rules; 16-bit Hugging Face checkpoints staying 16-bit; random-weights GGUFs; memory."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.bench.quant.accuracy import plain_attention
from hydragen.model import decoder, layer_stack
from hydragen.model.config import ModelConfig
from hydragen.model.gguf import read_gguf
from hydragen.model.gguf_write import float_maker, model_types, scheme_type, tensor_shapes, write_gguf
from hydragen.model.linear import DenseProjection, PackedEmbedding, PackedProjection
from hydragen.model.loader import load_model
from hydragen.model.quant_twin import TwinProjection
from hydragen.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
TINY = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=768,  # three 256-blocks: a 2-way split of the down projection is 512 + 256
    num_hidden_layers=2,
    num_attention_heads=8,  # 4 heads x 64 per rank of two: the o projection's 256-blocks split whole
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# One scheme per type (the K-quant schemes' defaults), and the mix people download.
FORMATS = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K_S",
    "Q4_K_S",
    "Q5_K_S",
    "Q6_K",
    "F16",
    "BF16",
    "Q4_K_M",
]


def _tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg):
        out[name] = (
            1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.08 * rng.standard_normal(shape)
        )
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    cfg = ModelConfig.from_hf(TINY)
    weights = _tiny_weights(cfg)
    return {s: write_gguf(root / f"tiny-{s}.gguf", cfg, s, float_maker(weights, cfg)) for s in FORMATS}


def _logits(net, ids: torch.Tensor) -> torch.Tensor:
    return net.logits(net(ids, torch.arange(len(ids)), plain_attention))


def _hook_twins(net, path, monkeypatch) -> list[tuple[str, float, float]]:
    """Every projection of ``net`` checked, on the inputs the model gives it, against its pure-torch twin
    over the file's own blocks (q/k/v with norm and rotary; the fused o + SwiGLU MLP + residuals; the LM
    head; the token table): records (name, largest difference, largest magnitude) per call."""
    _, sd = read_gguf(path, keep=True)
    c = net.cfg
    found = []

    def twin(i: int, *names: str) -> TwinProjection:
        return TwinProjection([sd[f"model.layers.{i}.{n}.weight"] for n in names])

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        found.append((name, float((got - want).abs().max()), float(want.abs().max())))

    def hook(module, reference, name):
        run = module.forward

        def checked(x, **kw):
            before = {"residual": kw["residual"].clone()} if kw.get("residual") is not None else {}
            y = run(x, **kw)
            record(name, y, reference(x, **(kw | before)))
            return y

        module.forward = checked

    for i, layer in enumerate(net.layers):
        hook(layer.qkv, twin(i, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), f"{i}.qkv")
        hook(layer.o, twin(i, "self_attn.o_proj"), f"{i}.o")
        hook(layer.gate_up, twin(i, "mlp.gate_proj", "mlp.up_proj"), f"{i}.gate_up")
        hook(layer.down, twin(i, "mlp.down_proj"), f"{i}.down")
    fused = decoder.mlp_tail

    def checked_tail(o, gate_up, down, attn, h, norm, eps):
        """The fused op against the three projections one by one (each checked by its hook): the same bits."""
        alone = o(attn, residual=h.clone())
        alone = down(gate_up(alone, norm=norm, eps=eps, swiglu=True), residual=alone)
        got = fused(o, gate_up, down, attn, h, norm, eps)
        found.append(("fused o+mlp", float((got - alone).abs().max()), 0.0))
        return got

    monkeypatch.setattr(decoder, "mlp_tail", checked_tail)
    head = "lm_head.weight" if not c.tie_word_embeddings else "model.embed_tokens.weight"
    hook(net.lm_head, TwinProjection([sd[head]]), "lm_head")
    table = sd["model.embed_tokens.weight"].dequantize()
    found.append(
        (
            "embed",
            float((net.embed(torch.arange(c.vocab_size)) - table).abs().max()),
            float(table.abs().max()),
        )
    )
    return found


@pytest.mark.parametrize("scheme", FORMATS)
def test_every_format_stays_compact_and_matches_its_twin(tiny_ggufs, scheme, monkeypatch) -> None:
    path = tiny_ggufs[scheme]
    net, cfg, _ = load_model(path, CPU, torch.float32)
    want = model_types(scheme, cfg)
    layer = net.layers[1]
    assert isinstance(layer.qkv, PackedProjection) and isinstance(net.embed, PackedEmbedding)
    types = {want["blk.1.attn_q.weight"], want["blk.1.attn_v.weight"]}
    assert set(layer.qkv.qtypes) == {int(t) for t in types}
    assert layer.down.qtypes == [int(want["blk.1.ffn_down.weight"])]
    assert net.lm_head.qtypes == [int(want["output.weight"])]
    checks = _hook_twins(net, path, monkeypatch)
    ids = torch.randint(3, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    got = _logits(net, ids)
    assert len(checks) == 5 * cfg.num_layers + 2
    for name, diff, scale in checks:  # float32 rounding apart, with norm, rotary, SwiGLU and residual fused
        assert diff <= 2e-6 * max(scale, 1.0) if scale else diff == 0, (name, diff, scale)
    # and the float32-dequantized model: the same weights, activations not quantized
    exact = _logits(load_model(path, CPU, torch.float32, dequantize=True)[0], ids)
    p, r = torch.log_softmax(got, -1), torch.log_softmax(exact, -1)
    kl = (r.exp() * (r - p)).sum(-1)
    assert kl.mean() < 0.02, kl
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q8_0", "BF16"])
@pytest.mark.parametrize("dequantize", [False, True])
def test_the_head_normalises_the_rows_it_is_handed(tiny_ggufs, scheme, dequantize) -> None:
    """The runner hands the head its sampled rows before the final RMSNorm; the head normalises them in its
    own call (fused into a packed head's kernel). The logits are those of the normalised rows: the same bits
    for a float head (the same ops, on fewer rows), float32 rounding apart for a packed one (the kernel's
    norm)."""
    net, cfg, _ = load_model(tiny_ggufs[scheme], CPU, torch.float32, dequantize=dequantize)
    ids = torch.randint(3, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    raw = net(ids, torch.arange(len(ids)), plain_attention, final_norm=False)
    normed = net(ids, torch.arange(len(ids)), plain_attention)
    assert torch.equal(normed, decoder.rms_norm(raw, net.norm, cfg.rms_norm_eps))
    assert not torch.allclose(raw, normed)
    rows = torch.tensor([0, 7, 22])
    got, want = net.logits(raw[rows], normalized=False), net.logits(normed[rows])
    if dequantize:
        assert torch.equal(got, want)
    else:
        assert isinstance(net.lm_head, PackedProjection)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_q4_k_m_mix_is_llama_quantizes() -> None:
    """llama.cpp's Q4_K_M: Q6_K for attn_v and ffn_down in the first and last eighth of the layers and every
    third between, Q6_K for the output, Q4_K elsewhere; 256-block types fall back on rows of other lengths."""
    more = [
        i for i in range(32) if scheme_type("Q4_K_M", f"blk.{i}.ffn_down.weight", 4096, 32, False) == Q.Q6_K
    ]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert scheme_type("Q4_K_M", "blk.5.attn_v.weight", 4096, 32, False) == Q.Q4_K
    assert scheme_type("Q4_K_M", "blk.5.attn_q.weight", 4096, 32, False) == Q.Q4_K
    assert scheme_type("Q4_K_M", "output.weight", 4096, 32, False) == Q.Q6_K
    assert scheme_type("Q4_K_M", "token_embd.weight", 4096, 32, False) == Q.Q4_K
    assert scheme_type("Q4_K_M", "token_embd.weight", 4096, 32, True) == Q.Q6_K  # tied: the output's type
    assert scheme_type("Q4_K_M", "blk.5.attn_q.weight", 576, 30, False) == Q.Q5_0
    assert scheme_type("Q4_K_M", "output.weight", 576, 30, False) == Q.Q8_0
    assert scheme_type("Q4_K_M", "blk.5.attn_norm.weight", 4096, 32, False) == Q.F32


def test_the_other_mixes_are_llama_quantizes() -> None:
    """llama-quantize's rules beyond Q4_K_M (llama.cpp's src/llama-quant.cpp, no importance matrix): the
    output is Q6_K in the legacy schemes too, Q4_K_S and Q2_K have their own rules, a 70B shape its own."""
    for scheme in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q4_K_S", "Q5_K_S", "Q6_K"):
        assert scheme_type(scheme, "output.weight", 4096, 32, False) == Q.Q6_K, scheme
        assert scheme_type(scheme, "token_embd.weight", 4096, 32, True) == Q.Q6_K, scheme  # tied
    assert scheme_type("Q8_0", "output.weight", 4096, 32, False) == Q.Q8_0
    assert scheme_type("Q4_0", "token_embd.weight", 4096, 32, False) == Q.Q4_0  # untied: the scheme's
    assert scheme_type("Q4_0", "output.weight", 576, 30, False) == Q.Q8_0  # Q6_K does not fit 576-weight rows
    assert scheme_type("F16", "output.weight", 4096, 32, False) == Q.F16

    def where(scheme: str, tensor: str, qtype: Q, layers: int = 32, gqa: int = 1) -> list[int]:
        return [
            i
            for i in range(layers)
            if scheme_type(scheme, f"blk.{i}.{tensor}.weight", 4096, layers, False, gqa) == qtype
        ]

    # Q4_K_S: Q5_K for attn_v in layers 0-3 and ffn_down in the first eighth, Q4_K elsewhere
    assert where("Q4_K_S", "attn_v", Q.Q5_K) == [0, 1, 2, 3]
    assert where("Q4_K_S", "ffn_down", Q.Q5_K) == [0, 1, 2, 3]
    assert where("Q4_K_S", "ffn_down", Q.Q5_K, layers=16) == [0, 1]
    assert where("Q4_K_S", "attn_q", Q.Q4_K) == list(range(32))
    # Q2_K: Q3_K for ffn_down and attn_output; attn_v Q3_K, or Q4_K with >= 4 query heads per KV head
    assert where("Q2_K", "ffn_down", Q.Q3_K) == where("Q2_K", "attn_output", Q.Q3_K) == list(range(32))
    assert where("Q2_K", "attn_v", Q.Q3_K, gqa=2) == where("Q2_K", "attn_v", Q.Q4_K, gqa=4) == list(range(32))
    for tensor in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
        assert where("Q2_K", tensor, Q.Q2_K) == list(range(32))
    # a 70B shape (80 layers, grouped KV heads): attn_v Q5_K where it would be Q3_K or Q4_K
    assert where("Q2_K", "attn_v", Q.Q5_K, layers=80, gqa=8) == list(range(80))
    assert where("Q4_K_S", "attn_v", Q.Q5_K, layers=80, gqa=8) == list(range(80))
    assert where("Q4_K_M", "attn_v", Q.Q5_K, layers=80, gqa=8) == [
        i for i in range(80) if i not in where("Q4_K_M", "attn_v", Q.Q6_K, layers=80, gqa=8)
    ]
    assert where("Q4_K_S", "attn_v", Q.Q5_K, layers=80, gqa=1) == [0, 1, 2, 3]  # 65B: no KV groups
    # rows of 576 (SmolLM2): the 256-weight types fall back, Q4_K_S's Q5_K to Q5_1
    assert scheme_type("Q4_K_S", "blk.0.attn_v.weight", 576, 30, False) == Q.Q5_1
    assert scheme_type("Q2_K", "blk.0.ffn_down.weight", 576, 30, False) == Q.Q4_0


def test_compact_weights_take_the_files_size(tiny_ggufs) -> None:
    """Resident weights are the file's quantized bytes: the repacked tiles of the legacy types and Q6_K/Q2_K
    are exactly as large, Q4_K/Q5_K/Q3_K's unpacked scales add under 4 %."""
    for scheme, limit in (("Q4_1", 1.0), ("Q4_K_M", 1.04), ("Q3_K_S", 1.04), ("BF16", 1.0)):
        net, _, path = load_model(tiny_ggufs[scheme], CPU, torch.float32)
        weights = sum(b.numel() * b.element_size() for b in net.buffers())
        norms = sum(p.numel() * p.element_size() for p in net.parameters())
        reader = gguf.GGUFReader(path)
        file_weights = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
        assert norms == sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)
        assert file_weights <= weights <= limit * file_weights, scheme


def test_generation_and_tensor_parallel_on_a_q4_k_m_file(tiny_ggufs) -> None:
    """The engine on a compact model, and two ranks (the MLP split 512 + 256 in whole 256-blocks, each
    rank's slices quantized) giving the same greedy tokens as one."""
    path = tiny_ggufs["Q4_K_M"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12, 13]]
    one = LLM(path, kv_cache_tokens=512).generate(prompts, params, use_tqdm=False)
    with LLM(path, kv_cache_tokens=512, tensor_parallel_size=2) as two:
        assert two.parallel.shard.columns == (0, 512)
        assert isinstance(two.model.layers[0].down, PackedProjection)
        got = two.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in one]


@pytest.mark.parametrize("qtype, readable", [(Q.IQ4_NL, True), (Q.Q8_K, False)])
def test_a_type_hydragen_cannot_compute_in_is_one_line_naming_it(tmp_path, qtype, readable) -> None:
    """One line naming the file, the tensor and the type, and whether dequantizing (the API's flag and the
    command line's) reads it: IQ4_NL the gguf package can dequantize, Q8_K it cannot."""
    from hydragen.model.errors import ModelFileError

    cfg = ModelConfig.from_hf(TINY)
    weights = _tiny_weights(cfg)
    make = float_maker(weights, cfg)

    def odd(name, shape, qt):
        if name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            return np.zeros((shape[0], shape[1] // block * size), np.uint8)
        return make(name, shape, qt)

    path = tmp_path / f"{qtype.name}.gguf"
    from hydragen.model import gguf_write

    original = gguf_write.scheme_type
    gguf_write.scheme_type = lambda s, n, *a, **kw: (
        qtype if n == "blk.0.ffn_up.weight" else original(s, n, *a, **kw)
    )
    try:
        write_gguf(path, cfg, "Q8_0", odd)
    finally:
        gguf_write.scheme_type = original
    with pytest.raises(ModelFileError) as e:
        load_model(path, CPU, torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert (
        f"tensor 'blk.0.ffn_up.weight' uses quantization type {qtype.name}, which hydragen cannot compute in"
        in msg
    )
    if readable:
        assert "dequantize=True (--dequantize on the command line) reads it as float32" in msg
        net, _, _ = load_model(path, CPU, torch.float32, dequantize=True)
        assert isinstance(net.layers[0].gate_up, DenseProjection)
    else:
        assert "nor can it read it with dequantize=True" in msg
        cannot_read = f"uses quantization type {qtype.name}, which hydragen cannot read"
        with pytest.raises(ModelFileError, match=cannot_read):
            load_model(path, CPU, torch.float32, dequantize=True)


def test_a_bfloat16_checkpoint_stays_16_bit_in_a_float32_model(tiny_models, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_models["llama"]
    dst = tmp_path / "bf16"
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, dst / "model.safetensors")
    net, _, _ = load_model(dst, CPU, torch.float32)
    assert isinstance(net.layers[0].qkv, PackedProjection) and net.layers[0].qkv.qtypes == [int(Q.BF16)]
    assert sum(b.numel() for b in net.layers[0].qkv.buffers()) == 2 * net.layers[0].qkv.out_features * 64
    ref, _, _ = load_model(dst, CPU, torch.float32, dequantize=True)
    ids = torch.arange(3, 40)
    assert torch.allclose(_logits(net, ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_random_weights_with_a_quantization_write_a_gguf_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HYDRAGEN_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    llm = LLM(f"{config}:Q4_K_M", random_weights=True, kv_cache_tokens=256)
    written = list((tmp_path / "cache" / "random-gguf").glob("*.Q4_K_M.gguf"))
    assert [llm.model_path] == written
    assert isinstance(llm.model.layers[0].qkv, PackedProjection)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, seed=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="random-weights quantization 'Q9_Z' is not one of"):
        LLM(f"{config}:Q9_Z", random_weights=True)


@pytest.mark.parametrize("scheme", ["Q4_K_M", "Q8_0"])
def test_every_layer_in_one_call_is_the_per_op_path_bit_for_bit(tiny_ggufs, scheme, monkeypatch) -> None:
    """model/layer_stack.py: the C++ layer loop makes the per-op path's calls in its order, so tokens and
    logprobs are identical with it on and off, for prefill, decode, n > 1 and a shared prefix; the engine
    takes it whenever every projection is packed, and the loop otherwise."""
    llm = assert_one_call_is_the_per_op_path(tiny_ggufs[scheme], list(range(5, 60)), 12, monkeypatch)
    assert layer_stack.packed_stack(llm.engine.runner.model) is not None


def assert_one_call_is_the_per_op_path(model, shared: list[int], max_tokens: int, monkeypatch) -> LLM:
    """Tokens and logprobs of ``model`` (n = 3 sampled, two prompts sharing ``shared`` and a short one)
    with the layers in one call and one op at a time are equal, and each step took the path asked for.
    Returns the engine."""
    from hydragen.engine import model_runner

    used = []
    real = model_runner.stack_layers

    def counted(*args, **kwargs):
        layers = real(*args, **kwargs)
        used.append(layers is not None)
        return layers

    monkeypatch.setattr(model_runner, "stack_layers", counted)
    llm = LLM(model, kv_cache_tokens=1024)
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=max_tokens, ignore_eos=True, logprobs=3
    )
    prompts = [shared + [61, 62], shared + [70], [9, 8, 7]]
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("HYDRAGEN_FUSED_LAYERS", flag)
        llm.reset_prefix_cache()
        used.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[flag] = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
        assert used and all(u == (flag == "1") for u in used)
    assert got["1"] == got["0"]
    return llm


@pytest.mark.parametrize("threads", [1, 3])
def test_every_layer_in_one_call_is_exact_at_any_thread_count(tiny_ggufs, threads, monkeypatch) -> None:
    """The one call runs its layers in one parallel region, each thread taking a share of every stage between
    barriers: one thread, and more threads than this machine's cores (uneven shares, waiters that yield), give
    the per-op path's tokens and logprobs bit for bit, prefill and decode, with a shared prefix."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(tiny_ggufs["Q4_K_M"], kv_cache_tokens=1024)
        params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)
        prompts = [list(range(5, 90)) + [91], list(range(5, 90)) + [93, 94], [7, 8]]
        got = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("HYDRAGEN_FUSED_LAYERS", flag)
            llm.reset_prefix_cache()
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[flag] = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
        assert got["1"] == got["0"]
    finally:
        torch.set_num_threads(before)


def test_the_layer_loop_stays_where_one_call_cannot_run(tiny_ggufs) -> None:
    """Float projections (dequantized), and tensor-parallel shards (o and down all-reduced before the
    residual), keep the Python loop."""
    dense, _, _ = load_model(tiny_ggufs["Q8_0"], CPU, torch.float32, dequantize=True)
    assert layer_stack.packed_stack(dense) is None
    packed, _, _ = load_model(tiny_ggufs["Q8_0"], CPU, torch.float32)
    assert layer_stack.packed_stack(packed) is not None
    packed.fuse_residual = False
    assert layer_stack.packed_stack(packed) is None
