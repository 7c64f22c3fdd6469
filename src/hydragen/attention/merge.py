"""Log-sum-exp merge of attention partials.

Attention over a partition of the keys K = K1 || K2 || ... can be computed part by part: each part
gives an output O_i (softmax-normalised within the part) and its log-sum-exp L_i. The exact result is
``L = logsumexp_i L_i`` and ``O = sum_i exp(L_i - L) * O_i``. Empty parts carry ``L_i = -inf`` and
must contribute nothing, so every exp is taken against a finite stand-in for ``L``.
"""

from __future__ import annotations

import torch


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0, so ``exp(-inf - finite) = 0`` instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one partial (out [..., D], lse [...]) into fp32 accumulators, in place.

    The accumulators may be views (slices of a larger batch), which is how tree attention merges a
    node's result into exactly the contiguous range of sequences that share the node.
    """
    new_lse = torch.logaddexp(acc_lse, lse)
    ref = _finite(new_lse)
    w_acc = torch.exp(acc_lse - ref).unsqueeze(-1)
    w_new = torch.exp(lse - ref).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.float() * w_new)
    acc_lse.copy_(new_lse)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partials at once; returns (out fp32, lse fp32)."""
    if not outs:
        raise ValueError("merge_partials needs at least one partial")
    lse_stack = torch.stack([x.float() for x in lses])
    lse = torch.logsumexp(lse_stack, dim=0)
    weights = torch.exp(lse_stack - _finite(lse)).unsqueeze(-1)
    out = (torch.stack([o.float() for o in outs]) * weights).sum(0)
    return out, lse
