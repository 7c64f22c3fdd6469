"""Serving benchmark in the style of SGLang's "generated shared prefix" workload, over HTTP.

G groups x R requests per group; each group has its own system prompt of S tokens, each request a
question of Q tokens and O output tokens; requests arrive as a Poisson process of the given rate. The
benchmark starts `hydragen serve` itself (prefix cache on, and with --no-sharing off) unless --url is
given, streams every request, and reports throughput, time-to-first-token and time-per-output-token
percentiles and the server's prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from hydragen.bench.core.common import publish, say_quick
from hydragen.bench.core.plots import LABELS, plot_lines
from hydragen.bench.core.stats import percentile
from hydragen.bench.serving.server_process import start_server

WORDS = [
    "river",
    "stone",
    "lamp",
    "orbit",
    "violet",
    "maple",
    "copper",
    "harbor",
    "signal",
    "meadow",
    "lantern",
    "quartz",
    "ember",
    "willow",
    "falcon",
    "prism",
    "cedar",
    "tundra",
    "beacon",
    "delta",
]


RESULT_NAME = "serve"  # serve.json, serve.md
QUICK = dict(groups=2, per_group=2, system_len=30, question_len=5, output_len=4, rate=0.0)


def make_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def workload(groups: int, per_group: int, system_len: int, question_len: int, seed: int = 0):
    """Chat conversations: (group, messages). Lengths are in words, about one token each here."""
    rng = random.Random(seed)
    systems = [make_text(rng, system_len) for _ in range(groups)]
    convs = [
        (
            g,
            [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": make_text(rng, question_len)},
            ],
        )
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(convs)
    return convs


async def _one(client, url: str, model: str, messages, out_tokens: int, t_arrive: float) -> dict:
    import json

    body = {
        "model": model,
        "messages": messages,
        "max_tokens": out_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, n_tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {
        "ttft": first - start,
        "tpot": (end - first) / max(n_tokens - 1, 1),
        "tokens": n_tokens,
        "latency": end - start,
        "arrive": t_arrive,
    }


async def run_load(
    url: str, model: str, convs, out_tokens: int, rate: float, seed: int = 0
) -> tuple[list, float]:
    import httpx

    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        tasks, t0 = [], time.perf_counter()
        for _, messages in convs:
            tasks.append(
                asyncio.create_task(_one(client, url, model, messages, out_tokens, time.perf_counter() - t0))
            )
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = []
        for done, fut in enumerate(asyncio.as_completed(tasks), 1):
            results.append(await fut)
            print(f"\r[serve] {done}/{len(tasks)} requests done", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return results, time.perf_counter() - t0


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    if quick:
        say_quick("serve")
    convs = workload(args.groups, args.per_group, args.system_len, args.question_len)
    rows = []
    configs = [("cache on", [])] + ([] if args.url or args.no_baseline else [("cache off", ["--no-sharing"])])
    for label, extra in configs:
        proc = None
        url = args.url
        if url is None:
            extra = extra + ["--max-num-seqs", str(args.max_num_seqs)]
            if getattr(args, "page_size", None) is not None:
                extra += ["--page-size", str(args.page_size)]
            proc, url = start_server(args.model, extra)
        try:
            print(f"[serve] {label}: {len(convs)} requests at {args.rate}/s against {url}", file=sys.stderr)
            results, wall = asyncio.run(
                run_load(url, args.served_model_name or "bench", convs, args.output_len, args.rate)
            )
            hit = _metric(url, "hydragen_prefix_cache_hit_rate")
            peak_pages = _metric(url, "hydragen_kv_pages_peak")
            page_size = _metric(url, "hydragen_kv_page_size")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        tokens = sum(r["tokens"] for r in results)
        ttft = [r["ttft"] for r in results]
        tpot = [r["tpot"] for r in results]
        rows.append(
            dict(
                config=label,
                requests=len(results),
                output_tok_s=tokens / wall,
                req_s=len(results) / wall,
                ttft_p50=percentile(ttft, 50),
                ttft_p90=percentile(ttft, 90),
                ttft_p99=percentile(ttft, 99),
                tpot_p50=percentile(tpot, 50),
                tpot_p90=percentile(tpot, 90),
                tpot_p99=percentile(tpot, 99),
                hit_rate=hit,
                peak_kv_pages=peak_pages,
                page_size=page_size,
                wall_s=wall,
            )
        )
    cols = [
        "config",
        "requests",
        "output_tok_s",
        "req_s",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "tpot_p50",
        "tpot_p90",
        "tpot_p99",
        "hit_rate",
        "peak_kv_pages",
        "page_size",
        "wall_s",
    ]
    title = (
        f"Serving: {args.groups} groups x {args.per_group} requests, system {args.system_len} words, "
        f"question {args.question_len}, output {args.output_len} tokens, Poisson {args.rate} req/s"
    )
    keys = ("groups", "per_group", "system_len", "question_len", "output_len", "rate")
    params = {k: getattr(args, k) for k in keys}
    out = Path(args.out)
    quick_note = (
        "4 requests of 4 tokens: rates and latencies are dominated by HTTP and start-up, and a p99 of 4 "
        "requests is all but their maximum; the hit rate is what this run checks."
    )
    publish(
        rows,
        cols,
        out,
        RESULT_NAME,
        title,
        "ttft/tpot in seconds",
        plots=plots,
        quick=quick,
        quick_note=quick_note,
        params=params,
    )
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    """Time to first token and time per output token at the 50th/90th/99th percentile, cache on and off."""
    rows, prm, quick = data["rows"], data["params"], data.get("quick", False)
    title = (
        f"{prm.get('groups', '?')} system prompts x {prm.get('per_group', '?')} requests each, arriving "
        f"at {prm.get('rate', '?')} req/s (system prompt {prm.get('system_len', '?')} words, question "
        f"{prm.get('question_len', '?')} words, {prm.get('output_len', '?')} output tokens)"
    )
    paths = []
    for metric, what in (("ttft", "time to first token (s)"), ("tpot", "time per output token (s)")):
        series = {
            LABELS.get(r["config"], r["config"]): ([50, 90, 99], [r[f"{metric}_p{q}"] for q in (50, 90, 99)])
            for r in rows
        }
        paths.append(
            plot_lines(
                series,
                out / f"serve_{metric}.png",
                title,
                "percentile of requests (50 = median)",
                what,
                quick=quick,
                ylim_zero=True,
            )
        )
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start one, cache on and off)")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--groups", type=int, default=4, help="system prompts (4)")
    p.add_argument("--per-group", type=int, default=8, help="requests per system prompt (8)")
    p.add_argument("--system-len", type=int, default=1024, help="system prompt words (1024)")
    p.add_argument("--question-len", type=int, default=64, help="question words (64)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (32)")
    p.add_argument(
        "--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (0: all at once; 1)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--page-size", type=int, default=None, help="KV page size of the servers started")
    p.add_argument("--no-baseline", action="store_true", help="skip the cache-off run")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", default="bench-out")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    run(args)


if __name__ == "__main__":
    main()
