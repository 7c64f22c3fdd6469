"""Request and Sequence state: what the scheduler, the batch and the output builder share."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydragen.engine.sampling_params import SamplingParams
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
    first_scheduled: float | None = None  # time.monotonic() when the scheduler first took a sequence

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    seed: int
    node: Node | None = None  # tree node where prompt[:-1] ends (pinned while running)
    cut: int = 0  # positions < cut are read from shared tree nodes, the rest from the private tail
    generated: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    row: int = -1  # row of the decode batch's tail block
    arrival_step: int = 0  # engine step when it (re-)entered the waiting queue
    join_order: int = 0  # when it joined the running batch (preemption takes the newest first)
    counted: bool = False  # prompt statistics recorded (not again after a preemption)
    preemptions: int = 0

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
    def tail_len(self) -> int:
        """Tokens in the private tail between steps: positions cut .. len(context) - 2 (the last
        context token is the next step's input, its KV not computed yet)."""
        return len(self.prompt_ids) + len(self.generated) - 1 - self.cut

    @property
    def context(self) -> list[int]:
        """Every token whose KV the sequence needs next step's input for: prompt + generated."""
        return self.prompt_ids + self.generated

    @property
    def order_key(self) -> tuple:
        """Sorting by the cached context gives depth-first order of the prefix tree."""
        return (self.context[:-1], self.request.request_id, self.index)
