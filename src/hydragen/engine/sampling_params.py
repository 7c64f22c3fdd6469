"""Per-request sampling parameters (vLLM-style), validated on construction.

Every accepted value must be representable where the engine uses it: integers become int64 tensors and
probabilities/temperatures fp32 tensors, so a value that would overflow, underflow to 0 or turn into
inf/NaN there is refused here with a ``ParamError`` naming the parameter, never discovered mid-step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hydragen.engine.outputs import RequestOutputKind
from hydragen.errors import ParamError

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
FLOAT32_MAX = 3.4028234663852886e38
# Smallest temperature accepted besides 0: the sampler divides logits by it in fp32; below this the
# distribution is a one-hot of the argmax anyway (send 0 for greedy) and 1/T heads towards overflow.
MIN_TEMPERATURE = 1e-6
# Smallest top_p accepted: the smallest normal fp32 number (a smaller top_p rounds towards 0 in fp32,
# where the nucleus would be empty).
MIN_TOP_P = 2.0**-126
MAX_N = 1024  # completions per request (they run in waves when they do not all fit at once)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


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
    structured_outputs: object | None = None  # a hydragen.StructuredOutputsParams: constrain the output
    # vLLM's: leave special tokens out of the text (a tool call's special-token markers need them in)
    skip_special_tokens: bool = True
    # which of EngineCore.step's reports the request gets (streaming: DELTA)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            shown = repr(getattr(self, name))
            if len(shown) > 80:
                shown = shown[:77] + "..."
            raise ParamError(name, f"SamplingParams.{name} {why}, got {shown}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _is_real(self.temperature) or self.temperature < 0 or self.temperature > FLOAT32_MAX:
            bad("temperature", "must be a finite number >= 0 that fits in float32 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            bad("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if not _is_real(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            bad("top_p", "must be in (0, 1] and not round to 0 in float32")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            bad("top_k", "must be an integer >= 0 that fits in int64 (0 disables it)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1] (0 disables it)")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            bad("max_tokens", "must be an integer >= 1 that fits in int64")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                bad("stop", "must be a non-empty string or a list of non-empty strings")
            if len(self.stop) > MAX_STOP_STRINGS:
                bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
            if any(len(s) > MAX_STOP_CHARS for s in self.stop):
                bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters long")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids
            ):
                bad("stop_token_ids", "must be a list of non-negative integers")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if not isinstance(self.skip_special_tokens, bool):
            bad("skip_special_tokens", "must be a bool")
        if self.seed is not None and not (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            bad("seed", "must be None or an integer that fits in int64")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}] (number of top alternatives)")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")
        if self.structured_outputs is not None:
            from hydragen.structured.params import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be None or a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
