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
        """The groups whose pages are released as the window moves past them: {group: window}."""
        return released_groups(self.group_window)

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


def released_groups(group_window) -> dict[int, int]:
    """{group: window} of the sliding groups whose pages go as their windows move on: none when group 0
    itself slides (a model of sliding layers only), since its pages are the tables' and the tree's."""
    if not group_window or group_window[0] is not None:
        return {}
    return {g: w for g, w in enumerate(group_window) if w is not None}


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
    return KVLayout(groups, group_windows(groups, [s.window for s in specs]))


def group_windows(groups, windows) -> tuple[int | None, ...]:
    """Per group, the window of its members (layers or layer kinds: ``groups[i]`` and ``windows[i]``), None
    when one of them attends to everything."""
    out = []
    for g in range(max(groups) + 1):
        mine = [w for w, of in zip(windows, groups, strict=True) if of == g]
        out.append(None if None in mine else max(mine))
    return tuple(out)


def window_groups(windowed: list[bool] | tuple[bool, ...]) -> tuple[int, ...]:
    """KV groups for a model whose layers are sliding-window (True) or full attention (False): windowed
    layers never share a group with full ones (their pages are released as the window moves on).

    Every group has as many layers as the smaller kind (the largest group sets the pool's rows, so unequal
    groups waste memory): the full layers in groups of that size and the windowed ones cut, in layer order,
    into groups of that size (vLLM's hybrid cache groups the same way). Gemma 2 (1:1) gets two groups;
    Gemma 3's 1B (22 windowed, 4 full) gets 7 groups of 4 rows, 28 rows a page for 26 layers, where one
    windowed and one full group would take 44 (and the full layers' pages, the ones a long context keeps,
    would carry 22 rows for 4 layers). Full groups are numbered first: group 0, whose page ids the tables
    and the prefix tree use, keeps every page (``KVLayout.released``)."""
    kinds = [bool(w) for w in windowed]
    if all(kinds) or not any(kinds):
        return (0,) * len(kinds)
    size = min(kinds.count(True), kinds.count(False))
    seen = {True: 0, False: 0}
    keys = []  # (windowed, chunk) per layer
    for w in kinds:
        keys.append((w, seen[w] // size))
        seen[w] += 1
    number = {key: n for n, key in enumerate(sorted(set(keys)))}  # (False, ...) first: full groups
    return tuple(number[key] for key in keys)
