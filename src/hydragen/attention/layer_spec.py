"""How each layer attends: the per-layer attention spec a model declares, and the distinct specs of a model.

Layers of the families people run differ in how they attend: Gemma 3 alternates sliding-window and full
layers, Gemma 2 soft-caps its scores, gpt-oss adds a learned sink logit per head, and some families scale
the scores by something other than ``head_dim ** -0.5``. A step builds one attention metadata per distinct
spec (not per layer: a model has one or two), and each layer reads the one of its spec. A metadata names
KV slots, and layers of different KV groups (``kv/layout.py``) read different pages, so the unit is a
layer **kind**: a (KV group, spec) pair.

What the kernels compute, on every path (the C++ op, the one-call layer stack, the torch twin, Triton): the
scale, a sliding window (a token at position p sees keys at positions in (p - W, p], Hugging Face's
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``) and a soft-cap (Gemma 2: each scaled score
s becomes cap * tanh(s / cap) before the softmax). Sinks are part of the format only (the MoE issue fills
them into the kernels); until then the model runner refuses a model that declares them (``unsupported``),
rather than running it without.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hydragen.kv.layout import model_kv_layout


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, beside the softmax over its visible keys that every layer computes."""

    scale: float  # scores are q . k * scale
    window: int | None = None  # sliding window: a token at p sees positions (p - window, p] (None: all)
    soft_cap: float | None = None  # scores become cap * tanh(score / cap) before the softmax (None: off)
    sinks: bool = False  # a learned logit per head joins the softmax's denominator (it has no value)

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"attention scale must be > 0, got {self.scale}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"a soft-cap must be > 0, got {self.soft_cap}")

    @property
    def mask_key(self) -> int | None:
        """What decides which keys a token sees: specs with one key share their shared runs and cuts."""
        return self.window


@dataclass(frozen=True)
class LayerSpecs:
    """A model's layer kinds: the distinct (KV group, spec) pairs in order of first use, and each layer's."""

    specs: tuple[AttentionSpec, ...]  # per kind
    groups: tuple[int, ...]  # per kind: the KV group whose pages its layers read
    of_layer: tuple[int, ...]  # layer i is kind of_layer[i]

    @classmethod
    def per_layer(cls, specs: Iterable[AttentionSpec], groups: Iterable[int] | None = None) -> LayerSpecs:
        specs = list(specs)
        groups = [0] * len(specs) if groups is None else list(groups)
        if len(groups) != len(specs):
            raise ValueError(f"{len(specs)} layer specs but {len(groups)} KV groups")
        kinds: list[tuple[int, AttentionSpec]] = []
        index: dict[tuple[int, AttentionSpec], int] = {}
        of_layer = []
        for kind in zip(groups, specs, strict=True):
            if kind not in index:
                index[kind] = len(kinds)
                kinds.append(kind)
            of_layer.append(index[kind])
        if not kinds:
            raise ValueError("a model has at least one layer")
        return cls(tuple(s for _, s in kinds), tuple(g for g, _ in kinds), tuple(of_layer))

    @classmethod
    def uniform(cls, num_layers: int, head_dim: int, groups: Iterable[int] | None = None) -> LayerSpecs:
        """Every layer full attention scaled by ``head_dim ** -0.5`` (Llama, Mistral, Qwen2)."""
        return cls.per_layer([AttentionSpec(scale=head_dim**-0.5)] * num_layers, groups)

    def __len__(self) -> int:
        return len(self.of_layer)

    def unsupported(self) -> str | None:
        """Why today's kernels cannot compute these specs exactly (sinks), or None when they can."""
        for i, spec in enumerate(self.specs):
            if spec.sinks:
                return f"layer {self.of_layer.index(i)} has attention sinks"
        return None

    def softcaps(self) -> list[float | None]:
        """Each layer's soft-cap (None: off)."""
        return [self.specs[i].soft_cap for i in self.of_layer]


def model_layer_specs(cfg) -> LayerSpecs:
    """The kinds of a model config's layers: its specs (``cfg.layer_specs``, else full attention in every
    layer) in its KV groups (``cfg.kv_groups``, else one)."""
    groups = model_kv_layout(cfg).group_of_layer
    declared = getattr(cfg, "layer_specs", None)
    if declared:
        if len(declared) != cfg.num_layers:
            raise ValueError(f"the model declares {len(declared)} layer specs for {cfg.num_layers} layers")
        return LayerSpecs.per_layer(declared, groups)
    return LayerSpecs.uniform(cfg.num_layers, cfg.head_dim, groups)
