"""Requests and their sequences. A sequence's state comes in parts, each written by one module only:

* ``out`` (:class:`OutputState`): generated tokens, text, logprobs, why it ended: the output processor,
  which alone decides that a sequence (and so a request) is finished;
* ``kv`` (:class:`hydragen.kv.manager.PageTable`): its pages and how much of its context has KV: the KV
  manager, on the scheduler's request;
* ``sched`` (:class:`SchedState`): where it is in the queues and when it got there: the scheduler;
* ``grammar``: its structured-output state: the structured-outputs controller.

A request's ``error`` is the output processor's too; its ``cached_tokens`` and ``first_scheduled`` are the
scheduler's. A sequence is known by ``seq_id`` (a counter of the engine's), a request by ``request_id``:
nothing keys on ``id()``. Everything else reads them through the read-only properties below.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from hydragen.engine.sampler import derive_seed
from hydragen.engine.sampling_params import SamplingParams
from hydragen.kv.manager import PageTable


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState] = field(default_factory=list)
    arrival_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when admitted (the scheduler)
    first_scheduled: float | None = None  # time.monotonic() when it first got a slot (the scheduler)
    error: str | None = None  # why it failed (the output processor)
    cache_salt: str | None = None  # shares cached pages only with requests of the same salt

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


@dataclass(eq=False)
class OutputState:
    """Owned by the output processor."""

    generated: list[int] = field(default_factory=list)
    forced: int = 0  # generated tokens appended without sampling (jump-forward, append_forced())
    logprobs: list[dict[int, float | None]] | None = None
    text: str = ""  # final text only: no later token changes it
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    detok: object | None = None  # incremental detokenizer and stop checker
    reported_tokens: int = 0  # generated tokens, text characters and finish already reported (DELTA)
    reported_text: int = 0
    reported_finish: bool = False


class Status(Enum):
    WAITING = "waiting"  # no pages: in the queue
    RUNNING = "running"  # holds a page table; computes its context a chunk per step
    DONE = "done"


@dataclass(eq=False)
class SchedState:
    """Owned by the scheduler."""

    status: Status = Status.WAITING
    arrival_step: int = 0  # step when it (re-)entered the queue (aging)
    admitted: int = 0  # admission order among running sequences: preemption takes the newest first
    preemptions: int = 0
    counted: bool = False  # its prompt's cache hit was counted (not again after a preemption)


@dataclass(eq=False)
class SequenceState:
    """One sample of a request. Its context is prompt + generated; ``kv.computed`` leading positions of
    it hold KV, and the rest (``pending``) is what the next forwards compute."""

    request: Request
    index: int
    seed: int
    seq_id: int  # unique in its engine, never reused
    out: OutputState = field(default_factory=OutputState)
    kv: PageTable = field(default_factory=PageTable)
    sched: SchedState = field(default_factory=SchedState)
    grammar: object | None = None

    # ---- read-only views -------------------------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def generated(self) -> list[int]:
        return self.out.generated

    @property
    def logprobs(self):
        return self.out.logprobs

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def forced(self) -> int:
        return self.out.forced

    @property
    def finish_reason(self) -> str | None:
        return self.out.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.out.stop_reason

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    @property
    def context(self) -> list[int]:
        return self.request.prompt_ids + self.out.generated

    def tokens(self, start: int, end: int) -> list[int]:
        """context[start:end], without building the whole context."""
        prompt = self.request.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        gen = self.out.generated
        if start >= len(prompt):
            return gen[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + gen[: end - len(prompt)]

    @property
    def context_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.out.generated)

    @property
    def computed(self) -> int:
        return self.kv.computed

    @property
    def pending(self) -> int:
        """Context tokens without KV yet: the next forward's input (1 when decoding)."""
        return self.context_len - self.kv.computed

    @property
    def max_len(self) -> int:
        """Longest this sequence can get: prompt + max_tokens."""
        return len(self.request.prompt_ids) + self.request.params.max_tokens


def new_request(
    request_id: str,
    prompt: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    seq_ids: Iterator[int],
    *,
    cache_salt: str | None = None,
) -> Request:
    """A request and its ``params.n`` samples, each seeded from the request's seed (a random one when it has
    none) and numbered by ``seq_ids`` (the engine's counter), each on an empty page table."""
    req = Request(
        request_id, prompt, list(prompt_ids), params, arrival_time=time.perf_counter(), cache_salt=cache_salt
    )
    base_seed = params.seed if params.seed is not None else secrets.randbits(63)
    req.seqs = [
        SequenceState(req, i, derive_seed(base_seed, i), next(seq_ids), kv=PageTable(salt=cache_salt))
        for i in range(params.n)
    ]
    return req
