"""``GET /v1/loads``: the engine's load in SGLang's shape, which model gateways poll (SGLang's ``smg``).

smg's load-aware policies (``least_load``, ``power_of_two``, and ``cache_aware``'s KV-usage spread check)
read a worker's running and waiting requests and KV use from here; without it they see every hydragen
worker as idle. The figures come from the engine's last published snapshot, as /metrics does: "requests"
are sequences (a request with n=4 runs four), and KV tokens in use count pages held by sequences and pages
the prefix cache keeps (``hydragen_kv_pages_used``).
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from hydragen.server.engine_client import EngineClient


def add_loads_route(app: FastAPI, client: EngineClient) -> None:
    @app.get("/v1/loads")
    async def loads():
        snap = client.snapshot()
        used, total = snap.pages_used * snap.page_size, snap.pages_total * snap.page_size
        return {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dp_rank_count": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": snap.running,
                    "num_waiting_reqs": snap.waiting,
                    "num_total_reqs": snap.running + snap.waiting,
                    "num_used_tokens": used,
                    "max_total_num_tokens": total,
                    "token_usage": used / total if total else 0.0,
                    "gen_throughput": client.tokens_per_second,
                    "cache_hit_rate": snap.stats.hit_rate,
                    "max_running_requests": client.max_num_seqs,
                }
            ],
        }
