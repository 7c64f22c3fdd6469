"""One tensor-parallel step that every rank finishes together, even when one rank's forward raises.

A step's collectives are the same on every rank and follow from the batch alone: 1 + 2 per layer
all-reduces of [tokens, hidden], then one gather on rank 0 of every rank's logits shard (a step that
samples nothing gathers one float per rank instead, its only collective that a step did not have before).

A rank whose forward raises (an error in its own computation: a bad input, out of memory on one chunk)
does not leave the others inside an all-reduce it never joins: it issues the all-reduces it did not reach
with zeros (``ShardedDecoderModel.finish_reduces``), joins the gather with a shard of NaN, and is ready for
the next command. So a worker's gathered shard starting with NaN is how rank 0 learns, at no cost to a
normal step, that the worker may have failed; it then asks the workers (``REPORT``), since a model can
also compute a NaN logit. Every rank's outputs of a failed step are wrong, and rank 0, which alone
decides, discards them: its own error, or a worker's (``RankFailed``), goes to the engine like any failed
forward, which runs each request alone to find the one that fails. The KV the failed step wrote is in that
step's slots only, which those reruns write again or which belong to the failed request's dropped pages.

A collective that fails (``CollectiveError``: a dead, hung or disagreeing rank) cannot be finished
together; it propagates, and the group is down.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hydragen.engine.model_runner import PackedBatch
from hydragen.tp.group import CollectiveError


class RankFailed(RuntimeError):
    """Another rank's forward raised in this step (its error is the message); the group is still in step."""


@dataclass
class StepOutcome:
    logits: torch.Tensor | None  # rank 0: the full logits [R, V] (None elsewhere, or when nothing samples)
    error: BaseException | None = None  # this rank's own failure
    worker_flagged: bool = False  # rank 0: some worker's shard starts with NaN: ask the workers (REPORT)


def run_step(forward: Callable[[PackedBatch], torch.Tensor | None], model, batch: PackedBatch) -> StepOutcome:
    """This rank's part of one step: ``forward(batch)`` (this rank's logits shard, or None when nothing
    samples), finished in step with the other ranks whatever it raises, except a failed collective."""
    group = model.group
    group.issued = 0
    rows = batch.logit_rows.numel()
    try:
        shard, error = forward(batch), None
    except CollectiveError:
        raise
    except BaseException as e:  # noqa: BLE001  this rank's own failure, Ctrl-C included: reported below
        shard, error = None, e
        model.finish_reduces(batch.input_ids.numel())
    if error is not None:
        shard = torch.full((rows, model.vocab_rows) if rows else (1,), float("nan"), device=group.device)
    elif not rows:
        shard = torch.zeros(1, device=group.device)
    parts = group.gather_to_first(shard)
    if parts is None:
        return StepOutcome(None, error)
    flagged = any(math.isnan(part.view(-1)[0].item()) for part in parts[1:])  # one read a worker
    if error is not None or not rows:
        return StepOutcome(None, error, flagged)
    try:
        return StepOutcome(model.full_logits(parts), None, flagged)
    except Exception as e:  # noqa: BLE001  after the last collective: rank 0's alone, the group is in step
        return StepOutcome(None, e, flagged)
