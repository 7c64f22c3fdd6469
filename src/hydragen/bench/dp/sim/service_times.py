"""A replica's service times, measured: what the simulation of ``bench dp`` charges for each engine step.

One replica of ``bench dp`` is one engine on one core. Its step time is measured the way it runs there
(``LLM(threads=1)``, the workload's own system prompts and questions, chat template applied), from the
engine's own step counters: seconds per prompt token in prefill-only steps, and the time of a decode step
at batch sizes 1 to 16, fitted as a fixed part plus a part per decoding request.
"""

from __future__ import annotations

import sys

from hydragen.bench.dp.sim.simulation import ServiceModel
from hydragen.bench.dp.workload import Workload


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs; with one point, the line through the origin."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def calibrate(
    workload: Workload, model: str | None, threads: int = 1, quick: bool = False
) -> tuple[ServiceModel, dict]:
    """Measure prefill and decode step times on one engine with ``threads`` threads; returns the model and
    the raw measurements (for the JSON)."""
    from hydragen import LLM, SamplingParams

    say = lambda m: print(f"[dp] calibrating a replica: {m}", file=sys.stderr, flush=True)  # noqa: E731
    import torch

    longest = max(t.system_tokens for t in workload.tenants) + 1024
    threads_before = torch.get_num_threads()  # LLM(threads=1) sets this process's count: put it back
    llm = LLM(model, threads=threads, kv_cache_tokens=8 * longest, max_num_seqs=64)
    try:
        stats = llm.engine.stats
        sessions = {s.tenant: s for s in workload.sessions}
        tenants = sorted(sessions)[: 1 if quick else 3]
        llm.chat(
            [workload.messages(sessions[tenants[0]], 0, [])],
            SamplingParams(max_tokens=2, temperature=0),
            use_tqdm=False,
        )
        llm.engine.kv.evict_idle()  # the warm-up's pages must not turn the timed prefills into hits
        before = stats.copy()
        say(f"prefill of {len(tenants)} system prompts")
        for t in tenants:  # one at a time: prefill-only steps
            llm.chat([workload.messages(sessions[t], 0, [])], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill_tokens = stats.prefill_tokens - before.prefill_tokens
        prefill_s = (stats.prefill_seconds + stats.mixed_seconds) - (
            before.prefill_seconds + before.mixed_seconds
        )
        tenant = sessions[tenants[0]]
        questions = [s for s in workload.sessions if s.tenant == tenant.tenant] or [tenant]
        batches, steps = ([1, 4], 8) if quick else ([1, 2, 4, 8, 16], 32)
        step_s = []
        for batch in batches:
            say(f"decode at batch {batch}")
            convs = [workload.messages(questions[i % len(questions)], 0, []) for i in range(batch)]
            for i, c in enumerate(convs):  # distinct questions even when the tenant has few sessions
                c[-1] = {"role": "user", "content": f"({i}) {c[-1]['content']}"}
            before = stats.copy()
            llm.chat(
                convs,
                SamplingParams(max_tokens=steps + 1, temperature=0.7, seed=0, ignore_eos=True),
                use_tqdm=False,
            )
            n = stats.decode_steps - before.decode_steps
            step_s.append((stats.decode_seconds - before.decode_seconds) / max(n, 1))
    finally:
        llm.close()
        torch.set_num_threads(threads_before)
    base, per_seq = fit_line([float(b) for b in batches], step_s)
    service = ServiceModel(prefill_s / max(prefill_tokens, 1), max(base, 0.0), max(per_seq, 0.0))
    raw = {
        "threads": threads,
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill_s,
        "decode_batches": batches,
        "decode_step_s": step_s,
        "service": vars(service),
    }
    say(
        f"{1 / service.prefill_token_s:.0f} prompt tokens/s; decode step "
        f"{service.decode_step_s * 1e3:.1f} ms + {service.decode_seq_s * 1e3:.2f} ms per request"
    )
    return service, raw
