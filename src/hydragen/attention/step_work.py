"""How a step is cut into the C++ step-attention op's work items (once per step, in Python).

An item is ``(tok_lo, tok_hi, run_lo, run_hi, first, total, ..., kpos)``: query tokens [tok_lo, tok_hi)
against the concatenation of ``work_runs[run_lo:run_hi]``, token tok_lo + j seeing its first
min(first + j, total) keys (``first`` may be <= 0: such tokens see none of the item's keys). ``kpos`` (last
field) is the position of the item's first key: its keys are at consecutive positions kpos, kpos + 1, ...
Under a sliding window, token t also has a first visible position ``tok_first[t]`` (position - W + 1), so
it sees the item's keys from index tok_first[t] - kpos on (a lower bound per token, as ``first`` is an
upper bound per token): a key is seen when its index lies in [tok_first[t] - kpos, min(first + j, total)).
Two kinds:

* **pieces** write an fp32 partial (output and log-sum-exp) per token, at partial row ``part_row`` on:
  non-causal units, grouped by token range (a node on scattered pages, or a chain of nodes read by the same
  sequences, is one piece per token tile, hence one partial per token); causal units as diagonal squares
  plus the rectangle left of each; when a step is too small to keep every thread busy, shared nodes cut
  into equal key chunks; and every segment's keys before its last multiple of ``SEGMENT_CHUNK_KEYS``, one
  piece per chunk of that many keys (read by attend(), never the tile kernel: ``may_tile`` 0).
  Wide pieces are tiled by tokens, long ones cut by keys, so one big node still spreads over every thread.
* **blocks** cover every token exactly once, read what is left of its segment in place, and fold the
  token's chunks: first the one holding its last key (its own keys, normalised as a piece's partial, or the
  last piece it sees when it has none here), then the partials of every other piece covering it (the CSR
  ``tok_ptr``/``tok_parts``) in key order; and write the output. A segment token's output is so the same
  fold of the same chunks whatever the step holds: a draft verified as a token of a longer segment gets its
  decode row's bits.

Items of each kind are sorted most expensive first, so threads taking them in order finish together.

**Windows cut the work** (``window`` given): a unit, a segment, and then every piece and block is trimmed
to begin at the first key one of its tokens sees (``_cut``), and a piece none of whose tokens sees any of
its keys is dropped, before anything is chunked or counted. So a sliding layer reads, per token tile, at most
the window plus the tile's spread of positions: a decode token's context of 8K keys under a window of 1K is
one chunk of 1K keys (split over the threads as before), a shared run wholly before every window costs
nothing, and a long prefill chunk's causal tiles each read their own band (the rectangle left of a 32-token
diagonal tile is its last W - 1 keys, not the whole context before it). The kernels then mask each token's
remaining keys below its bound (they read keys [0, kmax) of a trimmed item).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TOKENS_PER_BLOCK = 8  # segment tokens per block: they share each K/V row the block reads
PIECE_TOKENS = 32  # query tokens per piece: rows of one matrix product, and several pieces per wide node
MAX_PIECE_KEYS = 2048  # longer key ranges are cut, so one long context still spreads over every thread
# Shared nodes are cut into key chunks only in steps with fewer blocks per thread than this.
SPLIT_BLOCKS_PER_THREAD = 4
# A split node's keys are cut into this many chunks per thread, each of at least MIN_SPLIT_KEYS keys.
SPLIT_CHUNKS_PER_THREAD = 2
MIN_SPLIT_KEYS = 128
# A segment's keys are cut at every multiple of this, in every step: the chunks but the last are pieces that
# any thread may take (one long decode context is read by several threads), and every token folds the same
# chunks in the same order whatever else the step holds, so its output does not depend on the step.
SEGMENT_CHUNK_KEYS = 256
# Pieces go through the tile kernel (matrix products over one KV head, native/csrc/tile_attention.h) from
# this many query rows (tokens x g) and keys on: below, its row tiles are mostly padding, and the op's own
# loop, which reads every KV head of a slot at once, is as fast (scripts/bench_tile_threshold.py; with two
# threads the tile kernel wins from 24 rows and 32 keys, one piece per KV head spreading over the threads).
TILE_MIN_ROWS = 24
TILE_MIN_KEYS = 32
SMALL_STEP_PARTS = 256  # up to this many partial rows, the token -> rows index is built with plain lists
PIECE_FIELDS = 9  # tok_lo, tok_hi, run_lo, run_hi, first, total, part_row, may_tile, kpos (kpos last)
BLOCK_FIELDS = 7  # tok_lo, tok_hi, run_lo, run_hi, first, total, kpos


@dataclass
class StepWork:
    work_runs: Tensor  # int64 [NW, 2]; the segments' own runs come first, in order
    pieces: Tensor  # int64 [NP, 9]: item, first partial row, may_tile (0: a segment's, never tiled), kpos
    blocks: Tensor  # int64 [NB, 7]: item, kpos
    tok_ptr: Tensor  # int64 [T + 1]: token t's partial rows are tok_parts[tok_ptr[t]:tok_ptr[t+1]]
    tok_parts: Tensor  # int64 [R]
    num_parts: int  # R
    max_item_tokens: int


def cut_step(
    units: list[tuple[int, int, int, int, int]],
    segments: list,
    num_tokens: int,
    tok_first: list[int] | None = None,
    unit_pos: list[int] | None = None,
    seg_pos: list[int] | None = None,
) -> StepWork:
    """Work items for validated, normalised units and segments (CPU tensors). With ``tok_first`` (a
    window: each token's first visible position) ``unit_pos`` and ``seg_pos`` give the position of each
    unit's and segment's first key, and the items are trimmed to what their tokens see."""
    work = _WorkItems([run for seg in segments for run in seg[2]], tok_first)
    unit_pos = unit_pos if tok_first is not None else [0] * len(units)
    seg_pos = seg_pos if tok_first is not None else [0] * len(segments)
    blocks = sum(-(-(seg[1] - seg[0]) // TOKENS_PER_BLOCK) for seg in segments)
    threads = torch.get_num_threads()
    small = blocks < SPLIT_BLOCKS_PER_THREAD * threads
    chunks = SPLIT_CHUNKS_PER_THREAD * threads if small else 0  # key chunks of a long shared node
    # token range -> chains of runs it sees whole: [first key's position, runs, next position]. Without a
    # window every unit over the range joins one chain; with one, a unit joins a chain it continues.
    shared: dict[tuple[int, int], list[list]] = {}
    for (kv_lo, kv_hi, tok_lo, tok_hi, causal), pos in zip(units, unit_pos, strict=True):
        if causal:
            work.add_causal(kv_lo, kv_hi, tok_lo, tok_hi, pos)
            continue
        chains = shared.setdefault((tok_lo, tok_hi), [])
        chain = next((c for c in chains if tok_first is None or c[2] == pos), None)
        if chain is None:
            chains.append([pos, [(kv_lo, kv_hi)], pos + kv_hi - kv_lo])
        else:
            chain[1].append((kv_lo, kv_hi))
            chain[2] += kv_hi - kv_lo
    for (tok_lo, tok_hi), chains in shared.items():
        for pos, runs, _ in chains:
            work.add_shared(tok_lo, tok_hi, runs, chunks, pos)
    first_run = 0
    for segment, pos in zip(segments, seg_pos, strict=True):
        work.add_segment(*segment, first_run=first_run, pos=pos)
        first_run += len(segment[2])

    num_parts = work.rows
    if num_parts <= SMALL_STEP_PARTS:  # a handful of partial rows: plain lists beat a dozen tensor ops
        tok_ptr, tok_parts = _token_rows_small(work.pieces, num_tokens)
    else:
        tok_ptr, tok_parts = _token_rows(work.pieces, num_parts, num_tokens)
    return StepWork(
        work_runs=_pairs_tensor(work.runs),
        pieces=torch.tensor(_by_cost(work.pieces), dtype=torch.int64).view(-1, PIECE_FIELDS),
        blocks=torch.tensor(_by_cost(work.blocks), dtype=torch.int64).view(-1, BLOCK_FIELDS),
        tok_ptr=tok_ptr,
        tok_parts=tok_parts,
        num_parts=num_parts,
        max_item_tokens=max((x[1] - x[0] for x in work.pieces + work.blocks), default=0),
    )


def _token_rows(pieces: list[tuple[int, ...]], num_parts: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """The CSR of each token's partial rows (tok_ptr, tok_parts), with tensor ops."""
    table = torch.tensor(pieces, dtype=torch.int64).view(-1, PIECE_FIELDS)
    lens = table[:, 1] - table[:, 0]
    # Partial row p belongs to token owner[p]; a stable sort by owner lists each token's rows in order.
    piece_of_row = torch.repeat_interleave(torch.arange(len(pieces)), lens)
    owner = table[piece_of_row, 0] + torch.arange(num_parts) - table[piece_of_row, 6]
    tok_ptr = torch.zeros(num_tokens + 1, dtype=torch.int64)
    tok_ptr[1:] = torch.cumsum(torch.bincount(owner, minlength=num_tokens), 0)
    return tok_ptr, torch.sort(owner, stable=True).indices


def _token_rows_small(pieces: list[tuple[int, ...]], num_tokens: int) -> tuple[Tensor, Tensor]:
    """_token_rows on Python lists: piece p's partial rows p[6], p[6] + 1, ... belong to its tokens p[0],
    p[0] + 1, ... in order."""
    owner = [0] * sum(p[1] - p[0] for p in pieces)
    for p in pieces:
        owner[p[6] : p[6] + p[1] - p[0]] = range(p[0], p[1])
    counts = [0] * (num_tokens + 1)
    for t in owner:
        counts[t + 1] += 1
    for t in range(num_tokens):
        counts[t + 1] += counts[t]
    order = sorted(range(len(owner)), key=owner.__getitem__)  # stable: a token's rows in order
    return torch.tensor(counts, dtype=torch.int64), torch.tensor(order, dtype=torch.int64)


def _by_cost(items: list[tuple]) -> list[tuple]:
    """Most expensive first (tokens x keys seen by the last token), so the threads finish together."""
    return sorted(items, key=lambda x: -(x[1] - x[0]) * (max(0, min(x[4] + x[1] - x[0] - 1, x[5])) + 1))


def _pairs_tensor(pairs: list[tuple[int, int]]) -> Tensor:
    """[N, 2] int64 from a list of pairs (a flat list converts several times faster than nested ones)."""
    return torch.tensor([x for pair in pairs for x in pair], dtype=torch.int64).view(-1, 2)


def cut_runs(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The slot runs holding keys [lo, hi) of the concatenation of ``runs``."""
    out, pos = [], 0
    for a, b in runs:
        s, e = max(a, a + lo - pos), min(b, a + hi - pos)
        if s < e:
            out.append((s, e))
        pos += b - a
    return out


def _key_chunks(n: int, at_least: int = 1) -> list[int]:
    """Boundaries cutting n keys into near-equal chunks of at most MAX_PIECE_KEYS (and at least
    ``at_least`` chunks while each keeps MIN_SPLIT_KEYS keys)."""
    count = max(1, -(-n // MAX_PIECE_KEYS), min(at_least, n // max(MIN_SPLIT_KEYS, 1)))
    return [n * i // count for i in range(count + 1)]


class _WorkItems:
    """Collects the items; see the module docstring."""

    def __init__(self, segment_runs: list[tuple[int, int]], tok_first: list[int] | None = None):
        self.runs = list(segment_runs)  # the segments' own runs first: uncut segments read them in place
        self.pieces: list[tuple[int, ...]] = []
        self.blocks: list[tuple[int, ...]] = []
        self.rows = 0  # partial rows handed out so far
        self.tok_first = tok_first  # per token, the first position it sees (a window), or None

    def _runs(self, runs: list[tuple[int, int]]) -> tuple[int, int]:
        self.runs += runs
        return len(self.runs) - len(runs), len(self.runs)

    def _cut(self, tok_lo: int, tok_hi: int, total: int, pos: int) -> int:
        """How many leading keys (of ``total``, the first at position ``pos``) no token of [tok_lo, tok_hi)
        sees under the window: 0 without one."""
        if self.tok_first is None or tok_hi <= tok_lo:
            return 0
        return min(max(0, min(self.tok_first[tok_lo:tok_hi]) - pos), total)

    def _seen(self, t0: int, t1: int, first: int, total: int, pos: int) -> bool:
        """Whether some token of [t0, t1) sees a key of the item (``first``, ``total``, at ``pos``)."""
        if min(first + t1 - t0 - 1, total) <= 0:
            return False
        if self.tok_first is None:
            return True
        return any(self.tok_first[t] - pos < min(first + t - t0, total) for t in range(t0, t1))

    def _pieces(
        self, tok_lo: int, tok_hi: int, runs, first: int, total: int, pos: int = 0, may_tile: int = 1
    ) -> None:
        whole = None  # the runs' place in work_runs, for the tiles that read all of them
        for t0 in range(tok_lo, tok_hi, PIECE_TOKENS):
            t1 = min(t0 + PIECE_TOKENS, tok_hi)
            f = first + t0 - tok_lo
            cut = 0 if self.tok_first is None else self._cut(t0, t1, total, pos)
            if not self._seen(t0, t1, f - cut, total - cut, pos + cut):
                continue  # nothing to see (a window puts all of it out of sight)
            if cut:
                r0, r1 = self._runs(cut_runs(runs, cut, total))
            else:
                whole = whole or self._runs(runs)
                r0, r1 = whole
            self.pieces.append((t0, t1, r0, r1, f - cut, total - cut, self.rows, may_tile, pos + cut))
            self.rows += t1 - t0

    def add_shared(
        self, tok_lo: int, tok_hi: int, runs: list[tuple[int, int]], chunks: int = 0, pos: int = 0
    ) -> None:
        """Runs every token of [tok_lo, tok_hi) sees whole. Units over the same tokens (a node split into
        several runs, a chain of nodes) are read as one concatenation (both kernels read keys through their
        runs), so they cost one partial per token and key chunk, not one per run. With ``chunks`` (a step too
        small to keep every thread busy) long runs are cut into that many key chunks: a node read by four
        decode tokens is otherwise one item, read by one thread while the others wait.
        Under a window the keys before the first any token sees go first, then the rest is chunked."""
        total = sum(b - a for a, b in runs)
        cut = self._cut(tok_lo, tok_hi, total, pos)
        if cut:
            runs, total, pos = cut_runs(runs, cut, total), total - cut, pos + cut
        bounds = _key_chunks(total, max(chunks, 1))
        for c0, c1 in zip(bounds, bounds[1:], strict=False):
            self._pieces(tok_lo, tok_hi, cut_runs(runs, c0, c1), c1 - c0, c1 - c0, pos + c0)

    def add_causal(self, kv_lo: int, kv_hi: int, tok_lo: int, tok_hi: int, pos: int = 0) -> None:
        """Token i sees keys 0..i. Per tile [a, b): a causal square on the diagonal, and keys [0, a) to its
        left, which the whole tile sees (under a window, only the band of them its tokens see)."""
        for a in range(0, kv_hi - kv_lo, PIECE_TOKENS):
            b = min(a + PIECE_TOKENS, kv_hi - kv_lo)
            self._pieces(tok_lo + a, tok_lo + b, [(kv_lo + a, kv_lo + b)], 1, b - a, pos + a)
            if a:
                self.add_shared(tok_lo + a, tok_lo + b, [(kv_lo, kv_lo + a)], pos=pos)

    def add_segment(self, tok_lo: int, tok_hi: int, runs, visible: int, first_run: int, pos: int = 0) -> None:
        """Blocks covering every token of the segment. Its keys are cut at every multiple of
        SEGMENT_CHUNK_KEYS (counted from its first key), in every step, each chunk but the last a piece read
        by attend() (never the tile kernel) and the last one the blocks': so a token's keys are folded in the
        same chunks by the same arithmetic whatever the step holds, and a token of a longer segment (a draft
        being verified) gets exactly the output it gets decoding alone (cuts that depended on the step's size
        would break that). Under a window the keys before the first any of its
        tokens sees go first (and each block's own, again)."""
        total = sum(b - a for a, b in runs)
        cut = 0 if self.tok_first is None else self._cut(tok_lo, tok_hi, total, pos)
        if cut:  # the segment's runs less its leading out-of-window keys, read as a whole segment's are
            runs, total, visible, pos = cut_runs(runs, cut, total), total - cut, visible - cut, pos + cut
            first_run = None
        seen_last = min(visible + tok_hi - tok_lo - 1, total)
        bounds = list(range(0, max(seen_last, 1), SEGMENT_CHUNK_KEYS)) + [total]
        for c0, c1 in zip(bounds[:-2], bounds[1:-1], strict=True):  # all but the last chunk: pieces
            j0 = max(0, c0 - visible + 1)  # tokens before this one see none of the chunk's keys
            self._pieces(
                tok_lo + j0, tok_hi, cut_runs(runs, c0, c1), visible + j0 - c0, c1 - c0, pos + c0, may_tile=0
            )
        c0 = bounds[-2]
        rest = cut_runs(runs, c0, total) if c0 or first_run is None else None
        whole = self._runs(rest) if rest is not None else (first_run, first_run + len(runs))
        for t0 in range(tok_lo, tok_hi, TOKENS_PER_BLOCK):
            t1 = min(t0 + TOKENS_PER_BLOCK, tok_hi)
            first, left = visible + t0 - tok_lo - c0, total - c0
            cut = 0 if self.tok_first is None else self._cut(t0, t1, left, pos + c0)  # its tokens' own
            r0, r1 = self._runs(cut_runs(runs if rest is None else rest, cut, left)) if cut else whole
            self.blocks.append((t0, t1, r0, r1, first - cut, left - cut, pos + c0 + cut))
