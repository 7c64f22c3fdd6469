"""What the engine counts while it runs (tokens by kind, time by step kind, KV peak, preemptions), and the
snapshot it publishes after every step for readers on other threads (the server's /metrics).

A step is a *decode* step when every work item only decodes, forced tokens included (it samples, and starts
past its prompt), a *prefill* step when none does, and *mixed* otherwise; its time and tokens go to that kind.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # sum over admitted sequences of prompt length
    prefill_tokens: int = 0  # prompt positions actually run through the model
    cache_hit_tokens: int = 0  # prompt tokens on shared pages (cached or in flight) at admission
    generated_tokens: int = 0  # tokens sampled and appended (forced ones are counted in forced_tokens)
    forced_tokens: int = 0  # tokens appended by jump-forward (or append_forced()) without sampling
    forward_tokens: int = 0  # tokens run through the model in all (prefill chunks, decodes, forced appends)
    decode_steps: int = 0  # steps of decode work only
    decode_seconds: float = 0.0
    decode_step_tokens: int = 0  # tokens sampled in decode steps
    prefill_steps: int = 0  # steps of prefill work only
    prefill_seconds: float = 0.0
    mixed_steps: int = 0
    mixed_seconds: float = 0.0
    per_sequence_kv_tokens: int = 0  # KV tokens the finished sequences would hold as private copies
    peak_kv_tokens: int = 0  # most KV slots in use at once (whole pages: the memory really taken)
    preemptions: int = 0
    requests_finished: int = 0

    @property
    def steps(self) -> int:
        """Forward steps of any kind."""
        return self.decode_steps + self.prefill_steps + self.mixed_steps

    @property
    def shared_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens: the prefix-cache hit rate."""
        return self.cache_hit_tokens / max(self.prompt_tokens, 1)

    def count(self, plan, result, appended, seconds: float) -> None:
        """One step: its admissions (a prompt counts once, at its first admission), the work that ran, the
        tokens appended."""
        for a in plan.admitted:
            if a.first:
                self.cache_hit_tokens += a.cached_tokens
                self.prompt_tokens += len(a.seq.prompt_ids)
        self.generated_tokens += appended.sampled
        self.forced_tokens += appended.forced
        if not result.plan.empty:
            self.count_work(result.plan, seconds)

    def count_work(self, plan, seconds: float) -> None:
        decoding = prefilling = 0
        for w in plan.work:
            prompt = len(w.seq.prompt_ids)
            self.forward_tokens += len(w.tokens)
            self.prefill_tokens += max(0, min(w.end, prompt) - w.start)
            if w.logit_rows and w.start >= prompt:
                decoding += 1
            else:
                prefilling += 1
        sampled = sum(1 for w in plan.work if w.logit_rows) + len(plan.forks)
        if decoding and not prefilling:
            self.decode_steps += 1
            self.decode_seconds += seconds
            self.decode_step_tokens += sampled
        elif prefilling and not decoding:
            self.prefill_steps += 1
            self.prefill_seconds += seconds
        else:
            self.mixed_steps += 1
            self.mixed_seconds += seconds

    def copy(self) -> EngineStats:
        return replace(self)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after a step, built by the engine thread; other threads read only this."""

    running: int  # sequences holding pages
    waiting: int
    pages_used: int
    pages_peak: int  # most pages in use at once since the start
    pages_cached: int
    pages_total: int
    page_size: int
    stats: EngineStats
    unreachable_pages: int = 0  # cached pages no hit can use (a sliding window's pages gone), <= 2 s old
    speculation: object | None = None  # a copy of the speculator's SpecMetrics (None: speculation off)

    @classmethod
    def of(cls, engine) -> EngineSnapshot:
        sched, usage = engine.scheduler, engine.kv.usage()
        return cls(
            len(sched.running),
            len(sched.waiting),
            usage["used"],
            engine.pool.peak_used,
            usage["cached"],
            usage["total"],
            engine.pool.page_size,
            engine.stats.copy(),
            engine.kv.unreachable_pages(max_age=2.0),
            None if (spec := engine.scheduler.speculator) is None else spec.metrics.copy(),
        )
