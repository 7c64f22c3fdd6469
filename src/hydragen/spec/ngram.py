"""Prompt-lookup (n-gram) drafts: what followed the latest earlier occurrence of the context's last n tokens.

Code edits, quotes, summaries and answers drawn from a document repeat their input, so the tokens that
followed the same n tokens last time are a good guess at the next ones. Each sequence's context lives in an
int32 buffer of this proposer's, grown by the tokens appended since the last step (a slice copy, never the
whole context again), and the whole batch is searched in one C++ call (``native/csrc/ngram.cpp``); the
reference below is its twin, used where the ops cannot be built.
"""

from __future__ import annotations

import torch

from hydragen.native.build import ngram_propose_op


def ngram_drafts_reference(
    contexts: list[list[int]], limits: list[int], sources: list[list[int]], min_n: int, max_n: int
) -> list[list[int]]:
    """Per context i, up to ``limits[i]`` tokens that followed the latest occurrence of its last n tokens in
    the contexts ``sources[i]`` names (its own first, where the match must end before its last token), for
    the longest n in [min_n, max_n] that occurs; for one n, the first source that has it. Empty: none."""
    out = []
    for ctx, limit, names in zip(contexts, limits, sources, strict=True):
        drafts: list[int] = []
        for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
            if limit <= 0 or drafts:
                break
            pattern = ctx[len(ctx) - n :]
            for h in names:
                hay = contexts[h]
                hit = next((p for p in range(len(hay) - n - 1, -1, -1) if hay[p : p + n] == pattern), None)
                if hit is not None:
                    drafts = hay[hit + n : hit + n + limit]
                    break
        out.append(drafts)
    return out


class _Buffer:
    """One sequence's context as int32, with room to grow (doubled when full)."""

    __slots__ = ("tokens", "length")

    def __init__(self, context: list[int]):
        self.tokens = torch.empty(max(64, 2 * len(context)), dtype=torch.int32)
        self.tokens[: len(context)] = torch.tensor(context, dtype=torch.int32)
        self.length = len(context)

    def sync(self, seq) -> None:
        """Append the sequence's tokens generated since the last sync."""
        new = seq.context_len - self.length
        if new <= 0:
            return
        if seq.context_len > self.tokens.numel():
            grown = torch.empty(2 * seq.context_len, dtype=torch.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        gen = seq.generated
        self.tokens[self.length : seq.context_len] = torch.tensor(gen[len(gen) - new :], dtype=torch.int32)
        self.length = seq.context_len


class NgramProposer:
    """Drafts for a batch of decoding sequences; keeps each one's context buffer until ``forget``."""

    def __init__(self, min_n: int, max_n: int, native: bool = True):
        self.min_n, self.max_n = min_n, max_n
        self._buffers: dict[int, _Buffer] = {}
        self._op = ngram_propose_op() if native else None

    def propose(
        self, seqs: list, limits: list[int], siblings: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """([B, max(limits)] int32 drafts, -1 padded; each sequence's draft count): ``seqs[i]`` gets at most
        ``limits[i]`` drafts, looked up in its own context and (``siblings``) in those of its request's
        other samples among ``seqs``."""
        buffers = self._buffers
        bufs = []
        for s in seqs:
            b = buffers.get(s.seq_id)
            if b is None:
                b = buffers[s.seq_id] = _Buffer(s.context)
            else:
                b.sync(s)
            bufs.append(b)
        sources = _sources(seqs, siblings)
        if self._op is not None:
            lengths = torch.tensor([b.length for b in bufs], dtype=torch.long)
            width = max(map(len, sources))
            table = torch.tensor([row + [-1] * (width - len(row)) for row in sources], dtype=torch.long)
            contexts = [b.tokens for b in bufs]
            drafts, counts = self._op(contexts, lengths, torch.tensor(limits), table, self.min_n, self.max_n)
            return drafts, counts.tolist()
        found = ngram_drafts_reference(
            [b.tokens[: b.length].tolist() for b in bufs], limits, sources, self.min_n, self.max_n
        )
        width = max(limits, default=0)
        drafts = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, d in enumerate(found):
            drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int32)
        return drafts, [len(d) for d in found]

    def forget(self, seq_ids) -> None:
        """Drop the buffers of sequences that ended."""
        for i in seq_ids:
            self._buffers.pop(i, None)


def _sources(seqs: list, siblings: bool) -> list[list[int]]:
    """Per sequence, the indices of the contexts its drafts are looked up in: its own, then its siblings'."""
    if not siblings:
        return [[i] for i in range(len(seqs))]
    by_request: dict[str, list[int]] = {}
    for i, s in enumerate(seqs):
        by_request.setdefault(s.request.request_id, []).append(i)
    return [[i] + [j for j in by_request[s.request.request_id] if j != i] for i, s in enumerate(seqs)]
