"""The frozen plan of one engine step: what each sequence computes, who copies whom, what is read shared.

The scheduler builds it; the model runner packs and runs it; the scheduler commits it after the forward.
Everything the forward needs is copied into the plan (page ids, token ids, positions), and nothing
changes a page table or the prefix tree between building a plan and committing it, so the plan cannot
go stale while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydragen.engine.sequence import Sequence


@dataclass(frozen=True)
class Work:
    """One sequence's part of the step: context positions [start, start + len(tokens)) are computed."""

    seq: Sequence
    pages: tuple[int, ...]  # the sequence's pages covering positions [0, start + len(tokens))
    start: int
    tokens: tuple[int, ...]
    sample: bool  # the last token ends its context: its logits pick the next token

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Fork:
    """``seq`` has the same context as ``leader`` (a sibling sample): instead of computing it again it
    samples from the leader's logits, and after the forward takes the leader's KV, sharing its first
    ``shared_pages`` pages and copying the rest into ``reserved`` (pages the scheduler took for it)."""

    seq: Sequence
    leader: Sequence
    shared_pages: int
    reserved: tuple[int, ...]


@dataclass(frozen=True)
class SharedRun:
    """Pages [page_lo, page_hi) of the context, identical for the work items [lo, hi) (they hold the same
    pages): read once, by one batched matrix product, for all their query tokens."""

    page_lo: int
    page_hi: int
    lo: int
    hi: int


@dataclass(frozen=True)
class StepPlan:
    work: tuple[Work, ...] = ()  # depth-first order of their page tables
    forks: tuple[Fork, ...] = ()
    shared: tuple[SharedRun, ...] = ()
    cuts: tuple[int, ...] = ()  # per work item: pages read through shared runs (a prefix of its table)

    @property
    def empty(self) -> bool:
        return not self.work

    @property
    def samplers(self) -> list[tuple[Sequence, int]]:
        """(sequence, index of the work item whose logits it samples from), in work order then forks."""
        rows = [(w.seq, i) for i, w in enumerate(self.work) if w.sample]
        index = {id(w.seq): i for i, w in enumerate(self.work)}
        return rows + [(f.seq, index[id(f.leader)]) for f in self.forks]
