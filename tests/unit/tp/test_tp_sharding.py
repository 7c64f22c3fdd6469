"""Tensor-parallel sharding without processes: split rules, refused splits, and each rank loading only its
slices (safetensors, pytorch .bin, quantized GGUF) exactly equal to the same slices of the whole model."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from hydragen import LLM
from hydragen.model.loader import load_model
from hydragen.tp.checkpoint import load_shard
from hydragen.tp.sharding import Shard, TPSplitError, check_split

CPU = torch.device("cpu")


def _expected_slices(full, cfg, shard: Shard) -> dict[str, torch.Tensor]:
    """What rank ``shard.rank`` must hold, cut out of the whole model's parameters."""
    d, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qs = slice(shard.head_lo * d, (shard.head_lo + shard.heads) * d)
    ks = slice(shard.kv_head_lo * d, (shard.kv_head_lo + shard.kv_heads) * d)
    cols = slice(*shard.columns)
    inter = cfg.intermediate_size
    want = {}
    for i, layer in enumerate(full.layers):
        w = layer.qkv.weight
        want[f"layers.{i}.qkv.weight"] = torch.cat([w[:q][qs], w[q : q + kv][ks], w[q + kv :][ks]])
        if layer.qkv.bias is not None:
            b = layer.qkv.bias
            want[f"layers.{i}.qkv.bias"] = torch.cat([b[:q][qs], b[q : q + kv][ks], b[q + kv :][ks]])
        want[f"layers.{i}.o.weight"] = layer.o.weight[:, qs]
        g = layer.gate_up.weight
        want[f"layers.{i}.gate_up.weight"] = torch.cat([g[:inter][cols], g[inter:][cols]])
        want[f"layers.{i}.down.weight"] = layer.down.weight[:, cols]
        want[f"layers.{i}.attn_norm"] = layer.attn_norm
    lo, hi = shard.vocab
    pad = shard.vocab_per_rank - (hi - lo)
    rows = full.embed.weight[lo:hi]
    want["embed.weight"] = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    want["norm"] = full.norm
    return want


def _check_rank(path, world: int, rank: int, full, cfg, dequantize: bool = False) -> int:
    """Rank ``rank``'s weights equal the slices of ``full`` (a float model); returns the bytes it holds.
    A rank that kept its GGUF slices quantized is read back through quant.rows (checked against the gguf
    package's dequantizer in test_quant_kernels)."""
    net, got_cfg, _, shard = load_shard(path, rank, world, CPU, torch.float32, dequantize=dequantize)
    assert got_cfg == cfg
    params = dict(net.named_parameters()) | _dequantized(net)
    for name, want in _expected_slices(full, cfg, shard).items():
        assert torch.equal(params[name], want), (rank, name)
    held = [p for p in net.parameters()] + [b for b in net.buffers()]
    return sum(t.numel() * t.element_size() for t in held)


def _dequantized(net) -> dict[str, torch.Tensor]:
    """The float weights of a model's packed modules, named as the float model names them."""
    from hydragen.model.linear import PackedEmbedding, PackedProjection
    from hydragen.model.qtensor import PACKED_TYPES
    from hydragen.native import quant

    def rows(data, qtype, n, cols):
        if qtype in PACKED_TYPES:
            return quant.rows(data, qtype, cols, torch.arange(n))
        half = {1: torch.float16, 30: torch.bfloat16}.get(qtype, torch.float32)
        return data.view(half).float().reshape(n, cols)

    out = {}
    for name, module in net.named_modules():
        if isinstance(module, PackedProjection) and name != "lm_head":
            parts = zip(module.weights, module.qtypes, module.rows, strict=True)
            out[f"{name}.weight"] = torch.cat([rows(w, t, n, module.in_features) for w, t, n in parts])
        elif isinstance(module, PackedEmbedding):
            out[f"{name}.weight"] = rows(module.table, module.qtype, module.num_embeddings, module.cols)
    return out


@pytest.mark.parametrize("name", ["llama", "llama3_mqa", "qwen2", "mistral", "phi3", "phi4_mini"])
def test_each_rank_loads_exactly_its_slices_from_safetensors(tiny_models, name) -> None:
    full, cfg, _ = load_model(tiny_models[name], CPU, torch.float32)
    whole = sum(p.numel() * p.element_size() for p in full.parameters())
    for rank in range(2):
        held = _check_rank(tiny_models[name], 2, rank, full, cfg)
        # Only its shard: about half, plus the replicated norms (and KV head, for MQA).
        assert held < 0.75 * whole


def test_kv_heads_are_replicated_when_fewer_than_ranks(tiny_models) -> None:
    full, cfg, _ = load_model(tiny_models["llama"], CPU, torch.float32)  # 4 heads, 2 KV heads
    shards = [Shard(cfg, r, 4) for r in range(4)]
    assert [s.kv_head_lo for s in shards] == [0, 0, 1, 1] and {s.kv_heads for s in shards} == {1}
    for rank in range(4):
        _check_rank(tiny_models["llama"], 4, rank, full, cfg)


def test_pytorch_bin_checkpoints_are_sliced_too(tiny_models, tmp_path) -> None:
    from safetensors.torch import load_file

    src = Path(tiny_models["qwen2"])
    shutil.copy(src / "config.json", tmp_path / "config.json")
    torch.save(load_file(src / "model.safetensors"), tmp_path / "pytorch_model.bin")
    full, cfg, _ = load_model(tmp_path, CPU, torch.float32)
    for rank in range(2):
        _check_rank(tmp_path, 2, rank, full, cfg)


