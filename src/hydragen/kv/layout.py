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
    group_of_layer: tuple[int, ...]  # groups 0, 1, ..., each with at least one layer
    # Per group, the sliding window of its layers (None: a full-attention group). A window group's pages
    # before its sequences' windows are released as they move on (kv/manager.py), when group 0, the one
    # whose page ids the tables and the prefix tree use, is a full-attention group.
    group_window: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.group_of_layer:
            raise ValueError("a model has at least one layer")
        used = set(self.group_of_layer)
        if min(used) < 0 or used != set(range(len(used))):
            raise ValueError(f"KV groups are numbered 0, 1, ... with a layer in each: {self.group_of_layer}")
        if self.group_window and len(self.group_window) != len(used):
            raise ValueError(f"{len(self.group_window)} group windows for {len(used)} KV groups")
        if any(w is not None and w < 1 for w in self.group_window):
            raise ValueError(f"a group's window must be >= 1 token: {self.group_window}")

    @property
    def released(self) -> dict[int, int]:
        """The groups whose pages are released as the window moves past them: {group: window}. None when
        group 0 itself slides (a model of sliding layers only): its pages are the tables' and the tree's."""
        windows = self.group_window
        if not windows or windows[0] is not None:
            return {}
        return {g: w for g, w in enumerate(windows) if w is not None}

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
    """The layout a model config declares (``cfg.kv_groups``: a group per layer), else one group; each
    group's window is its layers' (``cfg.layer_specs``), None when one of them attends to everything."""
    declared = getattr(cfg, "kv_groups", None)
    if not declared:
        return KVLayout.single(cfg.num_layers)
    if len(declared) != cfg.num_layers:
        raise ValueError(f"the model declares KV groups for {len(declared)} of {cfg.num_layers} layers")
    groups = tuple(int(g) for g in declared)
    specs = getattr(cfg, "layer_specs", None) or ()
    if len(specs) != len(groups):
        return KVLayout(groups)
    windows: list[int | None] = []
    for g in range(max(groups) + 1):
        mine = [s.window for s, of in zip(specs, groups, strict=True) if of == g]
        windows.append(None if None in mine else max(mine))
    return KVLayout(groups, tuple(windows))
