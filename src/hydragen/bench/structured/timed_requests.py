"""Requests run through the engine's step loop in waves, each wave to completion, with what ``bench
structured`` reports of a run: throughput per wall and per CPU second, request latency, forced tokens and
the grammar masks' time. Its JSON-extraction workload (``jump_forward``) and its tool-call workload
(``tool_workloads``) both measure through it."""

from __future__ import annotations

import statistics
import time

from hydragen.bench.core.stats import percentile


def timed(llm, requests: list[tuple[list[int], object]], batch: int) -> dict:
    """Run the requests ``batch`` at a time (each wave to completion) on the engine's step loop, timing
    each request's latency on its own. Returns outputs in order and the run's counters."""
    from hydragen.structured.masking import BatchMasker

    engine = llm.engine
    masker: BatchMasker = engine.structured.masker
    masker.reset_timings()
    st = engine.stats
    forced0, steps0 = st.forced_tokens, st.steps
    outputs, latencies = [None] * len(requests), []
    t_start, cpu_start = time.perf_counter(), time.process_time()
    for lo in range(0, len(requests), batch):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()

        def done(out, t0=t0) -> None:  # the one report of a request (output_kind FINAL_ONLY)
            latencies.append(time.perf_counter() - t0)

        wave = range(lo, min(lo + batch, len(requests)))
        reqs = [llm.loop.add(requests[i][0], requests[i][1], on_report=done) for i in wave]
        for i, out in zip(wave, llm.loop.run(reqs), strict=True):
            if out.error:
                raise RuntimeError(out.error)
            outputs[i] = out.outputs[0]
    elapsed = time.perf_counter() - t_start
    cpu = time.process_time() - cpu_start  # this process's CPU time: what other work on the machine
    # (it was shared while measuring) cannot inflate, unlike wall time
    tokens = sum(len(o.token_ids) for o in outputs)
    per_token = [s / r for s, r in zip(masker.seconds, masker.row_counts, strict=True) if r]
    masked_rows = sum(masker.row_counts)
    return {
        "outputs": outputs,
        "time_s": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p99_s": percentile(latencies, 99),
        "forced_fraction": (st.forced_tokens - forced0) / max(tokens, 1),
        "decode_steps": st.steps - steps0,
        "mask_us_per_token_mean": 1e6 * sum(masker.seconds) / masked_rows if masked_rows else float("nan"),
        "mask_us_per_token_p99": 1e6 * percentile(per_token, 99) if per_token else float("nan"),
        "mask_ms_per_step_mean": 1e3 * statistics.fmean(masker.seconds) if masker.seconds else float("nan"),
    }
