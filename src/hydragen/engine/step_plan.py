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

from hydragen.engine.sequence import Request, Sequence


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
class Admission:
    """A sequence that got a seat this step: ``cached_tokens`` of its prompt lie on shared pages (cached, or
    computed by another request; a fork's is its leader's), ``first`` unless it is back after a preemption."""

    seq: Sequence
    cached_tokens: int
    first: bool


@dataclass(frozen=True)
class StepPlan:
    work: tuple[Work, ...] = ()  # depth-first order of their page tables
    forks: tuple[Fork, ...] = ()
    shared: tuple[SharedRun, ...] = ()
    cuts: tuple[int, ...] = ()  # per work item: pages read through shared runs (a prefix of its table)
    admitted: tuple[Admission, ...] = ()
    preempted: tuple[Sequence, ...] = ()  # sent back to the queue to make room (their KV stays cached)
    failed: tuple[tuple[Request, str], ...] = ()  # requests that failed while planned, and why

    @property
    def empty(self) -> bool:
        return not self.work

    @property
    def samplers(self) -> list[tuple[Sequence, int]]:
        """(sequence, index of the work item whose logits it samples from), in work order then forks."""
        rows = [(w.seq, i) for i, w in enumerate(self.work) if w.sample]
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
    samplers: tuple[Sequence, ...] = ()  # the sequences that sampled, in the order of ``tokens``
    tokens: tuple[int, ...] = ()
    logprobs: tuple[dict[int, float] | None, ...] = ()  # per sampler, when its request asked for them
    failed: tuple[tuple[Request, str], ...] = ()  # requests that failed running, and why
    dropped_forks: tuple[Fork, ...] = ()  # forks of those requests (their reserved pages go back)
