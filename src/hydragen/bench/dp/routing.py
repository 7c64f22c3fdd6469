"""``hydragen bench dp``: routing policies for data-parallel replicas, measured, then simulated at 8-64.

The workload (``dp.workload``): many tenants with system prompts of 1-2K tokens, many users each, chat
sessions arriving as a Poisson process, multi-turn (a turn sends the history with the answers the server
gave), real clients' settings (temperature, top_p, stop strings, mixed max_tokens). Each replica's KV
cache is sized so that the tenants' system prompts total ``--cache-ratio`` (1.6) times one replica's cache:
one replica cannot hold them all, two can.

For each policy, ``hydragen serve --data-parallel-size 2 --router-policy P`` starts fresh (two replicas of
one core each, the same KV size), the same workload is replayed through the OpenAI client (streaming, so
time to first token is seen), and the replicas' /metrics give the prefix-cache hit rate (prompt tokens found
cached / prompt tokens) and the requests each replica served. Then a replica's service times are measured
(``dp.sim.service_times``) and the router is simulated at 2 (checked against the measurement) and 8-64
replicas (``dp.sim.scale``). ``--simulate DIR`` runs the simulation alone, from a measured run's JSON in DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hydragen.bench.core.common import read_results, say_quick, write_table
from hydragen.bench.core.stats import percentile
from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.hit_rate_ceiling import hit_rate_ceiling
from hydragen.bench.dp.workload import Session, Workload, WorkloadSpec, make_workload, tokenizer_counter

RESULT_NAME = "dp"  # dp.json, dp.md (and dp_sim.json, dp_sim.md)
POLICIES = ("round-robin", "least-loaded", "approx", "cache")
QUICK_SPEC = WorkloadSpec(
    tenants=3, users_per_tenant=2, sessions=4, rate=4.0, system_tokens=(96, 160), max_turns=2,
    continue_p=0.9, think_s=0.1, output_lengths=((4, 0.5), (8, 0.5)),
)  # fmt: skip
COLUMNS = ["policy", "requests", "hit_rate", "output_tok_s", "ttft_p50", "ttft_p99", "per_replica",
           "routed_because", "prompt_tokens", "computed_prompt_tokens", "preemptions", "errors",
           "wall_s"]  # fmt: skip


def say(message: str) -> None:
    print(f"[dp] {message}", file=sys.stderr, flush=True)


# ---- one policy -----------------------------------------------------------------------------------------
async def _turn(client, model: str, messages: list[dict], sampling: dict) -> dict:
    """One streamed chat request: time to first token, the answer's text and its token count."""
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **sampling
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    text.append(choice.delta.content)
    except Exception as e:  # noqa: BLE001  a failed request is counted and reported, never hidden
        return {"error": f"{type(e).__name__}: {e}", "tokens": 0, "text": ""}
    end = time.perf_counter()
    return {
        "ttft": (first or end) - start,
        "tokens": tokens,
        "text": "".join(text),
        "end": end,
        "error": None,
    }


async def _session(client, model: str, w: Workload, s: Session, t0: float, records: list, progress) -> None:
    """A user's chat: each turn after the previous answer and a think time, with the history it got."""
    await asyncio.sleep(max(0.0, t0 + s.start_s - time.perf_counter()))
    answers: list[str] = []
    for k, turn in enumerate(s.turns):
        if k:
            await asyncio.sleep(turn.delay_s)
        r = await _turn(client, model, w.messages(s, k, answers), turn.sampling())
        r.update(session=s.index, turn=k, tenant=s.tenant, max_tokens=turn.max_tokens)
        records.append(r)
        progress()
        if r["error"]:
            return  # the next turn needs this answer
        answers.append(r["text"])


