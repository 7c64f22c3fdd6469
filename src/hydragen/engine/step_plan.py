"""The data of one engine step: the frozen plan (what each sequence computes, who copies whom, what is read
shared, who was admitted, preempted or failed) and the result of running it.

The scheduler builds the plan; ``execution.run_plan`` runs it (packed forward, sampling) into a result;
the scheduler commits the result's plan after the forward and the output processor appends its tokens.
Everything the forward needs is copied into the plan (page ids, token ids, positions), and nothing
changes a page table or the prefix tree between building a plan and committing it, so the plan cannot
go stale while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydragen.engine.sequence import Request, SequenceState


@dataclass(frozen=True)
class Work:
    """One sequence's part of the step: its tokens are computed into the KV slots of context positions
    [start, start + len(tokens)), reading the context [0, start) computed before.

    ``logit_rows`` asks for the logits of the item's last that many tokens: 0 for none (a prompt chunk
    before the last), 1 for the next token's (the last token ends the context: it is sampled), k + 1 to
    verify k drafted tokens. The last row is sampled as ever; the rows of an item asking for more than one
    come back in ``StepResult.row_logits``.

    ``parents`` makes the item a draft tree (None: an ordinary run of context tokens, token j at position
    start + j seeing the context and tokens 0..j). Token j's parent is ``parents[j]``, an earlier token of
    the item or -1 for the context: it sits at position start + its depth (roots depth 0; the rotary
    position), keeps its own KV slot (that of position start + j in ``pages``) and sees the context
    [0, start) plus its ancestors and itself, nothing else of the tree. A chain (parents -1, 0, 1, ...) is
    an ordinary item. Nothing computed past the context is ever published; the scheduler cuts it back
    with ``KVManager.truncate`` (docs/design.md, "The formats the next issues extend")."""

    seq: SequenceState
    pages: tuple[int, ...]  # the sequence's pages covering positions [0, start + len(tokens))
    start: int
    tokens: tuple[int, ...]
    logit_rows: int  # logits wanted for the last this many tokens; the last one is sampled
    parents: tuple[int, ...] | None = None  # a draft tree: each token's parent in the item, -1 the context

    @property
    def sample(self) -> bool:
        """The last token's logits pick the sequence's next token."""
        return self.logit_rows > 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def verifies(self) -> bool:
        """A chain of drafts to verify: the next token's input then k drafts, each with its row. Every row is
        sampled and the drafts are accepted while they equal the draws (``engine/execution.py``); a tree, or
        an item whose rows do not cover all its tokens, samples its last row only."""
        return 1 < self.logit_rows == len(self.tokens) and self.parents is None


def tree_depths(parents: tuple[int, ...], tokens: int) -> list[int]:
    """Each draft-tree token's depth (0 for a child of the context), or a ValueError unless there is one
    parent per token and each is -1 or an earlier token of the item."""
    if len(parents) != tokens:
        raise ValueError(f"a draft tree needs one parent per token: {len(parents)} parents, {tokens} tokens")
    depths: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft token {j}: parent {p} is neither -1 (the context) nor an earlier token")
        depths.append(depths[p] + 1 if p >= 0 else 0)
    return depths


@dataclass(frozen=True)
class Fork:
    """``seq`` has the same context as ``leader`` (a sibling sample): instead of computing it again it
    samples from the leader's logits, and after the forward takes the leader's KV, sharing its first
    ``shared_pages`` pages and copying the rest into ``reserved`` (pages the scheduler took for it)."""

    seq: SequenceState
    leader: SequenceState
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
class Admission:
    """A sequence that got a seat this step: ``cached_tokens`` of its prompt lie on shared pages (cached, or
    computed by another request; a fork's is its leader's), ``first`` unless it is back after a preemption."""

    seq: SequenceState
    cached_tokens: int
    first: bool


@dataclass
class BatchView:
    """A step's sequences in depth-first order, and its shared runs (page_lo, page_hi, lo, hi) over them."""

    seqs: list[SequenceState]
    shared: list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class StepPlan:
    work: tuple[Work, ...] = ()  # depth-first order of their page tables
    forks: tuple[Fork, ...] = ()
    shared: tuple[SharedRun, ...] = ()
    cuts: tuple[int, ...] = ()  # per work item: pages read through shared runs (a prefix of its table)
    admitted: tuple[Admission, ...] = ()
    preempted: tuple[SequenceState, ...] = ()  # sent back to the queue to make room (their KV stays cached)
    failed: tuple[tuple[Request, str], ...] = ()  # requests that failed while planned, and why

    @property
    def empty(self) -> bool:
        return not self.work

    def view(self) -> BatchView:
        """The work as tests and benchmarks inspect it (``EngineCore.batch``)."""
        runs = [(r.page_lo, r.page_hi, r.lo, r.hi) for r in self.shared]
        return BatchView([w.seq for w in self.work], runs)

    @property
    def samplers(self) -> list[tuple[SequenceState, int]]:
        """(sequence, index of the work item whose logits it samples from), in work order then forks."""
        rows = [(w.seq, i) for i, w in enumerate(self.work) if w.logit_rows]
        index = {w.seq.seq_id: i for i, w in enumerate(self.work)}
        return rows + [(f.seq, index[f.leader.seq_id]) for f in self.forks]

    def without(self, requests: set[str]) -> StepPlan:
        """The plan without the work and forks of these requests (by id): what still runs once their
        forward failed. The shared runs are dropped (they index the full work list)."""
        keep = [i for i, w in enumerate(self.work) if w.seq.request.request_id not in requests]
        return StepPlan(
            tuple(self.work[i] for i in keep),
            tuple(f for f in self.forks if f.seq.request.request_id not in requests),
            (),
            tuple(self.cuts[i] for i in keep) if self.cuts else (),
            self.admitted,
            self.preempted,
            self.failed,
        )


@dataclass(frozen=True)
class StepResult:
    """What running a plan gave: the plan as it ran, each sampling sequence's token, and the requests that
    failed in the forward or in sampling."""

    plan: StepPlan  # without the work and forks of requests whose forward failed
    samplers: tuple[SequenceState, ...] = ()  # the sequences that sampled, in the order of ``tokens``
    # Per sampler, its new tokens: one, or for an item verifying drafts the drafts accepted and the token
    # drawn after them (engine/execution.py), in order.
    tokens: tuple[tuple[int, ...], ...] = ()
    # Per sampler, when its request asked for them, one {token: logprob} per token of its run.
    logprobs: tuple[tuple[dict[int, float], ...] | None, ...] = ()
    failed: tuple[tuple[Request, str], ...] = ()  # requests that failed running, and why
    dropped_forks: tuple[Fork, ...] = ()  # forks of those requests (their reserved pages go back)
    # For a verifier: per work item asking for more than one logits row (``Work.logit_rows`` n > 1), in
    # work order, its sequence and the raw logits [n, V] (fp32, before any constraint mask or temperature)
    # of its last n tokens, row i for token len(tokens) - n + i; the last row is the one sampled above.
    # Views of the forward's output, never copied; empty when no item asks for more than one row.
    row_logits: tuple[tuple[SequenceState, torch.Tensor], ...] = ()
