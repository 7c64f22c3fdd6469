"""Device-side work tables for tree decode attention (the Triton path), built once per decode step.

A decode step's attention is a list of items ``(slot_start, slot_end, i, j)``, one per shared slot run read
by the contiguous sequences [i, j) of the depth-first-ordered batch, plus each sequence's private tail.
The Triton path turns them into fixed tables that three kernels consume with one launch each (per layer),
whatever the shape of the tree:

* ``units`` int64 [U, 5], one row per *work unit* of the shared-node kernel:
  ``(kv_lo, kv_hi, seq_lo, seq_hi, part_row)``. A unit is one KV chunk ``[kv_lo, kv_hi)`` of pool slots
  (absolute; a node's run is contiguous) against the queries of sequences ``[seq_lo, seq_hi)`` times the
  GQA group of query heads: at most ``block_m`` query rows, one tensor-core tile. Long nodes are cut into
  chunks of ``chunk_tokens`` (so a single long shared prefix spreads over the whole GPU, as in
  ChunkAttention's / FastTree's partitioning); wide nodes are cut into several query tiles. Sequence
  ``b`` of the unit writes its partial (o, lse) to row ``part_row + b - seq_lo`` of the partial buffers.
  A row with ``seq_hi == seq_lo`` is padding and does nothing, so the table can live in a fixed-capacity
  buffer (CUDA graphs) with the tail rows zeroed.
* ``seq_ptr`` int32 [B + 1] and ``seq_parts`` int32 [R (+1 pad)]: CSR lists, per sequence, of the partial rows
  that cover it (every shared chunk it reads). The tail kernel (or the merge kernel when tails are split)
  folds them into the sequence's tail result through their log-sum-exp.
* ``tail_pages`` int32 [B, P]: each sequence's private tail as a page table (page i holds tail positions
  [i * page_size, (i + 1) * page_size)), and ``tail_lens`` its length in tokens.

A sliding window (``window=W`` with each sequence's position and each item's first key's position): every
sequence sees keys from position ``seq_first[b]`` = its position - W + 1 on. Each item is cut to begin at the
first key one of its sequences sees, and a (chunk, query tile) unit none of whose sequences sees any of its
keys is left out, before anything is counted: a sliding layer's shared reads are bounded by the window.
``unit_kpos`` [U] gives the position of each unit's first key, so the shared kernel masks each row below
its sequence's bound, and ``tail_lo`` [B] the first tail index each sequence sees (its tail kernel starts
there).

Tables are plain torch tensors: this module does not need Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNIT_FIELDS = 5  # kv_lo, kv_hi, seq_lo, seq_hi, part_row


@dataclass
class TreePlan:
    units: torch.Tensor  # int64 [U, 5]
    seq_ptr: torch.Tensor  # int32 [B + 1]
    seq_parts: torch.Tensor  # int32 [R + 1] (one unread pad entry: kernels never get an empty tensor)
    tail_pages: torch.Tensor  # int32 [B, P]
    page_size: int
    num_parts: int  # R: rows of the shared partial buffers
    tail_splits: int  # tails are cut in this many KV splits (1: merge fused into the tail kernel)
    tail_split_len: int  # tokens per tail split
    block_m: int  # query rows per shared tile (the table was cut for it)
    group: int  # query heads per KV head
    window: int | None = None  # a sliding window (the fields below are set), or None
    unit_kpos: torch.Tensor | None = None  # int64 [U]: the position of each unit's first key
    seq_first: torch.Tensor | None = None  # int64 [B]: the first position each sequence sees
    tail_lo: torch.Tensor | None = None  # int32 [B]: the first tail index each sequence sees

    @property
    def num_units(self) -> int:
        return self.units.shape[0]


def _pow2_at_least(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def build_tree_plan(
    items: list[tuple[int, int, int, int]],
    tail_pages: torch.Tensor,
    page_size: int,
    *,
    group: int,
    num_kv_heads: int,
    tail_cap: int,
    chunk_tokens: int | None = None,
    block_m: int = 64,
    tail_split_len: int | None = None,
    target_programs: int | None = None,
    min_chunk_tokens: int = 256,
    window: int | None = None,
    positions: list[int] | None = None,
    tail_start: list[int] | None = None,
) -> TreePlan:
    """Cut the plan items into work units and the per-sequence merge lists.

    With ``window``, ``positions`` (each sequence's decode position), ``tail_start`` (the position of each
    tail's first token) and a fifth field on every item (the position of its first key) are needed: see the
    module docstring.

    ``chunk_tokens`` fixes the KV chunk of a unit; None halves 1024 until the units give
    ``target_programs`` programs (units x KV heads) or the chunk reaches ``min_chunk_tokens``: long nodes
    are split only as far as needed to fill the GPU, because every chunk writes and re-reads one fp32
    partial per query row (at 64 rows x 256 tokens that is already a quarter of the chunk's bf16 KV bytes).
    ``tail_split_len`` likewise fixes the tail split (None: split tails only when the batch alone does not
    give ``target_programs`` programs, never below 256 tokens a split). ``target_programs`` defaults to
    twice the SM count on CUDA and 1 elsewhere (no splitting: the interpreter gains nothing from it).
    """
    device = tail_pages.device
    b = tail_pages.shape[0]
    block_m = max(block_m, _pow2_at_least(group))
    seqs_per_tile = block_m // group
    if target_programs is None:
        target_programs = 1
        if device.type == "cuda":
            target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count

    seq_first = tail_lo = None
    if window is not None:
        if positions is None or tail_start is None or len(positions) != b or len(tail_start) != b:
            raise ValueError("a window needs each sequence's position and tail start")
        seq_first = [p - window + 1 for p in positions]
        kept = []
        for start, end, i, j, pos in items:  # less the leading keys none of its sequences sees
            cut = min(max(0, min(seq_first[i:j]) - pos), end - start)
            if start + cut < end:
                kept.append((start + cut, end, i, j, pos + cut))
        items = kept
        tail_lo = [max(0, f - t) for f, t in zip(seq_first, tail_start, strict=True)]
    else:
        items = [(start, end, i, j, 0) for start, end, i, j, *_ in items]

    def programs(chunk: int) -> int:
        return num_kv_heads * sum(
            math.ceil((e - s) / chunk) * math.ceil((j - i) / seqs_per_tile) for s, e, i, j, _ in items
        )

    if chunk_tokens is None:
        chunk_tokens = 1024
        while chunk_tokens > min_chunk_tokens and programs(chunk_tokens) < target_programs:
            chunk_tokens //= 2
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")

    units: list[tuple[int, int, int, int, int]] = []
    unit_kpos: list[int] = []
    part_seq: list[torch.Tensor] = []  # per unit, the sequences of its partial rows
    rows = 0
    for start, end, i, j, pos in items:
        for lo in range(start, end, chunk_tokens):
            hi = min(lo + chunk_tokens, end)
            for s0 in range(i, j, seqs_per_tile):
                s1 = min(s0 + seqs_per_tile, j)
                at = lo
                if seq_first is not None:  # from the first key of the chunk this tile's sequences see
                    at = lo + max(0, min(seq_first[s0:s1]) - (pos + lo - start))
                    if at >= hi:
                        continue
                units.append((at, hi, s0, s1, rows))
                unit_kpos.append(pos + at - start)
                part_seq.append(torch.arange(s0, s1))
                rows += s1 - s0
    # CSR by sequence: partial rows are numbered in unit order; a stable sort groups them by sequence.
    owners = torch.cat(part_seq) if part_seq else torch.zeros(0, dtype=torch.long)
    long = dict(dtype=torch.int64)
    order = torch.sort(owners, stable=True).indices
    counts = torch.bincount(owners, minlength=b)
    seq_ptr = torch.zeros(b + 1, dtype=torch.int32)
    seq_ptr[1:] = torch.cumsum(counts, 0)

    if tail_split_len is None:
        splits = 1
        if b * num_kv_heads < target_programs:
            splits = min(math.ceil(target_programs / max(b * num_kv_heads, 1)), math.ceil(tail_cap / 256))
        splits = max(splits, 1)
        tail_split_len = math.ceil(max(tail_cap, 1) / splits)
    splits = max(1, math.ceil(tail_cap / tail_split_len))
    unit_tensor = torch.tensor(units, dtype=torch.int64).view(-1, UNIT_FIELDS)
    return TreePlan(
        units=unit_tensor.to(device),
        seq_ptr=seq_ptr.to(device),
        seq_parts=torch.cat([order, order.new_zeros(1)]).to(torch.int32).to(device),  # never empty
        tail_pages=tail_pages.to(torch.int32),
        page_size=page_size,
        num_parts=rows,
        tail_splits=splits,
        tail_split_len=tail_split_len,
        block_m=block_m,
        group=group,
        window=window,
        unit_kpos=torch.tensor(unit_kpos, **long).to(device) if window is not None else None,
        seq_first=torch.tensor(seq_first, **long).to(device) if window is not None else None,
        tail_lo=torch.tensor(tail_lo, dtype=torch.int32).to(device) if window is not None else None,
    )
