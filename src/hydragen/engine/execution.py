"""Running a step's plan: the packed forward, then one sampling call, each failure kept to its request.

``run_plan(runner, structured, plan) -> StepResult`` changes no page table, prefix tree or sequence: it
computes. The forward runs the whole plan as one packed batch; if it raises, each request's work runs alone
to find the culprits (``isolation.forward_each_request_alone``), and the result's plan is the rest. Every
sampling row (a fork samples its leader's) is masked by its structured-output constraint and sampled in one
call; rows that cannot be sampled fail their request alone. An item may ask for the logits of several of its
last tokens (``Work.logit_rows`` k + 1: its last k tokens are drafts to verify): every row is sampled, each
at the step it would have had decoding alone, and the drafts are accepted while they equal those draws
(``_runs``), so the tokens are exactly those of decoding without drafts. Its rows also come back raw in
``StepResult.row_logits``.
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
    seqs, index, offsets = _sampling_rows(ran, samplers, rows, wide)
    if index != list(range(logits.shape[0])):  # always a copy when an item has several rows: they stay raw
        logits = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
    top = max((p.logprobs for s in seqs if (p := s.params).logprobs is not None), default=None)
    structured.mask(logits, seqs)
    sampled = runner.sample(logits, seqs, top, offsets) if wide else runner.sample(logits, seqs, top)
    tokens, lps, row_errors = sampled
    for i, message in row_errors.items():
        req = seqs[i].request
        if req.request_id not in failing:
            failing.add(req.request_id)
            failed.append((req, message))
    runs, run_logprobs = _runs(ran, samplers, tokens.tolist(), lps, bool(wide))
    keep = [i for i, (s, _) in enumerate(samplers) if s.request.request_id not in failing]
    return StepResult(
        ran,
        tuple(samplers[i][0] for i in keep),
        tuple(runs[i] for i in keep),
        tuple(run_logprobs[i] for i in keep),
        tuple(failed),
        tuple(dropped),
        _row_logits(ran, wide, every, failing) if wide else (),
    )


def _sampling_rows(plan: StepPlan, samplers, rows: dict[int, int], wide: list[tuple[int, int]]):
    """The rows to sample, one per sampler but every row of an item verifying drafts: (each row's sequence,
    its row of the forward's logits, its step offset)."""
    if not wide:
        return [s for s, _ in samplers], [rows[i] for _, i in samplers], None
    first = dict(wide)
    seqs, index, offsets = [], [], []
    for s, i in samplers:
        w = plan.work[i]
        if w.verifies and w.seq is s:  # drafts to verify: draft j's row samples step len(generated) + j
            n = w.logit_rows
            seqs += [s] * n
            index += range(first[i], first[i] + n)
            offsets += range(n)
        else:
            seqs.append(s)
            index.append(rows[i])
            offsets.append(0)
    return seqs, index, offsets


def _runs(plan: StepPlan, samplers, tokens: list[int], lps, wide: bool):
    """Each sampler's tokens and their logprobs (None unless its request asked). One token, or for an item
    verifying k drafts d_1..d_k with sampled rows t_0..t_k: t_0..t_j, where j is the first row whose draw
    differs from the draft it checks (t_j is then the draw itself), or k when every draft matches. Each t_i
    is what decoding alone would have drawn there, since d_1..d_i == t_0..t_{i-1} were its context. Without
    ``wide`` items (no drafts this step) every sampler has one row, taken without looking at the work."""
    if not wide:
        runs = [(t,) for t in tokens]
        if lps is None:
            return runs, [None] * len(runs)
        asked = (s.params.logprobs is not None for s, _ in samplers)
        return runs, [(lp,) if a else None for lp, a in zip(lps, asked, strict=True)]
    runs, out_lps, r = [], [], 0
    for s, i in samplers:
        w = plan.work[i]
        n = w.logit_rows if w.verifies and w.seq is s else 1
        drafts = w.tokens[len(w.tokens) - n + 1 :]
        j = 0
        while j < n - 1 and tokens[r + j] == drafts[j]:
            j += 1
        runs.append(tuple(tokens[r : r + j + 1]))
        asked = lps is not None and s.params.logprobs is not None
        out_lps.append(tuple(lps[r : r + j + 1]) if asked else None)
        r += n
    return runs, out_lps


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
