"""The server's own cost per engine step on its engine thread: taking the step's reports and handing them to
the event loop, for B streaming requests that all decode (the engine's step itself is left out).

Each engine step is wrapped: what the engine thread does between the end of one step and the start of the
next is the server's work (the step loop's callbacks, building and sending the updates, the commands and the
watchdog). Reported per step: that thread's CPU time (``time.thread_time``, what the stream's latency pays;
steady under load from other processes) and its wall time, and how many times it woke the event loop
(``call_soon_threadsafe``: one self-pipe write each), counted, not timed.

    PYTHONPATH=src python scripts/bench_client_reports.py [--requests 64] [--tokens 48] [--rounds 3]

Run it on two trees (PYTHONPATH of each) to compare them; it drives ``InProcessClient`` (``submit``
returning a stream) or the ``AsyncEngine`` it came from (``submit`` returning an id and a queue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def make_client(llm):
    try:
        from hydragen.server.in_process_client import InProcessClient
    except ImportError:  # the tree before the server split
        from hydragen.server.async_engine import AsyncEngine as InProcessClient
    return InProcessClient(llm)


async def consume(client, ids: list[list[int]], params) -> None:
    async def one(prompt_ids: list[int]) -> None:
        got = await client.submit(prompt_ids, params, None)
        if isinstance(got, tuple):  # AsyncEngine: (request id, queue of updates)
            while not (await got[1].get()).finished:
                pass
        else:
            async for _ in got:
                pass

    await asyncio.gather(*(one(p) for p in ids))


def run_round(llm, requests: int, tokens: int) -> dict:
    from hydragen import SamplingParams

    engine = llm.engine
    marks: list[tuple[int, int, int, int]] = []  # (wall at enter, cpu at enter, wall at exit, cpu at exit)
    sizes: list[int] = []
    wakes: list[int] = [0]
    step = engine.step

    def timed_step():
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        outs = step()
        marks.append((w0, c0, time.perf_counter_ns(), time.thread_time_ns()))
        sizes.append(len(outs))
        wakes.append(0)
        return outs

    engine.step = timed_step
    client = make_client(llm)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            wakes[-1] += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        ids = [llm.tokenizer.encode(f"Request {i}: tell me about {i * 37}.") for i in range(requests)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        await consume(client, ids, params)

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
        del engine.step
    # the gap after step k holds the server's work on step k's reports: kept where every request reported
    cpu, wall, woke = [], [], []
    for k in range(len(marks) - 1):
        if sizes[k] == requests and sizes[k + 1] == requests:
            wall.append((marks[k + 1][0] - marks[k][2]) / 1e3)
            cpu.append((marks[k + 1][1] - marks[k][3]) / 1e3)
            woke.append(wakes[k + 1])
    return {
        "steps": len(cpu),
        "cpu_us_median": statistics.median(cpu),
        "cpu_us_mean": statistics.fmean(cpu),
        "wall_us_median": statistics.median(wall),
        "wakes_per_step": statistics.fmean(woke),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from hydragen import LLM

    llm = LLM(kv_cache_tokens=65536)
    run_round(llm, 4, 4)  # warm up
    for r in range(args.rounds):
        print(json.dumps({"round": r, **run_round(llm, args.requests, args.tokens)}), flush=True)
    llm.close()


if __name__ == "__main__":
    main()
