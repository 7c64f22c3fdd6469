"""Running a step's plan: the packed forward, then one sampling call, each failure kept to its request.

``run_plan(runner, structured, plan) -> StepResult`` changes no page table, prefix tree or sequence: it
computes. The forward runs the whole plan as one packed batch; if it raises, each request's work runs alone
to find the culprits (``isolation.forward_each_request_alone``), and the result's plan is the rest. Every
sampling row (a fork samples its leader's) is masked by its structured-output constraint and sampled in one
call; rows that cannot be sampled fail their request alone.
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
    rows = {}  # work index -> its row of ``logits`` (one per sampling work item, in plan order)
    for i, w in enumerate(ran.work):
        if w.sample:
            rows[i] = len(rows)
    index = [rows[i] for _, i in samplers]
    if index != list(range(logits.shape[0])):
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
    )


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
