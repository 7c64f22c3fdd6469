"""Exact min_p / top_k / top_p sampling without sorting the vocabulary.

The distribution, per row, on p = softmax(logits / temperature), in vLLM's order (its sampler applies
min_p, then top_k, then top_p):

1. min_p: keep tokens with p >= min_p * max(p).
2. top_k: of those, keep tokens whose p is at least the k-th largest p (ties at the k-th value all stay).
3. top_p: renormalise over the survivors S; keep a token when the mass of survivors with strictly larger
   p is below top_p * mass(S). Tokens with equal p stay or go together, so no tie is broken by position.

The draw is an inverse CDF over the kept tokens in ascending token id, driven by a 24-bit uniform.

Steps 1-2 keep a threshold set S = {p >= t}, t = max(min_p * max(p), k-th largest p); the k-th largest
value is found from the k blocks of 64 tokens with the largest maxima. The method then only looks at a
candidate set C = {p >= tau}, located by block maxima (no full-size mask or sort):

- a row restricted by min_p or top_k takes tau = t, so C = S and everything it needs is in C;
- a row with only top_p first takes tau just above its 64th largest block maximum (C then lies in 64
  blocks). C settles the row when it holds top_p of the mass: every token outside C has at least that
  much mass above it. A row it does not settle is redone with tau = f * max(p), f = 1e-3 * (1 - top_p)
  within [1e-7, 1e-4], then f / 100, then with every token.

Only C is read; its masses are summed per level of p (8 levels per octave) to find the level the top_p
cut falls in, and only that level's tokens are sorted. Masses are fixed-point integers (p * 2**36, floored),
so every sum is exact in any order and a row's token never depends on the other rows of the batch. A
token below 2**-36 of the total mass is never drawn; the uniform's 24 bits could not resolve it anyway.

On CPU the rows go to a C++ op (``native/csrc/sampling.cpp``), one thread per row, that takes the same
candidate sets (the first pass's, then, if it falls short, every token) and computes the same masses,
levels and draw in the core's cache: a wide nucleus (a flat distribution, a high temperature) costs the
passes here many retries and large gathers, and the op one more pass. This module is the op's twin where
it cannot be built, and the oracle its tests compare it with.
"""

from __future__ import annotations

import torch

from hydragen.native import build as native_build

BLOCK = 64
MASS_SCALE = 2**36
# A top_p-only row's first pass reads the tokens above its FIRST_K-th best block maximum. Rows it does not
# settle are redone with every token above a floor (relative to the top probability), floors in turn.
FIRST_K = 64


def retry_floors(top_p: torch.Tensor) -> torch.Tensor:
    """[passes, R] floors of the retry passes; the last is 0 (every token).

    The smaller the tail top_p leaves out, the deeper the nucleus reaches: 1e-3 * (1 - top_p), within
    [1e-7, 1e-4], held the nucleus of 97 % (top_p 0.95) to 99 % (top_p 0.9) of the rows the embedded
    model produced at temperature 1 (scripts/bench_sampler.py's logits).
    """
    first = (1e-3 * (1 - top_p)).clamp(1e-7, 1e-4)
    return torch.stack([first, first * 1e-2, torch.zeros_like(first)])


