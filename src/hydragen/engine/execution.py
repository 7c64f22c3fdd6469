"""Running a step's plan: the packed forward, then one sampling call, each failure kept to its request.

``run_plan(runner, structured, plan) -> StepResult`` changes no page table, prefix tree or sequence: it
computes. The forward runs the whole plan as one packed batch; if it raises, each request's work runs alone
to find the culprits (``isolation.forward_each_request_alone``), and the result's plan is the rest. Every
sampling row (a fork samples its leader's) is masked by its structured-output constraint and sampled in one
call; rows that cannot be sampled fail their request alone. An item may ask for the logits of several of its
last tokens (``Work.logit_rows``, drafts to verify): its last row is sampled as any other, and all its rows
come back raw in ``StepResult.row_logits``.
"""

from __future__ import annotations

import logging

import torch

from hydragen.engine.isolation import forward_each_request_alone
from hydragen.engine.step_plan import StepPlan, StepResult
from hydragen.errors import EngineBroken

log = logging.getLogger("hydragen.engine")


def run_plan(runner, structured, plan: StepPlan) -> StepResult:
    """The result of running ``plan`` on ``runner`` (a ``ModelRunner`` or a tensor-parallel rank 0's);
    ``structured`` masks constrained rows (it reads grammar states, never advances them)."""
    if plan.empty:
        return StepResult(plan)
    logits, ran, failed, dropped = _forward(runner, plan)
    failing = {req.request_id for req, _ in failed}
    samplers = [(s, i) for s, i in ran.samplers if s.request.request_id not in failing]
    if not samplers or logits is None:
        return StepResult(ran, failed=tuple(failed), dropped_forks=tuple(dropped))
    rows = {}  # work index -> its sampled (last) row of ``logits``, when every item has at most one row
    for i, w in enumerate(ran.work):
        if w.logit_rows:
            rows[i] = len(rows)
    wide: list[tuple[int, int]] = []
    if len(rows) != logits.shape[0]:  # an item asks for several rows: a second pass, only then
        rows, wide = _rows_of_wide_items(ran)
    every = logits
    index = [rows[i] for _, i in samplers]
    if index != list(range(logits.shape[0])):  # always a copy when an item has several rows: they stay raw
        logits = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
    seqs = [s for s, _ in samplers]
    top = max((p.logprobs for s in seqs if (p := s.params).logprobs is not None), default=None)
    structured.mask(logits, seqs)
    tokens, lps, row_errors = runner.sample(logits, seqs, top)
    for i, message in row_errors.items():
        req = seqs[i].request
        if req.request_id not in failing:
            failing.add(req.request_id)
            failed.append((req, message))
    keep = [i for i, s in enumerate(seqs) if s.request.request_id not in failing]
    token_list = tokens.tolist()
    return StepResult(
        ran,
        tuple(seqs[i] for i in keep),
        tuple(token_list[i] for i in keep),
        tuple(lps[i] if lps is not None and seqs[i].params.logprobs is not None else None for i in keep),
        tuple(failed),
        tuple(dropped),
        _row_logits(ran, wide, every, failing) if wide else (),
    )


def _rows_of_wide_items(plan: StepPlan) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Each sampling item's last row, and (work index, first row) of the items asking for more than one:
    the forward gives each item its last ``logit_rows`` rows, in work order."""
    rows, wide, r = {}, [], 0
    for i, w in enumerate(plan.work):
        n = w.logit_rows
        if n:
            r += n
            rows[i] = r - 1
            if n > 1:
                wide.append((i, r - n))
    return rows, wide


def _row_logits(plan: StepPlan, wide: list[tuple[int, int]], logits: torch.Tensor, failing: set[str]):
    """StepResult.row_logits: each surviving item's rows, as views of the forward's ``logits``."""
    out = []
    for i, first in wide:
        w = plan.work[i]
        if w.seq.request.request_id not in failing:
            out.append((w.seq, logits[first : first + w.logit_rows]))
    return tuple(out)


def _forward(runner, plan: StepPlan):
    """(logits of the sampling work, the plan that ran, failed requests, forks of failed requests). If the
    batch raises, each request's work runs alone: only the requests that fail alone end (logged), the rest
    of the plan goes on with their logits. If every request of several fails alone, or the engine itself
    broke, it raises (the caller fails everything in flight)."""
    try:
        return runner.forward(runner.pack(plan)), plan, [], []
    except EngineBroken:
        raise
    except Exception as e:
        log.warning("a step failed (%s); running each request alone to find the culprit", e)
        alone = forward_each_request_alone(runner, plan, e)
        return alone.logits, alone.plan, alone.failed, alone.dropped
