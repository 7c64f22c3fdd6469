"""``hydragen bench tools``: tool calling on a real model, in four parts.

1. **Validity.** ``required`` and named calls over many requests with varied tool sets (seeded random
   functions with nested, bounded schemas; 1-8 per request), and over eight realistic functions whose
   strings are unbounded: how many calls end within ``max_tokens``, and whether every call that ends
   parses and validates against its function's schema (``jsonschema``).
2. **auto.** Requests that need one of the realistic functions and requests that need none, with
   ``tool_choice`` auto: how often the model chose a call, whether every call it started parsed, and
   how often a ``required`` reply that may hold several calls (``parallel_tool_calls``) ends by itself.
3. **Cost per request.** Compiling the call grammar (cold) and the grammar masks per generated token, for
   1, 8 and 100 functions, and for a deliberately slow grammar (functions with regex-constrained strings).
4. **No stall.** A stream decodes on ``hydragen serve`` (in this process) while another request with the
   slow grammar arrives: the stream's inter-token gaps during that compile, when the server compiles it
   on a request thread (as it does) and when the engine thread compiles it (as it did before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import textwrap
import threading
import time
from pathlib import Path

from hydragen.bench.core.common import say_quick, write_table
from hydragen.bench.structured.tool_workloads import (
    ASKS,
    REAL_TOOLS,
    call_problems,
    random_tools,
    real_jobs,
    run_tool_requests,
)

RESULT_NAME = "tools"


def validity(llm, requests: int, seed: int, max_tokens: int) -> list[dict]:
    from hydragen import SamplingParams
    from hydragen.tools.request import ToolRequest

    rng = random.Random(seed)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)
    needing = [a for a in ASKS if a[1] is not None]
    rows = []
    for label, make in (
        ("random tool sets, required", lambda i: (random_tools(rng, rng.randint(1, 8)), None)),
        (
            "random tool sets, named",
            lambda i: (tools := random_tools(rng, rng.randint(1, 8)), rng.choice(tools)),
        ),
        ("8 realistic functions, required", lambda i: (REAL_TOOLS, None)),
    ):
        jobs, meta = [], []
        for i in range(requests):
            tools, named = make(i)
            name = named["function"]["name"] if named else None
            choice = {"type": "function", "function": {"name": name}} if name else "required"
            request = ToolRequest.build(tools, choice, False, llm.tool_format)
            text = needing[i % len(needing)][0] if tools is REAL_TOOLS else f"Task {i}: use a function."
            jobs.append(([{"role": "user", "content": text}], request))
            meta.append((tools, name))
        t0 = time.perf_counter()
        replies = run_tool_requests(llm, jobs, params)
        finished = [(r, m) for r, m in zip(replies, meta, strict=True) if r.finish_reason == "tool_calls"]
        problems = [p for r, (tools, name) in finished for p in call_problems(r, tools, name)]
        rows.append(
            {
                "part": "validity",
                "case": label,
                "requests": len(replies),
                "finished": len(finished),
                "calls": sum(len(r.calls) for r, _ in finished),
                "invalid_calls": len(problems),
                "valid_rate": 1 - len(problems) / max(1, sum(len(r.calls) for r, _ in finished)),
                "seconds": time.perf_counter() - t0,
                "example_problem": problems[0] if problems else "",
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def auto_mode(llm, rounds: int, seed: int, max_tokens: int) -> list[dict]:
    from hydragen import SamplingParams

    rows = []
    params = SamplingParams(temperature=0.7, seed=seed, max_tokens=max_tokens)
    jobs = real_jobs(llm, 12 * rounds, tool_choice="auto", parallel=True, needing_tools=False)
    replies = run_tool_requests(llm, [(c, r) for c, r, _ in jobs], params)
    trigger = llm.tool_format.trigger
    for needs in (True, False):
        picked = [
            (rep, exp) for rep, (_, _, exp) in zip(replies, jobs, strict=True) if (exp is not None) == needs
        ]
        started = [rep for rep, _ in picked if trigger in rep_text(llm, rep)]
        rows.append(
            {
                "part": "auto",
                "case": "asks needing a function" if needs else "asks needing none",
                "requests": len(picked),
                "chose_a_call": sum(bool(rep.complete_calls) for rep, _ in picked) / len(picked),
                "right_function": sum(any(c.name == e for c in rep.complete_calls) for rep, e in picked)
                / len(picked),
                "calls_started": len(started),
                "started_calls_parsed": sum(bool(rep.complete_calls) for rep in started)
                / max(1, len(started)),
                "ended_by_itself": sum(rep.finish_reason != "length" for rep, _ in picked) / len(picked),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    jobs = real_jobs(llm, 8 * rounds, tool_choice="required", parallel=True)
    replies = run_tool_requests(llm, [(c, r) for c, r, _ in jobs], params)
    rows.append(
        {
            "part": "auto",
            "case": "required, parallel_tool_calls true",
            "requests": len(replies),
            "ended_by_itself": sum(r.finish_reason == "tool_calls" for r in replies) / len(replies),
            "calls_per_reply": statistics.fmean(len(r.complete_calls) for r in replies),
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    return rows


def rep_text(llm, reply) -> str:
    return llm.tokenizer.decode(reply.token_ids)


def slow_tools(seed: int, count: int) -> list[dict]:
    """Functions whose arguments are regex-constrained strings: a grammar that takes long to compile."""
    tools = []
    for i in range(count):
        props = {
            f"field_{j}": {"type": "string", "pattern": f"^[a-z]{{{j},{j + 5}}}[0-9]+$"} for j in range(20)
        }
        params = {"type": "object", "properties": props, "required": ["field_0"]}
        tools.append({"type": "function", "function": {"name": f"slow_{seed}_{i}", "parameters": params}})
    return tools


def cost(llm, seed: int, max_tokens: int, slow_count: int) -> list[dict]:
    """Cold compile and mask time per token for one required request with 1, 8, 100 and the slow tools."""
    from hydragen import SamplingParams
    from hydragen.tools.request import ToolRequest

    structured = llm.engine.structured
    rows = []
    cases = [
        (f"{n} functions, required", random_tools(random.Random(seed + n), n), "required")
        for n in (1, 8, 100)
    ]
    cases.append(
        (f"{slow_count} functions with regex-constrained strings", slow_tools(seed, slow_count), "required")
    )
    cases.append(("8 realistic functions, auto (a text reply)", REAL_TOOLS, "auto"))
    for label, tools, choice in cases:
        request = ToolRequest.build(tools, choice, False, llm.tool_format)
        t0 = time.perf_counter()
        constraint = request.constraint(structured.compiler.ll_tokenizer, False)
        built = time.perf_counter() - t0
        fresh = constraint.source() not in structured.compiler.compile_seconds
        structured.compile(constraint)
        compile_s = structured.compiler.compile_seconds[constraint.source()] if fresh else float("nan")
        structured.masker.reset_timings()
        ask = "Call one of the functions." if choice == "required" else "Tell me a short joke about cats."
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
        params = request.sampling_params(
            SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens), constraint
        )
        out = llm.generate([ids], [params], use_tqdm=False)[0].outputs[0]
        masks = list(structured.masker.seconds)
        rows.append(
            {
                "part": "cost",
                "case": label,
                "grammar_kb": len(constraint.grammar) / 1024,
                "build_ms": 1e3 * built,
                "compile_ms": 1e3 * compile_s,
                "masks": len(masks),
                "mask_us_mean": 1e6 * statistics.fmean(masks) if masks else float("nan"),
                "mask_us_max": 1e6 * max(masks) if masks else float("nan"),
                "output_tokens": len(out.token_ids),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _serve(llm):
    """``hydragen serve``'s app on a loopback port, in a thread of this process; (url, stop, app), where
    ``stop()`` returns once the server and its engine thread have ended (the engine is the caller's again)."""
    from hydragen.server.app import create_app
    from hydragen.server.launch import bind_socket, make_server
    from hydragen.server.options import ServerOptions

    options = ServerOptions()
    app = create_app(llm, "bench", options)
    sock = bind_socket("127.0.0.1", 0)
    server = make_server(app, options, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=120)
        app.state.engine_client.shutdown()  # (also done by the app's shutdown) the engine thread has ended
        for rid in list(llm.engine.requests):  # nothing of the server's stays in the engine
            llm.engine.abort(rid)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop, app


def no_stall(llm, seed: int, slow_count: int, stream_tokens: int) -> tuple[list[dict], dict]:
    """A greedy stream of ``stream_tokens`` tokens, and after its 10th token a request whose grammar (the
    tool-call grammar of ``slow_count`` regex-heavy functions, sent as guided_grammar so the prompt stays
    short) compiles slowly. Two ways: through HTTP, where the server compiles on a request thread, and
    submitted straight to the engine thread, which then compiles it in add_request (the old path)."""
    import httpx

    from hydragen import SamplingParams, StructuredOutputsParams
    from hydragen.tools.grammar import tool_grammar
    from hydragen.tools.spec import ToolChoice, parse_tools

    url, stop, app = _serve(llm)
    compiler = llm.engine.structured.compiler
    ask = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    stream_body = {"model": "bench", "messages": ask, "stream": True, "temperature": 0}
    stream_body.update(max_tokens=stream_tokens, ignore_eos=True)
    rows, timelines = [], {}
    try:
        for k, path in enumerate(("request thread (now)", "engine thread (before)")):
            tools = parse_tools(slow_tools(seed * 10 + k, slow_count))
            grammar = tool_grammar(tools, ToolChoice("required"), llm.tool_format, False)
            arrivals: list[float] = []

            def stream(arrivals: list[float] = arrivals) -> None:
                with httpx.stream("POST", url + "/v1/chat/completions", json=stream_body, timeout=600) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            arrivals.append(time.perf_counter())

            reader = threading.Thread(target=stream)
            reader.start()
            while len(arrivals) < 10 and reader.is_alive():
                time.sleep(0.005)
            sent = time.perf_counter()
            if k == 0:
                body = {"model": "bench", "messages": ask, "max_tokens": 4, "guided_grammar": grammar}
                slow = threading.Thread(
                    target=lambda b=body: httpx.post(url + "/v1/chat/completions", json=b, timeout=600)
                )
            else:
                ids = llm.tokenizer.apply_chat_template(ask)
                params = SamplingParams(
                    max_tokens=4, structured_outputs=StructuredOutputsParams(grammar=grammar)
                )
                submit = app.state.engine_client.submit
                slow = threading.Thread(target=lambda f=submit, i=ids, p=params: asyncio.run(f(i, p, None)))
            slow.start()
            slow.join()
            reader.join()
            compile_s = compiler.compile_seconds[StructuredOutputsParams(grammar=grammar).source()]
            gaps = [(a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]
            during = [b - a for a, b in gaps if b > sent and a < sent + compile_s]
            outside = [b - a for a, b in gaps if not (b > sent and a < sent + compile_s)]
            rows.append(
                {
                    "part": "no_stall",
                    "case": f"compiled on the {path}",
                    "compile_ms": 1e3 * compile_s,
                    "itl_median_ms": 1e3 * statistics.median(outside),
                    "itl_max_during_compile_ms": 1e3 * max(during) if during else float("nan"),
                    "tokens_during_compile": len(during),
                }
            )
            timelines[path] = {"arrivals": [a - sent for a in arrivals], "compile_s": compile_s}
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop()
    return rows, timelines


COLUMNS = {
    "validity": ["case", "requests", "finished", "calls", "invalid_calls", "valid_rate", "seconds"],
    "auto": [
        "case",
        "requests",
        "chose_a_call",
        "right_function",
        "calls_started",
        "started_calls_parsed",
        "ended_by_itself",
        "calls_per_reply",
    ],
    "cost": [
        "case",
        "grammar_kb",
        "build_ms",
        "compile_ms",
        "masks",
        "mask_us_mean",
        "mask_us_max",
        "output_tokens",
    ],
    "no_stall": ["case", "compile_ms", "itl_median_ms", "itl_max_during_compile_ms", "tokens_during_compile"],
}


def plots(data: dict, out: Path) -> list[Path]:
    """Compile and mask cost per case; the stream's token gaps around a slow compile, both ways."""
    from hydragen.bench.core.plots import QUICK_TITLE, pyplot

    plt = pyplot()

    prefix = QUICK_TITLE + "\n" if data.get("quick") else ""
    paths = []
    cost = [r for r in data["rows"] if r["part"] == "cost"]
    if cost:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
        labels = [textwrap.fill(r["case"], 18) for r in cost]
        bars = a.bar(labels, [r["compile_ms"] for r in cost], color="C0")
        a.bar_label(bars, fmt="%.3g", fontsize=8)
        a.set_ylabel("cold compile (ms, log scale)")
        a.set_yscale("log")
        bars = b.bar(labels, [r["mask_us_mean"] for r in cost], color="C1")
        b.bar_label(bars, fmt="%.3g", fontsize=8)
        b.set_ylabel("mask per generated token, mean (us)")
        for ax in (a, b):
            ax.tick_params(axis="x", labelsize=6.5)
        fig.suptitle(prefix + "Tool-call grammar: cost per request")
        paths.append(out / "tools_cost.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    timelines = data.get("timelines") or {}
    if timelines:
        fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
        for j, (path, t) in enumerate(timelines.items()):
            arr = t["arrivals"]
            ax.plot(
                arr[1:],
                [1e3 * (y - x) for x, y in zip(arr, arr[1:], strict=False)],
                marker=".",
                color=f"C{j}",
                label=path,
            )
            ax.axvspan(0, t["compile_s"], color=f"C{j}", alpha=0.12)
        ax.set_xlabel("seconds since the slow request was sent (shaded: its compile)")
        ax.set_ylabel("gap before each streamed token (ms)")
        ax.set_title(prefix + "Another request's stream while a slow grammar compiles")
        ax.legend(fontsize=8)
        paths.append(out / "tools_no_stall.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint with a chat template (default: embedded model)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the run works")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    p.add_argument("--requests", type=int, default=120, help="requests per validity case (default 120)")
    p.add_argument("--auto-rounds", type=int, default=4, help="passes over the 12 auto asks (default 4)")
    p.add_argument("--max-tokens", type=int, default=160, help="most tokens per reply (default 160)")
    p.add_argument("--slow-functions", type=int, default=600, help="functions of the slow grammar (600)")
    p.add_argument("--stream-tokens", type=int, default=120, help="tokens of the measured stream (120)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        say_quick("tools")
        args.requests, args.auto_rounds, args.max_tokens, args.slow_functions = 4, 1, 48, 20
        args.stream_tokens = 30
    from hydragen import LLM

    llm = LLM(args.model, kv_cache_tokens=65536)
    rows = validity(llm, args.requests, args.seed, args.max_tokens)
    rows += auto_mode(llm, args.auto_rounds, args.seed, args.max_tokens)
    rows += cost(llm, args.seed, args.max_tokens, args.slow_functions)
    stall_rows, timelines = no_stall(llm, args.seed, args.slow_functions, args.stream_tokens)
    rows += stall_rows
    params = {k: v for k, v in vars(args).items() if k != "out"}
    params["model"] = args.model or "embedded SmolLM2-135M-Instruct"
    notes = (
        f"Model: {params['model']} (tool format {llm.tool_format.name}). Validity: temperature 1, "
        f"max_tokens {args.max_tokens}, one call per request. Auto: temperature 0.7."
    )
    sections = []
    for part, columns in COLUMNS.items():  # one table per part (their columns differ)
        part_rows = [r for r in rows if r["part"] == part]
        name = f"{RESULT_NAME}_{part}"
        sections.append(
            write_table(
                part_rows,
                columns,
                args.out,
                name,
                f"Tool calling: {part}",
                notes if not sections else "",
                quick=args.quick,
            )
        )
        for suffix in (".json", ".md"):
            (args.out / f"{name}{suffix}").unlink()
    write_table(
        rows, ["part", "case"], args.out, RESULT_NAME, "Tool calling", notes, quick=args.quick, params=params
    )
    data = json.loads((args.out / f"{RESULT_NAME}.json").read_text())
    data["timelines"] = timelines
    (args.out / f"{RESULT_NAME}.json").write_text(json.dumps(data, indent=2))
    (args.out / f"{RESULT_NAME}.md").write_text("\n".join(sections))
    print("\n".join(sections))
    for path in plots(data, args.out):
        print(path)