def pad_to_blocks(x: torch.Tensor, fill: float = -1.0) -> torch.Tensor:
    """Pad the vocabulary to a whole number of blocks; the default fill is below every threshold, even 0."""
    extra = -x.shape[1] % BLOCK
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra), value=fill)


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[R, V / BLOCK] maximum of each block of BLOCK tokens (V a multiple of BLOCK)."""
    return x.view(x.shape[0], -1, BLOCK).amax(-1)


def top_values(
    x: torch.Tensor, k: int, maxima: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k)`` for x [R, V] with V a multiple of BLOCK, reading only the k best blocks.

    The k blocks with the largest maxima hold k elements at least as large as any element of another
    block, so the top k values of their union are the top k values of the row.
    """
    rows, width = x.shape
    if k * BLOCK * 4 > width:
        return x.topk(k, dim=-1)
    maxima = block_maxima(x) if maxima is None else maxima
    best = maxima.topk(k, dim=-1).indices  # [R, k]
    flat = (best + torch.arange(rows, device=x.device).unsqueeze(1) * maxima.shape[1]).view(-1)
    gathered = x.view(-1, BLOCK).index_select(0, flat).view(rows, k * BLOCK)
    values, where = gathered.topk(k, dim=-1)
    ids = best.gather(1, where // BLOCK) * BLOCK + where % BLOCK
    return values, ids


def candidates(
    probs: torch.Tensor, maxima: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, p) of every probs[row, token] >= tau[row], row-major with ids ascending.

    A block is read only when its maximum reaches the threshold, so the cost follows the candidates,
    not the vocabulary.
    """
    nblocks = maxima.shape[1]
    hot = (maxima >= tau.unsqueeze(1)).view(-1).nonzero().squeeze(1)  # flat block numbers, row-major
    hot_rows = hot // nblocks
    values = probs.view(-1, BLOCK).index_select(0, hot)  # [H, BLOCK]
    hit = (values >= tau.index_select(0, hot_rows).unsqueeze(1)).view(-1).nonzero().squeeze(1)
    block = hot.index_select(0, hit // BLOCK)
    return block // nblocks, (block % nblocks) * BLOCK + hit % BLOCK, values.view(-1).index_select(0, hit)


def sample_truncated(
    probs: torch.Tensor,
    maxima: torch.Tensor,
    vocab: int,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    bits: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row. probs [R, V'] from :func:`pad_to_blocks` with its :func:`block_maxima`;
    top_k (0 = off) / min_p (0 = off) may be None when no row uses them; bits [R] int64 uniforms in
    [0, 2**24)."""
    pmax = maxima.amax(-1)
    survive = pmax * min_p if min_p is not None else torch.zeros_like(pmax)
    if top_k is not None:
        on = (top_k > 0) & (top_k < vocab)
        if bool(on.any()):
            k = top_k.masked_fill(~on, 1)
            kth = top_values(probs, int(k.max()), maxima)[0].gather(1, k.unsqueeze(1) - 1).squeeze(1)
            survive = torch.where(on, torch.maximum(survive, kth), survive)
    free = survive <= 0  # only top_p: the survivors are the whole vocabulary
    op = _native_op(probs)
    if op is not None:
        return op(probs, maxima.contiguous(), survive.float(), free, top_p.float(), bits)
    # First pass for a free row: every token above the FIRST_K-th largest block maximum. They all lie in
    # the FIRST_K best blocks (a token above it in another block would raise that block's maximum).
    if maxima.shape[1] > FIRST_K:
        first = maxima.topk(FIRST_K, dim=-1).values[:, -1]
        first = torch.nextafter(first, torch.full_like(first, 2.0))
    else:  # a small vocabulary: every token is in the best blocks
        first = torch.zeros_like(pmax)
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    todo = torch.arange(probs.shape[0], device=probs.device)
    floors = retry_floors(top_p)
    for attempt in range(floors.shape[0] + 1):
        args = (probs, maxima, pmax, survive, free, top_p, bits, first)
        if todo.numel() < probs.shape[0]:  # a retry: only the rows whose candidates fell short
            args = tuple(a.index_select(0, todo) for a in args)
        row_probs, row_maxima, row_pmax, row_survive, row_free, row_top_p, row_bits, free_tau = args
        if attempt > 0:
            free_tau = row_pmax * floors[attempt - 1].index_select(0, todo)
        tau = torch.where(row_free, free_tau, row_survive)
        drawn, done = _draw(
            *candidates(row_probs, row_maxima, tau), todo.numel(), row_pmax, row_free, row_top_p, row_bits
        )
        if attempt == floors.shape[0]:  # the last pass read every token
            done = torch.ones_like(done)
        tokens[todo[done]] = drawn[done]
        todo = todo[~done]
        if todo.numel() == 0:
            break
    # A row with NaN probabilities (amax propagates NaN) has no distribution: an impossible token, which the
    # model runner turns into an error for that row alone.
    return torch.where(pmax > 0, tokens, -1)


def _native_op(probs: torch.Tensor):
    """The C++ op when it serves these probabilities (CPU, fp32, dense rows) and builds; else None."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or not probs.is_contiguous():
        return None
    return native_build.sample_truncated_op()


def _draw(
    rows: torch.Tensor,
    ids: torch.Tensor,
    p: torch.Tensor,
    n_rows: int,
    pmax: torch.Tensor,
    free: torch.Tensor,
    top_p: torch.Tensor,
    bits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from candidates (row, id, p), ordered by row then id, that hold each restricted row's
    survivors; returns (token per row, whether the candidates held the row's kept set). A free row's
    survivors are every token, so its candidates hold the kept set when they hold top_p of the mass.

    The top_p cut is found without sorting the candidates: their masses are summed into levels (the
    fp32 exponent and top mantissa bits, ordered like p), levels wholly above or below the cut are
    kept or dropped whole, and only the level the cut falls in is sorted.
    """
    if rows.numel() == 0:  # no candidate in any row: nothing settled
        return torch.zeros_like(bits), torch.zeros_like(free)
    mass = (p.double() * MASS_SCALE).floor_().long()
    # Level 0 holds the top probability; levels grow as p falls (the deepest gathers everything below).
    levels = (_level(pmax).index_select(0, rows) - _level(p)).clamp_max(_LEVELS - 1)
    per_level = torch.bincount(rows * _LEVELS + levels, weights=mass.double(), minlength=n_rows * _LEVELS)
    inclusive = per_level.view(n_rows, _LEVELS).cumsum(1)
    in_c = inclusive[:, -1]  # mass inside C
    limit = top_p.double() * torch.where(free, float(MASS_SCALE), in_c)
    covered = ~free | (in_c >= limit)
    # The cut level: the first whose inclusive mass passes the limit (none: every level is kept).
    passes = inclusive > limit.unsqueeze(1)
    cut_level = torch.where(passes.any(1), passes.int().argmax(1), _LEVELS)
    cut_of = cut_level.index_select(0, rows)
    kept = (levels < cut_of) & (mass > 0)
    at_cut = (levels == cut_of).nonzero().squeeze(1)
    if at_cut.numel():
        kept[at_cut] = _kept_at_cut(rows[at_cut], p[at_cut], mass[at_cut], inclusive, cut_level, limit)

    # Inverse CDF over the kept tokens in ascending token id.
    counts = torch.bincount(rows, minlength=n_rows)
    ends = counts.cumsum(0)
    cdf = (mass * kept).cumsum(0)
    base = torch.where(ends > counts, cdf.index_select(0, (ends - counts - 1).clamp_min(0)), 0)
    target = ((2 * bits + 1) * (cdf.index_select(0, (ends - 1).clamp_min(0)) - base)) >> 25
    pick = torch.searchsorted(cdf, base + target, right=True).clamp_max(cdf.numel() - 1)
    return ids.index_select(0, pick), covered


def _kept_at_cut(
    rows: torch.Tensor,
    p: torch.Tensor,
    mass: torch.Tensor,
    inclusive: torch.Tensor,
    cut_level: torch.Tensor,
    limit: torch.Tensor,
) -> torch.Tensor:
    """Which tokens of the cut level stay: sorted by row then p descending, a token's mass above is the
    levels above plus the larger tokens of its level; tied tokens share the mass above them."""
    key, order = ((rows << 31) | (0x7FFFFFFF - p.view(torch.int32).long())).sort(stable=True)
    sorted_mass = mass.index_select(0, order)
    before = sorted_mass.cumsum(0) - sorted_mass
    position = torch.arange(key.numel(), device=key.device)
    tie_start = torch.ones_like(key, dtype=torch.bool)
    tie_start[1:] = key[1:] != key[:-1]
    tie_start = torch.cummax(torch.where(tie_start, position, 0), 0).values
    sorted_rows = key >> 31
    row_start = torch.ones_like(key, dtype=torch.bool)
    row_start[1:] = sorted_rows[1:] != sorted_rows[:-1]
    row_start = torch.cummax(torch.where(row_start, position, 0), 0).values
    level = cut_level.index_select(0, sorted_rows)
    levels_above = inclusive.view(-1).index_select(0, sorted_rows * _LEVELS + (level - 1).clamp_min(0))
    levels_above = torch.where(level > 0, levels_above, 0.0)
    above = levels_above + (before.index_select(0, tie_start) - before.index_select(0, row_start)).double()
    kept = (sorted_mass > 0) & (above < limit.index_select(0, sorted_rows))
    return torch.empty_like(kept).index_put_((order,), kept)


_LEVEL_SHIFT = 20  # fp32 bits >> 20: exponent and 3 mantissa bits, 8 levels per octave
_LEVELS = 256  # 32 octaves below the top probability; anything deeper shares the last level


def _level(p: torch.Tensor) -> torch.Tensor:
    return (p.view(torch.int32) >> _LEVEL_SHIFT).long()
