"""Every decoder layer in one C++ call, when every projection of the model is kept packed.

``DecoderModel.forward`` runs a layer as three C++ calls plus attention, from a Python loop. At batch 1 on a
small model the Python between those calls (module dispatch, the attention callback, splitting q/k/v, the
KV write) is about a tenth of a decode step. ``native/csrc/quant_layers.cpp`` computes the same stages with
the same functions (qkv with norm, then its epilogue: bias, QK-norm and rotary, the KV write into the pool,
step attention, o, gate/up with SwiGLU, down) in one parallel region for all the layers, each thread taking
a share of every stage, so its output is the loop's bit for bit; the loop stays for everything else (float
or CUDA weights, biases outside q/k/v, tensor-parallel shards, the torch and Triton attention paths).

``HYDRAGEN_FUSED_LAYERS=0`` turns it off (the per-op path; how the tests and the benchmark compare them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hydragen.attention.step_attention import CPP_DTYPES, distinct_metas
from hydragen.model.linear import PackedProjection

# layers(h [T, hidden], rope (cos, sin, cols), the windowed layers' rope) -> h after every layer (in place)
Rope = tuple[torch.Tensor, torch.Tensor, int]
LayersFn = Callable[[torch.Tensor, Rope, Rope], torch.Tensor]


@dataclass(frozen=True)
class PackedStack:
    """The model's layers as the C++ op takes them: every part of every projection, flattened in the order
    qkv, o, gate_up, down per layer (``counts``: how many parts each has), the two norms per layer, and where
    the model has them each layer's q/k/v bias (Qwen2), its q and k head norms (QK-norm: Qwen3, Gemma 3),
    its norms on o's and down's outputs (Gemma's sandwich norms), the MLP's activation (0 SwiGLU, 1 GeGLU)
    and which layers rotate by the windowed layers' own table (Gemma 3)."""

    weights: list[torch.Tensor]
    qtypes: list[int]
    rows: list[int]
    counts: list[int]
    norms: list[torch.Tensor]
    qkv_biases: list[torch.Tensor]
    head_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    activation: int
    local_layers: list[int]
    act_bits: int
    isa: int


def enabled() -> bool:
    return os.environ.get("HYDRAGEN_FUSED_LAYERS", "1").strip() not in ("0", "false", "no", "off")


def packed_stack(model) -> PackedStack | None:
    """The layers flattened for the op, or None when the model's family does not declare that the op
    computes it exactly (``Family.fused_stack``: the op knows Llama's layer with a q/k/v bias, QK-norm,
    partial rotary, Gemma's sandwich norms, GeGLU and local rotary table, and would silently skip anything
    else), or any layer cannot take it (a float projection, a bias outside q/k/v, 16-bit norms, or a
    tensor-parallel shard that all-reduces o and down before the residual)."""
    family = getattr(model, "family", None)
    if family is None or not family.fused_stack:
        return None
    if not getattr(model, "fuse_residual", False) or len(model.layers) == 0:
        return None
    cfg = model.cfg
    weights, qtypes, rows, counts, norms, biases, head_norms, post_norms = [], [], [], [], [], [], [], []
    settings = set()
    for layer in model.layers:
        projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(isinstance(p, PackedProjection) for p in projections):
            return None
        if any(p.bias is not None for p in projections[1:]):
            return None
        if layer.qkv.bias is not None:
            biases.append(layer.qkv.bias.data.float().contiguous())
        if cfg.qk_norm:
            head_norms += [layer.q_norm.data.float().contiguous(), layer.k_norm.data.float().contiguous()]
        if cfg.sandwich_norms:
            post_norms += [n.data.float().contiguous() for n in (layer.post_attn_norm, layer.post_mlp_norm)]
        for p in projections:
            weights += p.weights
            qtypes += p.qtypes
            rows += p.rows
            counts.append(len(p.weights))
            settings.add((p.act_bits, p.isa))
        for norm in (layer.attn_norm, layer.mlp_norm):
            if norm.dtype != torch.float32 or norm.device.type != "cpu":
                return None
            norms.append(norm.data.contiguous())
    if len(settings) != 1 or len(biases) not in (0, len(model.layers)):  # one environment; all or none
        return None
    ((act_bits, isa),) = settings
    local = [int(x) for x in model._local_rope] if model.local_rotary is not None else []
    activation = {"silu": 0, "gelu_tanh": 1}[cfg.activation]
    return PackedStack(
        weights, qtypes, rows, counts, norms, biases, head_norms, post_norms, activation, local, act_bits, isa
    )


def stack_layers(
    model,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slots: tuple[torch.Tensor, ...],
    metas: tuple,
    layer_meta: tuple[int, ...],
    scales: list[float],
    layer_group: tuple[int, ...],
    layer_row: tuple[int, ...],
    softcaps: list[float | None] | None = None,
):
    """The ``layers`` callable for ``DecoderModel.forward`` (the KV write and step attention inside), or None
    when the model or the pool cannot take the one-call path. Layer i writes its K/V at ``slots[g]`` of
    its KV group g = ``layer_group[i]``, in row ``layer_row[i]`` of the pool, and attends by
    ``metas[layer_meta[i]]`` (a window's metadata carries its bounds) scaled by ``scales[i]`` and soft-capped
    at ``softcaps[i]`` (None: off): the step's metadata per layer kind, each passed to the op once."""
    if not enabled() or pool_k.dtype not in CPP_DTYPES or pool_k.device.type != "cpu":
        return None
    stack = getattr(model, "_packed_stack", False)
    if stack is False:  # computed once per model: the packed modules never change after load
        stack = model._packed_stack = packed_stack(model)
    if stack is None:
        return None
    from hydragen.attention import step_work
    from hydragen.native.build import load_ops

    ops = load_ops()
    if ops is None:
        return None
    distinct, index = distinct_metas(metas)
    for m in distinct:
        if m.slots_needed > pool_k.shape[1]:
            raise ValueError(f"the step reads slot {m.slots_needed - 1} but k/v hold {pool_k.shape[1]} slots")
    of_layer = [index[i] for i in layer_meta]
    c = model.cfg
    names = ("work_runs", "pieces", "blocks", "tok_ptr", "tok_parts")
    fields = [[getattr(m, f) for m in distinct] for f in names]
    parts = [m.num_parts for m in distinct]
    max_tokens = [m.max_item_tokens for m in distinct]
    firsts = [m.tok_first for m in distinct]
    caps = [0.0 if c is None else float(c) for c in (softcaps or [None] * len(scales))]
    slots, groups, rows = list(slots), list(layer_group), list(layer_row)

    def layers(h: torch.Tensor, rope, local_rope) -> torch.Tensor:
        cos, sin, cols = rope
        local_cos, local_sin = (local_rope[0], local_rope[1]) if stack.local_layers else (None, None)
        return ops.quant_layers(
            h, cos, sin, cols, stack.weights, stack.qtypes, stack.rows, stack.counts, stack.norms,
            stack.qkv_biases, stack.head_norms, stack.post_norms, stack.activation, local_cos, local_sin,
            stack.local_layers, c.rms_norm_eps, pool_k, pool_v, slots, groups, rows,
            c.num_heads, c.num_kv_heads, *fields, parts,
            max_tokens, firsts, of_layer, scales, caps, step_work.TILE_MIN_ROWS, step_work.TILE_MIN_KEYS,
            stack.act_bits, stack.isa,
        )  # fmt: skip

    return layers
