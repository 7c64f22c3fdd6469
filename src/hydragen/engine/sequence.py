"""Request and Sequence state, shared by the scheduler, KV manager, runner and output processor."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydragen.engine.sampling_params import SamplingParams
from hydragen.kv.pool import Runs
from hydragen.kv.radix import Node


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when admitted
    error: str | None = None
    private_tree: object | None = None  # sharing off: the request's own throwaway tree
    arrival_time: float = 0.0
    first_scheduled: float | None = None  # time.monotonic() when the scheduler first took a sequence

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    """One sample of a request.

    Its context is prompt + generated. The last ``pending`` context tokens have no KV yet: they are the
    next forward's input (1 for a decode step; more for a multi-token extend). Positions below ``cut``
    are read from shared tree nodes by batched calls; positions from ``cut`` up are read per sequence:
    unshared path nodes in place, then the sequence's own pages (``own_runs``, from ``own_start``).
    """

    request: Request
    index: int
    seed: int
    node: Node | None = None  # tree node where the prefilled context ends (pinned while admitted)
    cut: int = 0
    own_start: int = 0  # position held by own_runs[0]
    own_runs: Runs = field(default_factory=list)  # slot runs this sequence holds (whole pages)
    pending: int = 1
    generated: list[int] = field(default_factory=list)
    forced: int = 0  # generated tokens appended by extend() rather than sampled
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    arrival_step: int = 0  # engine step when it (re-)entered the waiting queue
    join_order: int = 0  # when it joined the running batch (preemption takes the newest first)
    counted: bool = False  # prompt statistics recorded (not again after a preemption)
    preemptions: int = 0
    detok: object | None = None  # the output processor's incremental decoding state
    grammar: object | None = None  # structured outputs: the sequence's GrammarState

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_len(self) -> int:
        """Longest this sequence can get: prompt + max_tokens."""
        return len(self.prompt_ids) + self.request.params.max_tokens

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def computed(self) -> int:
        """Context tokens whose KV exists."""
        return self.context_len - self.pending

    @property
    def tail_len(self) -> int:
        """Computed tokens read per sequence (not through shared nodes)."""
        return self.computed - self.cut

    @property
    def order_key(self) -> tuple:
        """Sorting by the computed context gives depth-first order of the prefix tree."""
        return (self.context[: self.computed], self.request.request_id, self.index)
