"""The simulation part of ``bench dp``: the router at 2 replicas (against the measurement) and at 8-64.

The workload grows with the replicas: tenants, sessions and the arrival rate scale by replicas / 2, each
replica keeps the measured replica's KV cache and service times, so every deployment has the same load
per replica and the tenants' prompts always fill 80 % of all caches together (1.6x one). Answers have the
mean length the real runs produced for each ``max_tokens``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from hydragen.bench.core.common import write_table
from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.hit_rate_ceiling import hit_rate_ceiling
from hydragen.bench.dp.sim.simulation import ServiceModel, Simulation
from hydragen.bench.dp.workload import Workload, make_workload

RESULT_NAME = "dp_sim"
POLICIES = ("round-robin", "least-loaded", "approx", "cache")
COLUMNS = ["part", "replicas", "policy", "balance_bound", "requests", "failed", "hit_rate", "output_tok_s",
           "ttft_p50", "ttft_p99", "requests_max_over_mean", "busy_max_over_mean", "balance_routed",
           "prefill_tokens", "wall_s"]  # fmt: skip
BOUNDS = (1, 2, 4, 8, 16, 32)


def scaled(w: Workload, replicas: int, measured: int, count_tokens) -> Workload:
    """``w`` grown by replicas / measured (the same workload when they are equal)."""
    if replicas == measured:
        return w
    f = replicas / measured
    spec = replace(
        w.spec, tenants=round(w.spec.tenants * f), sessions=round(w.spec.sessions * f), rate=w.spec.rate * f
    )
    return make_workload(spec, count_tokens)


def simulate_all(args, w: Workload, service: ServiceModel, params: dict, out: Path) -> list[dict]:
    base = ChatTokens.for_model(args.model, w, params["answer_tokens"])
    encode, answer_len = base.encode, base.answer_len
    kv = params["kv_cache_tokens"]
    bound = params.get("balance_bound", 4)
    count = lambda text: len(encode(text))  # noqa: E731
    rows = []
    ceilings = {}  # replicas -> the scaled workload's hit-rate ceiling (hit_rate_ceiling)

    def one(wn: Workload, tokens: ChatTokens, n: int, policy: str, b: int, part: str) -> None:
        t0 = time.perf_counter()
        f = Simulation(
            wn, tokens, n, policy, service, kv, max_num_seqs=args.max_num_seqs, balance_bound=b
        ).run()
        reasons: dict[str, int] = {}
        for r in f.pop("routed"):
            for why, k in r.items():
                reasons[why] = reasons.get(why, 0) + k
        rows.append({"part": part, "balance_bound": b, **f, "balance_routed": reasons.get("balance", 0)})
        print(
            f"[dp] simulated {n} replicas, {policy} (balance bound {b}): hit rate {f['hit_rate']:.2f}, "
            f"{f['output_tok_s']:.0f} tok/s, TTFT p99 {f['ttft_p99']:.1f} s, busiest replica "
            f"{f['requests_max_over_mean']:.2f}x the mean requests ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    for n in args.sim_replicas:
        wn = scaled(w, n, args.replicas, count)
        tokens = ChatTokens(wn, encode, answer_len)
        ceilings[n] = hit_rate_ceiling(wn, tokens)
        print(f"[dp] {n} replicas' workload: no router can hit more than {ceilings[n]:.3f}", file=sys.stderr)
        for policy in POLICIES:
            one(wn, tokens, n, policy, bound, "replicas")
    # The cache policy's one knob, at the largest size: how far the best match may be busier than the
    # least-loaded replica before locality gives way to balance.
    n = max(args.sim_replicas)
    wn = scaled(w, n, args.replicas, count)
    tokens = ChatTokens(wn, encode, answer_len)
    for b in BOUNDS:
        one(wn, tokens, n, "cache", b, "balance bound")
    sim_params = {"service": vars(service), "answer_tokens": params["answer_tokens"], "kv_cache_tokens": kv,
                  "measured_replicas": args.replicas, "workload": params["workload"],
                  "balance_bound": bound, "hit_rate_ceiling": ceilings}  # fmt: skip
    title = (
        f"Simulated routing at {', '.join(map(str, args.sim_replicas))} replicas ({kv} KV tokens each, the "
        f"measured replica's service times; tenants, chats and arrival rate x replicas / {args.replicas})"
    )
    s = service
    note = (
        f"Service model (measured, 1 thread): {1 / s.prefill_token_s:.0f} prompt tokens/s; a decode step "
        f"{s.decode_step_s * 1e3:.1f} ms + {s.decode_seq_s * 1e3:.2f} ms per request. Part 'replicas': every "
        f"policy at the measured run's balance bound ({bound}); part 'balance bound': the cache policy at "
        f"{max(args.sim_replicas)} replicas with other bounds. requests_max_over_mean: requests routed to "
        "the busiest replica / the mean; busy_max_over_mean likewise for the time it computed; "
        "balance_routed: requests sent away from their best match because it was overloaded. Hit-rate "
        "ceiling (an unbounded cache that saw every earlier request; no router exceeds it): "
        + ", ".join(f"{c:.3f} at {n} replicas" for n, c in ceilings.items())
        + "."
    )
    print(write_table(rows, COLUMNS, out, RESULT_NAME, title, note, quick=args.quick, params=sim_params))
    return rows
