"""The speculator: drafts for a step's decoding sequences, the cost rule over them, and what verification
taught (acceptance per sequence, the metrics).

The scheduler asks it once a step, with the decoding sequences and how many rows the rest of the step
already has (``propose``), and tells it after the forward what each verification accepted (``observe``).
It owns the proposer's per-sequence buffers, each sequence's acceptance counts and the counters; it changes
no page table and no sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hydragen.spec.config import SpeculativeConfig
from hydragen.spec.cost import StepCost, choose
from hydragen.spec.ngram import NgramProposer

PRIOR_WEIGHT = 2.0  # a sequence's acceptance starts at the engine's, worth this many verified positions
START_ACCEPTANCE = 0.5  # the engine's before any verification
MOST_ACCEPTANCE = 0.98  # the rule's estimates stay below 1: a draft's worth must fall with its depth


@dataclass
class SpecMetrics:
    """vLLM's speculative-decoding counters: drafts verified, tokens drafted and accepted, acceptances per
    draft position; and the steps that verified any draft."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps: int = 0  # steps with decoding sequences that could have speculated
    speculated_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step gives a sequence: its accepted drafts plus the token drawn after."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def copy(self) -> SpecMetrics:
        return replace(self, accepted_per_position=list(self.accepted_per_position))

    def since(self, before: SpecMetrics) -> SpecMetrics:
        """What was counted after ``before`` (a copy taken then)."""
        per = [a - b for a, b in zip(self.accepted_per_position, before.accepted_per_position, strict=True)]
        return SpecMetrics(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            per,
            self.steps - before.steps,
            self.speculated_steps - before.speculated_steps,
        )

    def summary(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "speculated_step_share": round(self.speculated_steps / self.steps, 4) if self.steps else 0.0,
        }


class Speculator:
    def __init__(self, config: SpeculativeConfig, cost: StepCost | None, native: bool = True):
        """``cost``: the step's measured cost (None: every draft found is verified, as cost_rule=False)."""
        self.config = config
        self.cost = cost if config.cost_rule else None
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, native)
        self.metrics = SpecMetrics(accepted_per_position=[0] * config.num_speculative_tokens)
        self._seen: dict[int, list[int]] = {}  # seq_id -> [accepted, verified positions]
        self._engine = [0, 0]  # the same, over every sequence
        self._pays: dict[tuple, bool] = {}  # _may_pay's answers

    def propose(self, seqs: list, room: list[int], base_rows: int) -> list[tuple[int, ...]]:
        """Per sequence, the drafts to verify this step (at most ``room[i]``), in a step whose other work is
        ``base_rows`` rows (these sequences' own decode rows included)."""
        if not seqs:
            return []
        self.metrics.steps += 1
        k = self.config.num_speculative_tokens
        limits = [max(0, min(k, r)) for r in room]
        accept = self._acceptance(seqs) if self.cost is not None else None
        if accept is not None and not self._may_pay(len(seqs), max(limits), base_rows, max(accept)):
            return [()] * len(seqs)  # not even every draft found at the best acceptance would pay: no lookup
        drafts, take = self.proposer.propose(seqs, limits, self.config.use_siblings)
        if accept is not None and any(take):
            take = choose(take, accept, base_rows, self.cost)
        if not any(take):
            return [()] * len(seqs)
        self.metrics.speculated_steps += 1
        rows = drafts.tolist()
        return [tuple(rows[i][:n]) for i, n in enumerate(take)]

    def _may_pay(self, batch: int, k: int, base_rows: int, accept: float) -> bool:
        """Whether ``k`` drafts for each of ``batch`` sequences, all accepted with probability ``accept``
        (the best estimate among them), would pay in a step of ``base_rows`` other rows: if not, no subset
        of real drafts pays either (they are fewer and worth less), and the step skips the lookup. Remembered
        per (batch, k, rows, accept rounded up to two places): the answer depends on nothing else."""
        key = (batch, k, base_rows, math.ceil(accept * 100) / 100)  # rounded up: still an upper bound
        known = self._pays.get(key)
        if known is None:
            if len(self._pays) > 4096:
                self._pays.clear()
            known = self._pays[key] = any(choose([k] * batch, [key[3]] * batch, base_rows, self.cost))
        return known

    def _acceptance(self, seqs: list) -> list[float]:
        """Each sequence's estimated chance that a draft is accepted: its own counts, starting from the
        engine's (worth ``PRIOR_WEIGHT`` positions)."""
        a, n = self._engine
        prior = (a + START_ACCEPTANCE * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
        none = (0, 0)
        seen = [self._seen.get(s.seq_id, none) for s in seqs]
        return [min(MOST_ACCEPTANCE, (acc + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)) for acc, t in seen]

    def observe(self, outcomes: list[tuple[int, int, int]]) -> None:
        """(seq_id, drafts verified, drafts accepted) of each verification of a step."""
        m = self.metrics
        for seq_id, drafted, accepted in outcomes:
            tried = accepted + (accepted < drafted)  # positions decided: the accepted ones and the first miss
            seen = self._seen.setdefault(seq_id, [0, 0])
            seen[0] += accepted
            seen[1] += tried
            self._engine[0] += accepted
            self._engine[1] += tried
            m.drafts += 1
            m.draft_tokens += drafted
            m.accepted_tokens += accepted
            for j in range(accepted):
                m.accepted_per_position[j] += 1

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that ended: their buffers and counts go."""
        self.proposer.forget(seq_ids)
        for i in seq_ids:
            self._seen.pop(i, None)
