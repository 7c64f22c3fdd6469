"""What the engine counts while it runs: tokens by kind, time by step kind, KV peak, preemptions.

The benchmarks read these to report prefix-cache hit rates, forced-token shares and memory use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # sum over sequences of prompt length
    prefill_tokens: int = 0  # prompt tokens actually run through the model
    cache_hit_tokens: int = 0  # prompt tokens found already cached when a sequence was scheduled
    generated_tokens: int = 0  # sampled tokens
    forced_tokens: int = 0  # tokens appended by jump-forward (or extend()) without sampling
    forward_tokens: int = 0  # tokens run through the model in all (prefill chunks, decode and extends)
    decode_steps: int = 0
    decode_seconds: float = 0.0  # steps that only decoded
    prefill_seconds: float = 0.0  # steps that also prefilled
    per_sequence_kv_tokens: int = 0  # KV tokens the finished sequences would hold as private copies
    peak_kv_tokens: int = 0  # most KV slots in use at once (whole pages: the memory really taken)
    preemptions: int = 0
    requests_finished: int = 0

    @property
    def shared_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def hit_rate(self) -> float:
        """Prompt tokens whose prefill was skipped / prompt tokens: the prefix-cache hit rate."""
        return self.shared_prompt_tokens / max(self.prompt_tokens, 1)