def test_gguf_rank_reads_exactly_its_slices(tmp_path) -> None:
    """A tiny llama GGUF with llama.cpp's permuted q/k, a Q8_0 embedding (row slices), an F16 up and a
    Q4_0 down projection (a column slice of a quantized tensor)."""
    import gguf
    import numpy as np

    from tests.unit.model.test_gguf import _permute, _tiny_weights, _write_tiny

    hf = _tiny_weights(np.random.default_rng(0), bias=False)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = _permute(hf["blk.0.attn_q.weight"], 4)
    stored["blk.0.attn_k.weight"] = _permute(hf["blk.0.attn_k.weight"], 2)
    Q = gguf.GGMLQuantizationType
    quant = {"token_embd.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.F16, "blk.0.ffn_down.weight": Q.Q4_0}
    _write_tiny(tmp_path / "tiny.gguf", "llama", stored, quant)
    full, cfg, _ = load_model(tmp_path / "tiny.gguf", CPU, torch.float32, dequantize=True)
    for rank in range(2):
        _check_rank(tmp_path / "tiny.gguf", 2, rank, full, cfg, dequantize=True)  # dequantized slices
        _check_rank(tmp_path / "tiny.gguf", 2, rank, full, cfg)  # slices kept in their blocks


@pytest.mark.slow
def test_quantized_gguf_rank_reads_exactly_its_slices(embedded_llm) -> None:
    """The embedded SmolLM2 GGUF (Q4_1 / Q8_0, llama.cpp's permuted q/k): 9 heads, 3 KV heads -> TP = 3,
    each rank's slices kept quantized (about a third of the quantized model's bytes)."""
    path = embedded_llm.model_path
    full, cfg, _ = load_model(path, CPU, torch.float32, dequantize=True)
    whole = sum(t.numel() * t.element_size() for t in embedded_llm.model.buffers())
    held = _check_rank(path, 3, 2, full, cfg)
    assert held < 0.4 * whole


@pytest.mark.parametrize(
    ("name", "world", "why"),
    [
        ("llama", 3, "cannot split 4 attention heads over 3 ranks"),
        ("qwen2", 4, "cannot split 6 attention heads over 4 ranks"),
        ("mistral", 8, "cannot split 4 attention heads over 8 ranks"),
        ("llama", 0, "tensor_parallel_size must be a positive integer"),
    ],
)
def test_unsupported_splits_are_refused_with_the_reason(tiny_models, name, world, why) -> None:
    _, cfg, _ = load_model(tiny_models[name], CPU, torch.float32)
    with pytest.raises(TPSplitError, match=why):
        check_split(cfg, world)


def test_kv_and_mlp_splits_that_do_not_divide_are_refused(tiny_models) -> None:
    _, cfg, _ = load_model(tiny_models["qwen2"], CPU, torch.float32)  # 6 heads, 2 KV heads, 96 columns
    with pytest.raises(TPSplitError, match="cannot replicate 2 KV heads over 3 ranks"):
        check_split(cfg, 3)
    odd = dataclasses.replace(cfg, num_heads=8, num_kv_heads=8, intermediate_size=90)
    with pytest.raises(TPSplitError, match="MLP's 90 columns over 4 ranks"):
        check_split(odd, 4)
    with pytest.raises(TPSplitError, match="cannot split 6 KV heads over 4 ranks"):
        check_split(dataclasses.replace(cfg, num_heads=12, num_kv_heads=6, intermediate_size=96), 4)


def test_llm_refuses_a_bad_split_before_starting_any_process(tiny_models) -> None:
    with pytest.raises(ValueError, match="cannot split 4 attention heads over 3 ranks"):
        LLM(tiny_models["llama"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_models["llama"], tensor_parallel_size=0)


def test_cli_refuses_a_bad_split_with_one_line(tiny_models, capsys) -> None:
    from hydragen import cli

    code = cli.main(["generate", "hi", "--model", tiny_models["llama"], "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "error: cannot split 4 attention heads over 3 ranks: tensor_parallel_size must divide the number of "
        "attention heads (sizes that work for this model: 1, 2, 4)"
    ]


class _RecordingGroup:
    """A one-process stand-in for rank 0's TPGroup: every all-reduce is counted, recorded and left as is."""

    rank, world, device = 0, 2, CPU

    def __init__(self, issued: int = 0):
        self.issued, self.seen = issued, []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.issued += 1
        self.seen.append((tuple(x.shape), x.dtype))
        return x


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("llama", torch.float32), ("qwen2", torch.bfloat16), ("llama3_mqa", torch.float16)],
)
def test_a_rank_that_failed_part_way_issues_the_all_reduces_the_others_do(tiny_models, name, dtype) -> None:
    """``finish_reduces`` after any number of a forward's all-reduces issues exactly the rest of them, in
    shape and dtype (a mismatch would leave the ranks out of step); the logits shard has vocab_rows
    columns, the shape a failed rank's NaN shard takes (lockstep.py)."""
    from hydragen.bench.quant.accuracy import plain_attention

    net, cfg, _, shard = load_shard(tiny_models[name], 0, 2, CPU, dtype)
    net.attach(_RecordingGroup(), shard.vocab[0], cfg.vocab_size)
    ids = torch.tensor([3, 1, 4, 1, 5])
    hidden = net(ids, torch.arange(len(ids)), plain_attention)
    healthy = net.group.seen
    assert len(healthy) == 1 + 2 * cfg.num_layers
    assert net.logits(hidden[-2:]).shape == (2, net.vocab_rows)
    for reached in range(len(healthy) + 1):
        net.group = _RecordingGroup(issued=reached)
        net.finish_reduces(len(ids))
        assert net.group.seen == healthy[reached:], reached
