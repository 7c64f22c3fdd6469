"""Finding which requests of a step or rows of a batched call failed, so that only their requests end.

When a step's packed forward raises, each request's work runs alone: the requests that fail alone end,
and everyone else's step goes on with its logits (``forward_each_request_alone``).

A decode step samples (and computes log-probabilities for) every running sequence in one batched call.
When that call raises, or returns an impossible token for some rows, the rows are run again one at a time:
the rows that fail alone are the culprits, and only their requests end, with an error naming the stage.
Every other row gets exactly what the batched call would have given it, because sampling is
row-independent and each row is retried with the batch's own flags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hydragen.engine.sequence import Request
from hydragen.engine.step_plan import Fork, StepPlan
from hydragen.errors import EngineBroken


def failure_message(stage: str, exc: BaseException) -> str:
    """One line for the client: the stage that failed and the exception, never a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{stage} failed: {type(exc).__name__}" + (f": {text[:300]}" if text else "")


def _bad_token_rows(tokens: Any, rows: int, vocab: int) -> list[int] | None:
    """Rows holding a token outside [0, vocab); None when the result is not a [rows] integer tensor."""
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (rows,) or tokens.is_floating_point():
        return None
    bad = ((tokens < 0) | (tokens >= vocab)).nonzero().flatten()
    return bad.tolist()


def sample_rows(
    sampler: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    row_args: Sequence[torch.Tensor],
    flags: Sequence[bool],
    vocab: int,
) -> tuple[torch.Tensor, dict[int, str]]:
    """Tokens [B] and {row: error} for the rows that could not be sampled (their token is 0)."""
    rows = logits.shape[0]
    try:
        tokens = sampler(logits, *row_args, *flags)
        bad = _bad_token_rows(tokens, rows, vocab)
    except Exception:
        tokens, bad = None, None
    if bad == []:
        return tokens, {}
    retry = range(rows) if bad is None else bad
    out = torch.zeros(rows, dtype=torch.long, device=logits.device) if bad is None else tokens.long().clone()
    failures: dict[int, str] = {}
    for i in retry:
        try:
            t = sampler(logits[i : i + 1], *(a[i : i + 1] for a in row_args), *flags)
            if _bad_token_rows(t, 1, vocab) != []:
                row = logits[i]  # -inf is a masked token (structured outputs); NaN or +inf is a broken model
                if bool((torch.isnan(row) | torch.isposinf(row)).any()):
                    raise ValueError(
                        "the model computed NaN or infinite logits for this request: its weights hold NaN "
                        "or infinity, or its activations overflowed"
                    )
                raise ValueError(f"the sampler returned an invalid token {t!r}")
            out[i] = t[0]
        except Exception as e:
            failures[i] = failure_message("sampling", e)
    return out, failures


def map_rows(
    batched: Callable[[], list], single: Callable[[int], Any], rows: int, stage: str
) -> tuple[list, dict[int, str]]:
    """``batched()`` (a list of ``rows`` results), or on failure ``single(i)`` row by row."""
    try:
        out = batched()
        if isinstance(out, list) and len(out) == rows:
            return out, {}
    except Exception:
        pass
    results: list = [None] * rows
    failures: dict[int, str] = {}
    for i in range(rows):
        try:
            results[i] = single(i)
        except Exception as e:
            failures[i] = failure_message(stage, e)
    return results, failures


@dataclass
class Isolated:
    logits: torch.Tensor | None  # the surviving work's logits rows (Work.logit_rows each), in plan order
    plan: StepPlan  # the step without the failed requests' work and forks
    failed: list[tuple[Request, str]]  # the requests that fail alone, and why
    dropped: list[Fork]  # forks of failed requests (their reserved pages go back)


def forward_each_request_alone(runner, plan: StepPlan, error: Exception) -> Isolated:
    """Run ``plan``'s work request by request. Raises ``error`` if every request of several fails alone
    (then it is not one request's fault), and ``EngineBroken`` as it comes."""
    by_request: dict[str, list[int]] = {}
    for i, w in enumerate(plan.work):
        by_request.setdefault(w.seq.request.request_id, []).append(i)
    rows: dict[int, torch.Tensor] = {}  # work index -> its logits rows [Work.logit_rows, V]
    failed: dict[str, tuple[Request, str]] = {}
    for rid, indices in by_request.items():
        try:
            logits = runner.forward(runner.pack(StepPlan(tuple(plan.work[i] for i in indices))))
        except EngineBroken:
            raise
        except Exception as e:  # noqa: BLE001  this request's fault: it ends alone
            prefill = any(not plan.work[i].sample or len(plan.work[i].tokens) > 1 for i in indices)
            stage = "prefill" if prefill else "decode"
            failed[rid] = (plan.work[indices[0]].seq.request, failure_message(stage, e))
            continue
        first = 0
        for i in indices:
            n = plan.work[i].logit_rows
            if n:
                rows[i] = logits[first : first + n]
                first += n
    if len(by_request) > 1 and len(failed) == len(by_request):
        raise error
    survivors = plan.without(set(failed))
    kept = (i for i, w in enumerate(plan.work) if w.logit_rows and w.seq.request.request_id not in failed)
    sampled = [rows[i] for i in kept]
    return Isolated(
        torch.cat(sampled) if sampled else None,
        survivors,
        list(failed.values()),
        [f for f in plan.forks if f.seq.request.request_id in failed],
    )
