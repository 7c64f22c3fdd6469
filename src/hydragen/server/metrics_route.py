"""``GET /metrics``: the engine's gauges and counters and the request latencies, as Prometheus text."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from hydragen.server.engine_client import EngineClient
from hydragen.server.metrics import LatencyMetrics, exposition


def add_metrics_route(app: FastAPI, client: EngineClient, metrics: LatencyMetrics) -> None:
    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics_text(client, metrics), media_type="text/plain; version=0.0.4")


def metrics_text(client: EngineClient, metrics: LatencyMetrics) -> str:
    """From the engine's snapshot, published by its thread after every step: never the live state."""
    snap = client.snapshot()
    st, unavailable = snap.stats, client.unavailable()
    rows = [
        (
            "hydragen_requests_running",
            "gauge",
            "sequences holding KV pages (decoding or prefilling)",
            snap.running,
        ),
        ("hydragen_requests_waiting", "gauge", "sequences waiting for admission", snap.waiting),
        (
            "hydragen_kv_pages_used",
            "gauge",
            f"KV pages in use, held or cached ({snap.page_size} tokens a page)",
            snap.pages_used,
        ),
        ("hydragen_kv_pages_free", "gauge", "free KV pages", snap.pages_total - snap.pages_used),
        ("hydragen_kv_pages_peak", "gauge", "most KV pages in use at once since start", snap.pages_peak),
        ("hydragen_kv_page_size", "gauge", "tokens a KV page holds", snap.page_size),
        (
            "hydragen_prefix_cache_tokens",
            "gauge",
            "tokens held by the prefix tree (whole pages)",
            snap.pages_cached * snap.page_size,
        ),
        ("hydragen_prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens", st.hit_rate),
        (
            "hydragen_prefix_cache_unreachable_pages",
            "gauge",
            "cached pages no hit can use: their sliding windows' pages are gone (0 without windows)",
            snap.unreachable_pages,
        ),
        (
            "hydragen_generation_tokens_per_second",
            "gauge",
            "decode rate over the last 5 s",
            client.tokens_per_second,
        ),
        (
            "hydragen_engine_healthy",
            "gauge",
            "1 while the engine takes requests",
            unavailable is None,
        ),
        (
            "hydragen_engine_restarting",
            "gauge",
            "1 while the engine is rebuilt after its tensor-parallel group broke",
            unavailable is not None and unavailable.code == "engine_restarting",
        ),
        (
            "hydragen_engine_restarts_total",
            "counter",
            "tries to rebuild the engine after its tensor-parallel group broke (failed ones included)",
            client.restart_count,
        ),
        (
            "hydragen_prompt_tokens_total",
            "counter",
            "prompt tokens of admitted sequences",
            st.prompt_tokens,
        ),
        ("hydragen_prefill_tokens_total", "counter", "prompt tokens computed", st.prefill_tokens),
        ("hydragen_generation_tokens_total", "counter", "generated tokens", st.generated_tokens),
        ("hydragen_requests_finished_total", "counter", "finished requests", st.requests_finished),
        (
            "hydragen_requests_failed_total",
            "counter",
            "requests ended by an engine error",
            metrics.failed,
        ),
        ("hydragen_preemptions_total", "counter", "sequences preempted for memory", st.preemptions),
    ]
    if snap.speculation is not None:
        rows += speculation_rows(snap.speculation)
    return exposition(rows, metrics)


def speculation_rows(m) -> list[tuple]:
    """Speculative decoding's counters under vLLM's names (``vllm:spec_decode_*``, here ``hydragen_``)."""
    per = dict(enumerate(m.accepted_per_position))
    return [
        ("hydragen_spec_decode_num_drafts", "counter", "verifications of drafted tokens", m.drafts),
        ("hydragen_spec_decode_num_draft_tokens", "counter", "drafted tokens verified", m.draft_tokens),
        ("hydragen_spec_decode_num_accepted_tokens", "counter", "drafted tokens accepted", m.accepted_tokens),
        (
            "hydragen_spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "drafted tokens accepted at each draft position (0: the first draft)",
            ("position", per),
        ),
        (
            "hydragen_spec_decode_steps",
            "counter",
            "steps with decoding sequences that could speculate",
            m.steps,
        ),
        ("hydragen_spec_decode_speculated_steps", "counter", "steps verifying drafts", m.speculated_steps),
    ]
