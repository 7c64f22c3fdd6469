"""Attention for a whole packed step (decode tokens, prefill chunks, extends) in one call per layer.

The model runner packs every query token of a step into one varlen batch ``q [T, Hq, D]``; the KV pool
layer is ``k/v [S, Hkv, D]`` (slot axis first, slot = page * page_size + offset). What each token sees is
described once per step by a :class:`StepAttentionMeta`:

* **Segments** tile the tokens in order. Segment s holds tokens ``[seg_tok[s], seg_tok[s+1])`` and a list
  of slot runs; token j of the segment sees the first ``seg_visible[s] + j`` keys of the concatenation of
  those runs (capped at their total). A decode token is a one-token segment that sees all its runs; a
  prefill chunk whose own keys are its last run gets ``visible = ancestor keys + 1`` (the causal diagonal).
  Segments are read in place through their pages, key by key.
* **Units** say that tokens ``[tok_lo, tok_hi)`` also attend to the contiguous slots ``[kv_lo, kv_hi)``:
  all of them (``causal = 0``), or, for a square unit, token i sees keys ``0..i`` (``causal = 1``). A shared
  tree node is one unit over the DFS range of its sequences, so its keys are read once by a matrix-matrix
  product for all of them. Units may nest (a token under several shared nodes).

A token's output is exact softmax attention over the union of its segment's visible keys and the keys of
every unit that covers it (an LSE merge of the parts); a token that sees nothing gets zeros.

**Sliding windows** (``build(..., window=W, positions=...)``): a token at position p sees only keys at
positions in (p - W, p], its last W positions, its own included (Hugging Face's ``sliding_window_overlay``,
``kv_idx > q_idx - sliding_window``: Mistral's, Gemma's sliding layers). Keys get positions from the
description: a unit may carry a sixth field, the position of its first key (its keys are at consecutive
positions from there), and a segment a fifth, the position of the first key of its runs' concatenation;
``positions`` gives each token's. So the format stays what it is, and a window only adds a lower bound per
token: ``tok_first[t] = positions[t] - W + 1``, the first position token t sees. Prefix sharing is kept: a
shared unit is still read once for all its tokens by one matrix product, each query row masked below its
own bound (as a causal row is masked above its last key). Work wholly before every window is never read:
``build`` trims each unit and segment to the first key any of its tokens sees (dropping a unit none sees),
and ``step_work`` trims every piece and block again at its own tokens, so a sliding layer's cost per token
is bounded by the window, not the context. Trimmed units and segments are what ``unit_list``,
``segment_list``, ``unit_pos`` and ``seg_pos`` hold. A causal unit is never trimmed (it stays square): its
diagonal tiles are, in ``step_work``.

**Soft-capping** is not metadata: ``step_attention(..., softcap=c)`` makes every scaled score s into
c * tanh(s / c) before the softmax (Gemma 2), in both implementations.

**Draft trees** need no mask kind of their own (``tree_segments``): every token of a tree sees the whole
context, read once for all of them by non-causal units (shared runs, the rest of the item's context), plus
its ancestors and itself, a one-token segment over their slots (a handful of keys, read in place). The
LSE merge puts the two together, so both implementations take trees as they are.

Two implementations share this metadata. ``cpp`` (``native/csrc/step_attention.cpp``, compiled on first
use by ``native/build.py``) is one call per layer: unit pieces with enough query rows through a
register-blocked tile kernel (``native/csrc/tile_attention.h``: matrix products per KV head, the GQA group
folded into the rows, keys read in place through their runs), the rest by a threaded online-softmax kernel
reading K/V rows in place, partials merged per token in fp32.
``torch`` (``step_attention_torch``) gathers segment keys and runs the existing partial kernels: any
device, and a second oracle. ``auto`` takes cpp on CPU when it builds, else torch.

Units over the same tokens are read together, so the runner may pass a node on scattered pages as one unit
per run. A prefill chunk's own keys may come as the end of its segment or as a causal unit: both cost about
the same (a 1,024-token chunk: 34 vs 31 ms CPU, one thread, embedded-model shapes).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hydragen.attention import step_work
from hydragen.attention.step_work import cut_step
from hydragen.native import build as cpp_build

UNIT_FIELDS = 5  # kv_lo, kv_hi, tok_lo, tok_hi, causal (a sixth, optional: the first key's position)
CPP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # q and K/V dtypes the C++ op reads


@dataclass
class StepAttentionMeta:
    """Everything the step's attention needs that does not change from layer to layer.

    The first six fields are the step as the runner describes it; the rest is derived by ``build``: the
    C++ op's work items (see ``step_work``) and, for the torch twin, the validated lists. With a window,
    ``tok_first`` holds each token's first visible position and ``unit_pos`` / ``seg_pos`` the position of
    each unit's / segment's first key (empty tensors and no window: every key visible as described).
    """

    units: Tensor  # int64 [U, 5]: kv_lo, kv_hi, tok_lo, tok_hi, causal (empty units dropped)
    seg_tok: Tensor  # int64 [NS + 1]
    seg_run: Tensor  # int64 [NS + 1]
    runs: Tensor  # int64 [NR, 2]: slot_lo, slot_hi (empty runs dropped)
    seg_visible: Tensor  # int64 [NS]
    num_tokens: int
    work_runs: Tensor  # int64 [NW, 2]: the slot runs the items read
    pieces: Tensor  # int64 [NP, 9]: item, first partial row, may_tile, kpos; most expensive first
    blocks: Tensor  # int64 [NB, 7]: item, kpos; most expensive first
    tok_ptr: Tensor  # int64 [T + 1]: token t's partial rows are tok_parts[tok_ptr[t]:tok_ptr[t+1]]
    tok_parts: Tensor  # int64 [R]
    num_parts: int  # R
    max_item_tokens: int
    slots_needed: int  # one past the highest slot read: the pool layer must be at least this long
    unit_list: list[tuple[int, int, int, int, int]] = field(repr=False)
    segment_list: list[tuple[int, int, list[tuple[int, int]], int]] = field(repr=False)
    window: int | None = None  # a sliding window of this many positions, or None
    tok_first: Tensor | None = None  # int64 [T] with a window (each token's first visible position), else [0]
    unit_pos: Tensor | None = None  # int64 [U] with a window: the position of each unit's first key, else [0]
    seg_pos: Tensor | None = None  # int64 [NS] with a window: the position of each segment's first key
    torch_plan: object | None = field(default=None, repr=False)  # step_attention_torch's gathers, lazily

    def __post_init__(self) -> None:
        empty = torch.zeros(0, dtype=torch.int64, device=self.units.device)
        for name in ("tok_first", "unit_pos", "seg_pos"):
            if getattr(self, name) is None:
                setattr(self, name, empty)

    @property
    def device(self) -> torch.device:
        return self.units.device

    @classmethod
    def build(
        cls,
        units: list[tuple[int, int, int, int, int]],
        segments: list[tuple[int, int, list[tuple[int, int]], int]],
        num_tokens: int,
        device,
        window: int | None = None,
        positions=None,
    ) -> StepAttentionMeta:
        """Validate the step's description and precompute the per-step index tensors (once per step).
        With ``window``, ``positions`` (each token's position) is needed and every unit and segment must
        carry its first key's position (the module docstring)."""
        num_tokens = int(num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        segment_list, slots_needed, seg_pos = _check_segments(segments, num_tokens, window is not None)
        unit_list, unit_pos = _check_units(units, num_tokens, window is not None)
        slots_needed = max([slots_needed] + [u[1] for u in unit_list])
        tok_first = None
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(f"a sliding window must be an int >= 1, got {window!r}")
            if positions is None:
                raise ValueError("a window needs each token's position (positions)")
            pos = list(map(int, positions.tolist() if isinstance(positions, Tensor) else positions))
            if len(pos) != num_tokens:
                raise ValueError(f"{len(pos)} positions for {num_tokens} tokens")
            tok_first = [p - window + 1 for p in pos]
            unit_list, unit_pos = _trim_units(unit_list, unit_pos, tok_first)
            segment_list, seg_pos = _trim_segments(segment_list, seg_pos, tok_first)
        work = cut_step(unit_list, segment_list, num_tokens, tok_first, unit_pos, seg_pos)
        long = dict(dtype=torch.int64)
        none = torch.zeros(0, dtype=torch.int64, device=device)  # no window: no bounds, no key positions
        seg_run = [0]
        for seg in segment_list:
            seg_run.append(seg_run[-1] + len(seg[2]))
        put = lambda x: torch.as_tensor(x, **long).to(device)
        return cls(
            units=put(unit_list).view(-1, UNIT_FIELDS),
            seg_tok=put([0] + [seg[1] for seg in segment_list]),
            seg_run=put(seg_run),
            runs=work.work_runs[: seg_run[-1]].to(device),  # the segments' runs lead work_runs
            seg_visible=put([seg[3] for seg in segment_list]),
            num_tokens=num_tokens,
            work_runs=work.work_runs.to(device),
            pieces=work.pieces.to(device),
            blocks=work.blocks.to(device),
            tok_ptr=work.tok_ptr.to(device),
            tok_parts=work.tok_parts.to(device),
            num_parts=work.num_parts,
            max_item_tokens=work.max_item_tokens,
            slots_needed=slots_needed,
            unit_list=unit_list,
            segment_list=segment_list,
            window=window,
            tok_first=put(tok_first) if window is not None else none,
            unit_pos=put(unit_pos) if window is not None else none,
            seg_pos=put(seg_pos) if window is not None else none,
        )

    def unit_positions(self) -> list[int]:
        """The position of each unit's first key (a window's metadata; zeros without one)."""
        return self.unit_pos.tolist() if self.window is not None else [0] * len(self.unit_list)

    def segment_positions(self) -> list[int]:
        """The position of each segment's first key (a window's metadata; zeros without one)."""
        return self.seg_pos.tolist() if self.window is not None else [0] * len(self.segment_list)


def _trim_units(units, unit_pos, tok_first):
    """Non-causal units less their leading keys no token of theirs sees; units none sees dropped."""
    out, pos_out = [], []
    for (kv_lo, kv_hi, lo, hi, causal), pos in zip(units, unit_pos, strict=True):
        cut = 0 if causal else min(max(0, min(tok_first[lo:hi]) - pos), kv_hi - kv_lo)
        if kv_lo + cut < kv_hi:
            out.append((kv_lo + cut, kv_hi, lo, hi, causal))
            pos_out.append(pos + cut)
    return out, pos_out


def _trim_segments(segments, seg_pos, tok_first):
    """Segments less their leading keys no token of theirs sees (never past ``visible``, which stays >= 0:
    the tokens that would see none keep their bound in the kernels)."""
    out, pos_out = [], []
    for (lo, hi, runs, visible), pos in zip(segments, seg_pos, strict=True):
        total = sum(b - a for a, b in runs)
        cut = min(max(0, min(tok_first[lo:hi], default=pos) - pos), total, visible)
        out.append((lo, hi, step_work.cut_runs(runs, cut, total) if cut else runs, visible - cut))
        pos_out.append(pos + cut)
    return out, pos_out


def distinct_metas(metas) -> tuple[list[StepAttentionMeta], list[int]]:
    """Each metadata object of ``metas`` once (layer specs that see the same keys share one), and the index
    of each entry's among them: what the one-call layer stack and the tensor-parallel wire carry."""
    distinct: list[StepAttentionMeta] = []
    where: dict[int, int] = {}
    for m in metas:
        if id(m) not in where:
            where[id(m)] = len(distinct)
            distinct.append(m)
    return distinct, [where[id(m)] for m in metas]


def tree_segments(
    tok_lo: int, slots: list[int], parents: tuple[int, ...]
) -> list[tuple[int, int, list[tuple[int, int]], int]]:
    """The segments of a draft tree's tokens: token j (query token tok_lo + j, its K/V at ``slots[j]``, its
    parent ``parents[j]``, an earlier token or -1) sees its ancestors' keys and its own, root first, and
    no other token of the tree: a one-token segment each. The context they all see is the caller's units.
    Parents must be checked first (``step_plan.tree_depths``)."""
    out = []
    chains: list[list[tuple[int, int]]] = []  # per token: the slot runs of its ancestors and itself
    for j, p in enumerate(parents):
        runs = list(chains[p]) if p >= 0 else []
        s = slots[j]
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
        chains.append(runs)
        out.append((tok_lo + j, tok_lo + j + 1, runs, sum(b - a for a, b in runs)))
    return out


def _ints(values, n: int, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of n ints, or a ValueError naming ``what``."""
    try:
        out = tuple(map(int, values))
    except (TypeError, ValueError):
        out = ()
    if len(out) != n:
        raise ValueError(f"{what}, got {values!r}")
    return out


def _check_segments(segments, num_tokens: int, positioned: bool = False):
    """Normalised segments (empty runs dropped), one past the last slot they read, and each one's first key's
    position (a fifth field, needed and read when ``positioned``; else ignored, and the list empty)."""
    out = []
    key_pos = []
    slots_needed = 0
    pos = 0
    for s, seg in enumerate(segments):
        try:
            lo, hi, runs, visible, *where = seg
            if len(where) > 1 or (positioned and not where):
                raise ValueError
        except (TypeError, ValueError):
            form = "tok_lo, tok_hi, runs, visible" + (", first key's position" if positioned else "")
            raise ValueError(f"segment {s} must be ({form}), got {seg!r}") from None
        lo, hi, visible = _ints((lo, hi, visible), 3, f"segment {s}: tok_lo, tok_hi, visible must be ints")
        if positioned:
            key_pos += _ints(where, 1, f"segment {s}: its first key's position must be an int")
        if lo != pos:
            raise ValueError(f"segment {s} starts at token {lo}, expected {pos}: segments tile the tokens")
        if hi < lo:
            raise ValueError(f"segment {s} ends (token {hi}) before it starts (token {lo})")
        if visible < 0:
            raise ValueError(f"segment {s}: visible must be >= 0, got {visible}")
        try:
            pairs = [(int(a), int(b)) for a, b in runs]
        except (TypeError, ValueError):
            raise ValueError(f"segment {s}: runs must be integer pairs (lo, hi): {runs!r}") from None
        bad = [(a, b) for a, b in pairs if a < 0 or b < a]
        if bad:
            raise ValueError(f"segment {s}: bad slot run {bad[0]}")
        kept = [(a, b) for a, b in pairs if b > a]
        if kept:
            slots_needed = max(slots_needed, max(b for _, b in kept))
        out.append((lo, hi, kept, visible))
        pos = hi
    if pos != num_tokens:
        raise ValueError(f"segments cover tokens [0, {pos}) but the step has {num_tokens} tokens")
    return out, slots_needed, key_pos


def _check_units(units, num_tokens: int, positioned: bool = False):
    """The non-empty units, and each one's first key's position (a sixth field, needed and read when
    ``positioned``; else ignored, and the list empty)."""
    kept, key_pos = [], []
    for i, unit in enumerate(units):
        n = UNIT_FIELDS + 1 if positioned or _length(unit) == UNIT_FIELDS + 1 else UNIT_FIELDS
        form = "kv_lo, kv_hi, tok_lo, tok_hi, causal" + (", first key's position" if n > UNIT_FIELDS else "")
        kv_lo, kv_hi, tok_lo, tok_hi, causal, *where = _ints(unit, n, f"unit {i} must be ({form}) integers")
        if not 0 <= tok_lo <= tok_hi <= num_tokens:
            raise ValueError(f"unit {i}: tokens [{tok_lo}, {tok_hi}) outside the step's [0, {num_tokens})")
        if not 0 <= kv_lo <= kv_hi:
            raise ValueError(f"unit {i}: bad slot range [{kv_lo}, {kv_hi})")
        if causal not in (0, 1):
            raise ValueError(f"unit {i}: causal must be 0 or 1, got {causal}")
        if causal and kv_hi - kv_lo != tok_hi - tok_lo:
            raise ValueError(
                f"unit {i}: a causal unit must be square, got {tok_hi - tok_lo} tokens, {kv_hi - kv_lo} keys"
            )
        if kv_hi > kv_lo and tok_hi > tok_lo:
            kept.append((kv_lo, kv_hi, tok_lo, tok_hi, causal))
            if positioned:
                key_pos.append(where[0])
    return kept, key_pos


def _length(x) -> int:
    try:
        return len(x)
    except TypeError:
        return -1


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, meta: StepAttentionMeta) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D] and k/v [S, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the step metadata has {meta.num_tokens}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim of q ({q.shape[2]}) != head dim of k/v ({k.shape[2]})")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if k.dtype != v.dtype or (k.dtype != q.dtype and q.dtype != torch.float32):
        raise ValueError(
            f"k and v must share one dtype, q's or (a 16-bit KV cache) a narrower one under float32 q; got "
            f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if k.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"k/v must be float32, bfloat16 or float16, got {k.dtype}")
    if k.device != q.device or v.device != q.device or meta.device != q.device:
        raise ValueError(
            f"q, k, v and the metadata must be on one device, got {q.device}, {k.device}, "
            f"{v.device}, {meta.device}"
        )
    if meta.slots_needed > k.shape[0]:
        raise ValueError(f"the step reads slot {meta.slots_needed - 1} but k/v hold {k.shape[0]} slots")


_warned = False


def _warn_fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"hydragen: C++ step attention unavailable ({reason}); using torch", stacklevel=3)


def step_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: StepAttentionMeta,
    scale: float,
    impl: str = "auto",
    softcap: float | None = None,
) -> Tensor:
    """Attention of every token of the step; q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D] in q's dtype.
    ``softcap`` c: scores s become c * tanh(s / c) before the softmax (None: off)."""
    if impl not in ("auto", "cpp", "torch"):
        raise ValueError(f"impl must be 'auto', 'cpp' or 'torch', got {impl!r}")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    _check_inputs(q, k, v, meta)
    cpp_ready = q.device.type == "cpu" and q.dtype in CPP_DTYPES and k.stride(2) == 1 and v.stride(2) == 1
    if impl == "cpp" and not cpp_ready:
        raise ValueError(
            f"impl='cpp' needs CPU fp32/bf16/fp16 tensors with a dense head dim, got {q.dtype} on {q.device}"
        )
    op = None
    if impl != "torch" and cpp_ready:
        op = cpp_build.step_attention_op()
        if op is None:
            reason = cpp_build.build_error() or "unknown reason"
            if impl == "cpp":
                raise RuntimeError(f"the C++ step-attention op is unavailable: {reason}")
            if cpp_build.disabled_reason() is None:
                _warn_fallback(reason)
    if op is None:
        from hydragen.attention.step_attention_torch import torch_step_attention

        return torch_step_attention(q, k, v, meta, float(scale), softcap)
    return op(
        q if q.stride(2) == 1 else q.contiguous(),
        k,
        v,
        meta.work_runs,
        meta.pieces,
        meta.blocks,
        meta.tok_ptr,
        meta.tok_parts,
        meta.num_parts,
        meta.max_item_tokens,
        step_work.TILE_MIN_ROWS,
        step_work.TILE_MIN_KEYS,
        float(scale),
        meta.tok_first,
        0.0 if softcap is None else float(softcap),
    )


__all__ = ["CPP_DTYPES", "StepAttentionMeta", "distinct_metas", "step_attention", "tree_segments"]
