"""Which KV page group each layer is in: the per-layer-group page tables' layout.

A page id spans every layer only while every layer keeps the same positions. Sliding-window layers need
none of the pages before their window, which full-attention layers keep, so layers come in **groups**, and
a sequence holds a page table per group: a page of group g holds the KV of group g's layers only.

The pool keeps the groups in one set of tensors ``[rows, slots, Hkv, D]`` with ``rows`` the largest group
(vLLM's hybrid KV cache does the same): layer i is row ``row_of_layer[i]`` of its group's pages. Groups of
equal size then cost exactly the memory of one table spanning every layer, and a page a group releases can
be taken by any group. A plain model has one group: rows are layers, and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    group_of_layer: tuple[int, ...]  # groups are numbered 0.. in order of first use

    def __post_init__(self) -> None:
        if not self.group_of_layer:
            raise ValueError("a model has at least one layer")
        seen = 0
        for g in self.group_of_layer:
            if not 0 <= g <= seen:
                raise ValueError(f"KV groups are numbered 0, 1, ... by first use: {self.group_of_layer}")
            seen = max(seen, g + 1)

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        return cls((0,) * num_layers)

    @property
    def groups(self) -> int:
        return max(self.group_of_layer) + 1

    @property
    def row_of_layer(self) -> tuple[int, ...]:
        """Layer i's row in its group's pages: its index among its group's layers."""
        count = [0] * self.groups
        rows = []
        for g in self.group_of_layer:
            rows.append(count[g])
            count[g] += 1
        return tuple(rows)

    @property
    def rows(self) -> int:
        """Rows the pool's tensors need: the largest group's layers."""
        return max(self.group_of_layer.count(g) for g in range(self.groups))


def model_kv_layout(cfg) -> KVLayout:
    """The layout a model config declares (``cfg.kv_groups``: a group per layer), else one group."""
    declared = getattr(cfg, "kv_groups", None)
    if declared:
        if len(declared) != cfg.num_layers:
            raise ValueError(f"the model declares KV groups for {len(declared)} of {cfg.num_layers} layers")
        return KVLayout(tuple(int(g) for g in declared))
    return KVLayout.single(cfg.num_layers)


def window_groups(windowed: list[bool] | tuple[bool, ...]) -> tuple[int, ...]:
    """KV groups for a model whose layers are sliding-window (True) or full attention (False): windowed
    layers never share a group with full ones (their pages are to be released as the window moves on).

    Every group has as many layers as the smaller kind (the largest group sets the pool's rows, so unequal
    groups waste memory): the full layers in groups of that size and the windowed ones cut, in layer order,
    into groups of that size (vLLM's hybrid cache groups the same way). Gemma 2 (1:1) gets two groups;
    Gemma 3's 1B (22 windowed, 4 full) gets 7 groups of 4 rows, 28 rows a page for 26 layers, where one
    windowed and one full group would take 44. Groups are numbered by first use (``KVLayout``)."""
    kinds = [bool(w) for w in windowed]
    if all(kinds) or not any(kinds):
        return (0,) * len(kinds)
    size = min(kinds.count(True), kinds.count(False))
    seen = {True: 0, False: 0}
    keys = []  # (kind, chunk) per layer
    for w in kinds:
        keys.append((w, seen[w] // size))
        seen[w] += 1
    number: dict[tuple[bool, int], int] = {}
    return tuple(number.setdefault(key, len(number)) for key in keys)
