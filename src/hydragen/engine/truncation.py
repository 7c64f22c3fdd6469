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
- a row with only top_p takes tau = 1e-4 * max(p). It is exact when C already holds top_p of the
  mass: every token outside C has at least that much mass above it. A row where it does not is redone
  with 1e-6 * max(p), then with every token.

Only C is sorted, by (p descending, id ascending). Masses are fixed-point integers (p * 2**36, floored),
so every sum is exact in any order and a row's token never depends on the other rows of the batch. A
token below 2**-36 of the total mass is never drawn; the uniform's 24 bits could not resolve it anyway.
"""

from __future__ import annotations

import torch

BLOCK = 64
MASS_SCALE = 2**36
# Candidate floors (relative to the top probability) for rows with only top_p: the first pass, then the
# passes that redo rows whose candidates fell short. 1e-4 covers the nucleus of over 99 % of the embedded
# model's rows at temperature 1 and top_p 0.95.
FLOORS = (1e-4, 1e-6, 0.0)


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
    blocks = x.view(rows, width // BLOCK, BLOCK)
    gathered = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, BLOCK)).flatten(1)
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
    hot_rows, hot_blocks = (maxima >= tau.unsqueeze(1)).nonzero().unbind(1)
    values = probs.view(probs.shape[0], -1, BLOCK)[hot_rows, hot_blocks]  # [H, BLOCK]
    hit, offset = (values >= tau[hot_rows].unsqueeze(1)).nonzero().unbind(1)
    return hot_rows[hit], hot_blocks[hit] * BLOCK + offset, values[hit, offset]


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
            k = top_k[on]
            every = bool(on.all())
            kth = top_values(probs if every else probs[on], int(k.max()), maxima if every else maxima[on])[0]
            survive[on] = torch.maximum(survive[on], kth.gather(1, (k - 1).unsqueeze(1)).squeeze(1))
    free = survive <= 0  # only top_p: the survivors are the whole vocabulary
    rows = probs.shape[0]
    tokens = torch.empty(rows, dtype=torch.long, device=probs.device)
    todo = torch.arange(rows, device=probs.device)
    for floor in FLOORS:
        args = (probs, maxima, pmax, survive, free, top_p, bits)
        if todo.numel() < rows:  # a retry: only the rows whose candidates fell short
            args = tuple(a[todo] for a in args)
        row_probs, row_maxima, row_pmax, row_survive, row_free, row_top_p, row_bits = args
        tau = torch.where(row_free, row_pmax * floor, row_survive)
        drawn, done = _draw(row_probs, row_maxima, tau, row_free, row_top_p, row_bits, last=floor == 0.0)
        tokens[todo[done]] = drawn[done]
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return tokens


def _draw(
    probs: torch.Tensor,
    maxima: torch.Tensor,
    tau: torch.Tensor,
    free: torch.Tensor,
    top_p: torch.Tensor,
    bits: torch.Tensor,
    last: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate pass: (token per row, whether that row's candidates covered its kept set).

    A restricted row's candidates are exactly its survivors; a free row's survivors are every token.
    """
    rows, ids, p = candidates(probs, maxima, tau)
    counts = torch.bincount(rows, minlength=probs.shape[0])
    ends = counts.cumsum(0)
    starts = ends - counts
    mass = (p.double() * MASS_SCALE).floor_().long()

    # Sorted by row, then p descending, then id ascending (stable): each row's run is [starts, ends).
    key = (rows << 31) | (0x7FFFFFFF - p.view(torch.int32).long())
    order = key.sort(stable=True).indices
    key, sorted_mass, row_of = key[order], mass[order], rows[order]
    inclusive = sorted_mass.cumsum(0)
    exclusive = inclusive - sorted_mass
    position = torch.arange(key.numel(), device=key.device)
    tie_start = torch.ones_like(key, dtype=torch.bool)
    tie_start[1:] = key[1:] != key[:-1]
    tie_start = torch.cummax(torch.where(tie_start, position, 0), 0).values
    row_base = exclusive[starts]
    above = exclusive[tie_start] - row_base[row_of]  # survivor mass strictly above this token's p
    in_c = inclusive[ends - 1] - row_base  # mass inside C
    total = torch.where(free, torch.full_like(in_c, MASS_SCALE), in_c)
    limit = top_p.double() * total.double()
    kept = (sorted_mass > 0) & (above.double() < limit[row_of])
    done = torch.ones_like(free) if last else ~free | (in_c.double() >= limit)

    # Inverse CDF over the kept tokens in ascending token id.
    kept_by_id = torch.empty_like(kept)
    kept_by_id[order] = kept
    cdf = (mass * kept_by_id).cumsum(0)
    base = torch.where(starts > 0, cdf[(starts - 1).clamp_min(0)], 0)
    target = ((2 * bits + 1) * (cdf[ends - 1] - base)) >> 25
    pick = torch.searchsorted(cdf, base + target, right=True).clamp_max(cdf.numel() - 1)
    return ids[pick], done