async def replay(url: str, model: str, w: Workload, label: str, max_run_s: float) -> tuple[list[dict], float]:
    """Every session of ``w`` against ``url``; returns the request records and the wall time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    records: list[dict] = []
    done = [0]

    def progress() -> None:
        done[0] += 1
        print(f"\r[dp] {label}: {done[0]}/{w.requests} requests done", end="", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_session(client, model, w, s, t0, records, progress)) for s in w.sessions]
    _, late = await asyncio.wait(tasks, timeout=max_run_s)
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    print(file=sys.stderr)
    if late:
        say(f"{label}: stopped after {max_run_s:.0f} s with {len(late)} sessions unfinished (counted below)")
    await client.close()
    ends = [r["end"] for r in records if r.get("end")]
    return records, (max(ends) if ends else time.perf_counter()) - t0


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The front's /metrics as {(name, sorted labels): value}."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def per_replica(metrics: dict, name: str, replicas: int) -> list[float]:
    """One figure of each replica (summed over its other labels)."""
    return [
        sum(v for (n, labels), v in metrics.items() if n == name and ("replica", str(i)) in labels)
        for i in range(replicas)
    ]


def run_policy(args, w: Workload, policy: str, kv_tokens: int) -> dict:
    from hydragen.bench.serving.server_process import start_server

    extra = ["--data-parallel-size", str(args.replicas), "--router-policy", policy]
    extra += ["--router-balance-bound", str(args.balance_bound)]
    extra += ["--kv-cache-tokens", str(kv_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    say(f"{policy}: starting {args.replicas} replicas ({kv_tokens} KV tokens each)")
    proc, url = start_server(args.model, extra)
    try:
        _wait_replicas(url, args.replicas)
        records, wall = asyncio.run(replay(url, "bench", w, policy, args.max_run_s))
        metrics = scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    n = args.replicas
    prompt = per_replica(metrics, "hydragen_prompt_tokens_total", n)
    rates = per_replica(metrics, "hydragen_prefix_cache_hit_rate", n)
    routed = per_replica(metrics, "hydragen_router_requests_total", n)
    reasons: dict[str, int] = {}
    for (name, labels), v in metrics.items():
        if name == "hydragen_router_requests_total":
            why = dict(labels).get("reason", "?")
            reasons[why] = reasons.get(why, 0) + int(v)
    ok = [r for r in records if not r["error"]]
    ttft = [r["ttft"] for r in ok]
    return {
        "policy": policy,
        "requests": f"{len(ok)}/{w.requests}",
        "hit_rate": sum(p * h for p, h in zip(prompt, rates, strict=True)) / max(sum(prompt), 1),
        "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "per_replica": "/".join(str(int(x)) for x in routed),
        "routed_because": ", ".join(f"{why} {k}" for why, k in sorted(reasons.items())),
        "prompt_tokens": int(sum(prompt)),
        "computed_prompt_tokens": int(sum(per_replica(metrics, "hydragen_prefill_tokens_total", n))),
        "preemptions": int(sum(per_replica(metrics, "hydragen_preemptions_total", n))),
        "errors": len(records) - len(ok),
        "wall_s": wall,
        "records": [{k: v for k, v in r.items() if k not in ("text", "end")} for r in records],
        "error_samples": sorted({r["error"] for r in records if r["error"]})[:5],
    }


def _wait_replicas(url: str, replicas: int, timeout_s: float = 300) -> None:
    """The front answers /health before its replicas are up: wait until all of them are healthy."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        healthy = scrape(url).get(("hydragen_dp_replicas_healthy", ()), 0)
        if healthy >= replicas:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replicas were not healthy within {timeout_s:.0f} s")


# ---- the whole benchmark --------------------------------------------------------------------------------
def workload_for(args) -> Workload:
    spec = QUICK_SPEC if args.quick else WorkloadSpec(
        tenants=args.tenants, users_per_tenant=args.users_per_tenant, sessions=args.sessions, rate=args.rate,
        max_turns=args.max_turns, think_s=args.think_s, seed=args.seed,
    )  # fmt: skip
    return make_workload(spec, tokenizer_counter(args.model))


