"""Per-request sampling parameters (vLLM-style), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1] (0 disables it)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            bad("logprobs", "must be None or an integer in [0, 20] (number of top alternatives)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
