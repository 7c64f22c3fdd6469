"""``GET /v1/loads`` (server.loads): the engine's load in SGLang's shape, for model gateways such as smg."""

from __future__ import annotations

import threading
import time

import httpx

from hydragen import LLM
from hydragen.server.options import ServerOptions
from tests.helpers.server_helpers import LiveServer, step_gate, tiny_chat_model


def test_loads_report_running_waiting_and_kv_use(tiny_models, tmp_path):
    llm = LLM(tiny_chat_model(tiny_models["llama"], tmp_path / "tiny"), kv_cache_tokens=1024, max_num_seqs=1)
    live = LiveServer(llm, options=ServerOptions(api_key="k"))
    auth = {"Authorization": "Bearer k"}
    try:
        assert httpx.get(live.url + "/v1/loads").status_code == 401  # a /v1 path: the API key applies
        idle = httpx.get(live.url + "/v1/loads", headers=auth).json()
        assert idle["dp_rank_count"] == 1 and len(idle["loads"]) == 1
        load = idle["loads"][0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (0, 0, 0)
        assert load["max_total_num_tokens"] == 1024 and load["max_running_requests"] == 1

        # n=2 with one seat (max_num_seqs=1): one sequence runs while the other waits.
        body = {"model": "tiny", "prompt": list(range(3, 40)), "max_tokens": 3, "n": 2, "ignore_eos": True}
        done = []
        client = threading.Thread(
            target=lambda: done.append(
                httpx.post(live.url + "/v1/completions", json=body, headers=auth, timeout=60)
            )
        )
        busy = None
        with step_gate(llm.engine) as gate:
            client.start()
            while busy is None and client.is_alive():
                if not gate.wait_at_gate():  # the request has not reached the engine yet
                    time.sleep(0.01)
                    continue
                load = httpx.get(live.url + "/v1/loads", headers=auth).json()["loads"][0]
                if (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 1):
                    busy = load
                else:
                    gate.allow(1)
        client.join(timeout=60)
        assert busy is not None and busy["num_total_reqs"] == 2, "never saw one sequence run and one wait"
        assert [r.status_code for r in done] == [200]
        assert busy["num_used_tokens"] >= 32 and busy["token_usage"] == busy["num_used_tokens"] / 1024
        httpx.post(live.url + "/v1/completions", json={**body, "n": 1}, headers=auth, timeout=60)
        after = httpx.get(live.url + "/v1/loads", headers=auth).json()["loads"][0]
        assert after["num_running_reqs"] == 0 and after["cache_hit_rate"] > 0  # the prompt was cached
    finally:
        live.stop()