def kv_tokens_for(w: Workload, ratio: float, page_size: int = 16) -> int:
    """One replica's KV cache: the tenants' system prompts total ``ratio`` times it (whole pages)."""
    return max(page_size, int(w.stats["system_tokens_total"] / ratio) // page_size * page_size)


def run(args) -> list[dict]:
    if args.quick:
        say_quick("dp")
    from hydragen.bench.dp.sim.scale import simulate_all
    from hydragen.bench.dp.sim.service_times import calibrate
    from hydragen.bench.dp.sim.simulation import ServiceModel

    if args.simulate:  # the simulation alone, from a measured run's JSON
        out = Path(args.simulate)
        previous = read_results(out, RESULT_NAME)
        rows, params, args.quick = previous["rows"], previous["params"], previous["quick"]
        args.replicas = params["replicas"]
        w = make_workload(spec_from(params["workload"]), tokenizer_counter(args.model))
        service = ServiceModel(**params["calibration"]["service"])
    else:
        out = Path(args.out)
        w = workload_for(args)
        kv = kv_tokens_for(w, args.cache_ratio)
        st = w.stats
        total = st["system_tokens_total"]
        say(
            f"workload: {len(w.tenants)} tenants, system prompts {st['system_tokens_min']}-"
            f"{st['system_tokens_max']} tokens ({total} in all = {total / kv:.2f} x one replica's KV cache "
            f"of {kv}), {len(w.sessions)} sessions ({st['multi_turn_sessions']} multi-turn), {w.requests} "
            f"requests, {st['distinct_users']} users"
        )
        rows = []
        for policy in args.policies:
            rows.append(run_policy(args, w, policy, kv))
            r = rows[-1]
            say(
                f"{policy}: hit rate {r['hit_rate']:.2f}, {r['output_tok_s']:.1f} output tok/s, TTFT p50 "
                f"{r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, per replica {r['per_replica']}"
            )
        service, calibration = calibrate(w, args.model, threads=1, quick=args.quick)
        answers = answer_lengths(rows)
        ceiling = hit_rate_ceiling(w, ChatTokens.for_model(args.model, w, answers))
        say(f"hit-rate ceiling of this workload (no router can exceed it): {ceiling:.3f}")
        params = {
            "workload": {**asdict(w.spec), **st},
            "kv_cache_tokens": kv,
            "cache_ratio": args.cache_ratio,
            "replicas": args.replicas,
            "threads_per_replica": 1,
            "balance_bound": args.balance_bound,
            "calibration": calibration,
            "answer_tokens": answers,
            "hit_rate_ceiling": ceiling,
        }
        print(
            write_table(
                rows,
                COLUMNS,
                out,
                RESULT_NAME,
                title(w, kv, args.replicas),
                notes(rows, ceiling),
                quick=args.quick,
                quick_note="a few requests of 4-8 tokens on toy prompts: rates and latencies are start-up "
                "and HTTP noise; the run checks that every policy serves the workload and the figures are "
                "collected.",
                params=params,
            )
        )
    if not args.no_simulate:
        simulate_all(args, w, service, params, out)
    for path in plots(read_results(out, RESULT_NAME), out):
        say(f"plot: {path}")
    return rows


def spec_from(saved: dict) -> WorkloadSpec:
    """The workload spec a run saved in its JSON (lists back to tuples)."""
    fields = {k: saved[k] for k in WorkloadSpec.__dataclass_fields__ if k in saved}
    fields["system_tokens"] = tuple(fields["system_tokens"])
    fields["output_lengths"] = tuple(tuple(x) for x in fields["output_lengths"])
    return WorkloadSpec(**fields)


def answer_lengths(rows: list[dict]) -> dict[str, float]:
    """Mean answer length by max_tokens over every policy's requests (the simulation's answers)."""
    by: dict[int, list[int]] = {}
    for row in rows:
        for r in row.get("records", []):
            if not r["error"]:
                by.setdefault(r["max_tokens"], []).append(r["tokens"])
    return {str(k): sum(v) / len(v) for k, v in sorted(by.items())}


def title(w: Workload, kv: int, replicas: int) -> str:
    st = w.stats
    return (
        f"Routing {replicas} replicas (1 core, {kv} KV tokens each): {len(w.tenants)} tenants' system "
        f"prompts of {st['system_tokens_min']}-{st['system_tokens_max']} tokens "
        f"({st['system_tokens_total'] / kv:.1f}x one cache), {len(w.sessions)} chats ({w.requests} requests) "
        f"arriving at {w.spec.rate}/s"
    )


def notes(rows: list[dict], ceiling: float | None = None) -> str:
    """Units, each policy against round-robin (the issue's targets), and the most any router could do."""
    lines = [
        "hit_rate: prompt tokens found in the prefix cache / prompt tokens (replicas' /metrics); "
        "output_tok_s: output tokens / wall time; ttft in seconds (client-side, streaming); per_replica: "
        "requests routed to each replica; routed_because: the router's reasons (cache: longest cached match; "
        "balance: the best match was overloaded; no-match: nothing cached anywhere; or the policy's name); "
        "computed_prompt_tokens: prompt tokens the replicas ran through "
        "the model."
    ]
    base = next((r for r in rows if r["policy"] == "round-robin"), None)
    if base and base["output_tok_s"] > 0 and base["hit_rate"] > 0:
        for r in rows:
            if r is not base:
                speed = r["output_tok_s"] / base["output_tok_s"]
                hits = r["hit_rate"] / base["hit_rate"]
                lines.append(f"{r['policy']} vs round-robin: {speed:.2f}x throughput, {hits:.2f}x hit rate")
    if ceiling is not None:
        line = (
            f"hit-rate ceiling: {ceiling:.3f}, what one unbounded cache that saw every earlier request would "
            "hit (bench/dp/hit_rate_ceiling.py); no router on any number of replicas exceeds it"
        )
        if base and base["hit_rate"] > 0:
            line += f", so none can exceed {ceiling / base['hit_rate']:.2f}x round-robin's hit rate here"
        lines.append(line)
    for r in rows:
        if r["errors"]:
            lines.append(f"{r['policy']}: {r['errors']} failed requests, e.g. {r['error_samples'][0]}")
    return "\n\n".join(lines)


def plots(data: dict, out: Path) -> list[Path]:
    from hydragen.bench.dp.plots import plots as draw

    return draw(data, out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    p.add_argument("--model", default=None)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated ({','.join(POLICIES)})")
    p.add_argument("--replicas", type=int, default=2, help="replicas measured (2, one core each)")
    p.add_argument("--cache-ratio", type=float, default=1.6,
                   help="tenants' system prompts / one replica's KV cache (1.6)")  # fmt: skip
    p.add_argument("--tenants", type=int, default=d.tenants, help=f"({d.tenants})")
    p.add_argument("--users-per-tenant", type=int, default=d.users_per_tenant, help=f"({d.users_per_tenant})")
    p.add_argument("--sessions", type=int, default=72, help="chat sessions (72)")
    p.add_argument("--rate", type=float, default=1.0, help="sessions started per second, Poisson (1.0)")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help=f"({d.max_turns})")
    p.add_argument("--think-s", type=float, default=d.think_s, help=f"mean think time, s ({d.think_s})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64, help="per replica (64)")
    p.add_argument("--balance-bound", type=int, default=4, help="the router's --router-balance-bound (4)")
    p.add_argument("--max-run-s", type=float, default=600, help="a policy's run is stopped after it (600)")
    p.add_argument("--sim-replicas", default="2,8,16,32,64", help="replica counts simulated (2,8,16,32,64)")
    p.add_argument(
        "--simulate",
        metavar="DIR",
        default=None,
        help="only the simulation, from a run's DIR/dp.json (into DIR)",
    )
    p.add_argument("--no-simulate", action="store_true", help="skip the simulation")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", default="bench-out")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench dp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies takes some of {', '.join(POLICIES)}; got {args.policies}")
    try:
        args.sim_replicas = [int(x) for x in args.sim_replicas.split(",")]
    except ValueError:
        p.error(f"--sim-replicas takes comma-separated integers, got {args.sim_replicas!r}")
    if args.quick:
        args.sim_replicas = [2, 4]
    run(args)


if __name__ == "__main__":
    main()
