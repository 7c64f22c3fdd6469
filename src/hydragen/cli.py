"""Command line: ``hydragen generate PROMPT -n 8 --max-tokens 64``."""

from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from hydragen import LLM, SamplingParams

    try:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=args.stop or None,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, prefix_sharing=not args.no_sharing)
    load_s = time.perf_counter() - t0
    chat = not args.raw and llm.tokenizer is not None and llm.tokenizer.has_chat_template
    t0 = time.perf_counter()
    if chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=not args.quiet)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=not args.quiet)
    wall = time.perf_counter() - t0
    for c in outs[0].outputs:
        print(f"--- completion {c.index} ({c.finish_reason}, {len(c.token_ids)} tokens) ---")
        print(c.text.strip())
    st = llm.engine.stats
    bpt = llm.engine.pool.bytes_per_token
    mib = lambda tokens: tokens * bpt / 2**20  # noqa: E731
    print(
        f"=== {st.generated_tokens} tokens generated in {wall:.2f}s (model load {load_s:.1f}s) | "
        f"decode {st.generated_tokens / max(st.decode_seconds, 1e-9):.1f} tok/s | "
        f"prompt tokens: {st.prefill_tokens} prefilled, {st.shared_prompt_tokens} served from shared KV | "
        f"KV memory: {mib(st.peak_kv_tokens):.1f} MiB used vs {mib(st.per_sequence_kv_tokens):.1f} MiB "
        f"with per-sequence copies"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from hydragen.server.launch import LOG_LEVELS, bind_socket, configure_logging
    from hydragen.server.options import ServerOptions

    # Everything that can be checked without the model is checked first: a bad option is one line, at once.
    api_key = args.api_key if args.api_key is not None else os.environ.get("HYDRAGEN_API_KEY") or None
    hosts = [h.strip() for h in args.allowed_hosts.split(",")] if args.allowed_hosts else None
    options = ServerOptions(
        api_key=api_key,
        allowed_hosts=hosts,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.log_level.lower() not in LOG_LEVELS:
        problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.api_key is not None and not args.api_key.strip():
        problems.append("--api-key must not be empty")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        problems.append(f"--kv-cache-tokens must be >= 1, got {args.kv_cache_tokens}")
    if args.max_num_seqs < 1:
        problems.append(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.model is not None and not os.path.exists(args.model):
        problems.append(f"--model {args.model!r} does not exist")
    try:
        options.check()
    except ValueError as e:
        problems.append(str(e))
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    log_level = args.log_level.lower()
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(log_level)

    from hydragen import LLM
    from hydragen.server.app import create_app
    from hydragen.server.launch import run

    try:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_tokens=args.kv_cache_tokens,
            max_num_seqs=args.max_num_seqs,
            prefix_sharing=not args.no_sharing,
        )
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or llm.model_path.stem
    kv = llm.engine.kv_usage()["total"]
    mib = kv * llm.engine.pool.bytes_per_token / 2**20
    host = f"[{args.host}]" if ":" in args.host else args.host
    ready = (
        f"ready: serving {name!r} on http://{host}:{{port}}/v1 | KV cache {kv} tokens ({mib:.0f} MiB)"
        f" | API key {'required' if api_key else 'not required'}"
    )
    run(create_app(llm, name, options), sock, options, log_level, ready)
    return 0


BENCHMARKS = {
    "attention": "hydragen.bench.attention",
    "e2e": "hydragen.bench.e2e",
    "longdoc": "hydragen.bench.longdoc",
    "tree": "hydragen.bench.tree",
    "serve": "hydragen.bench.serve",
}
# Calibrations, run on their own (not part of `bench all`).
EXTRA_BENCHMARKS = {"cost-rule": "hydragen.bench.cost_rule"}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    if args.which != "all":
        importlib.import_module({**BENCHMARKS, **EXTRA_BENCHMARKS}[args.which]).main(args.rest)
        return 0
    # The whole suite at its defaults (or --quick), each benchmark into its own folder under --out.
    extra = argparse.ArgumentParser(prog="hydragen bench all")
    extra.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
    extra.add_argument("--out", default="bench-out")
    opts = extra.parse_args(args.rest)
    for name, module in BENCHMARKS.items():
        print(f"=== hydragen bench {name} ===", file=sys.stderr)
        argv = ["--out", f"{opts.out}/{name}"] + (["--quick"] if opts.quick else [])
        importlib.import_module(module).main(argv)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydragen", description="LLM inference built around shared prefixes."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="sample completions of one prompt with shared-prefix attention",
        description="Generate N completions of PROMPT; the prompt's KV is computed and stored "
        "once and read by all N sequences in one batched attention call.",
    )
    g.add_argument("prompt", help="the prompt text (the chat template is applied unless --raw)")
    g.add_argument("-n", type=int, default=1, help="number of completions (default 1)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion (default 64)")
    g.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature, 0 = greedy (default 0.7)"
    )
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default 0)")
    g.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file or Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument(
        "--no-sharing",
        action="store_true",
        help="baseline: every sequence keeps its own full copy of the prompt's KV",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_generate)

    v = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with a persistent prefix cache",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests that share prefixes share KV, across time.",
    )
    v.add_argument(
        "--model", default=None, help="a .gguf file or Hugging Face model directory (default: embedded)"
    )
    v.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: file/dir name)"
    )
    v.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens (default: 1/4 of RAM)"
    )
    v.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences decoded at once (default 256)"
    )
    v.add_argument("--no-sharing", action="store_true", help="baseline: no prefix cache, no shared attention")
    v.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    v.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    v.add_argument(
        "--log-level",
        default="info",
        help="critical, error, warning, info (one line per request; default) or debug",
    )
    v.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYDRAGEN_API_KEY, else none)",
    )
    v.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated host names accepted in the Host header (default: any)",
    )
    v.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body in bytes; larger ones get a 413 (default 8 MiB)",
    )
    v.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers and body (default 30)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests get before they are aborted (default 10)",
    )
    v.set_defaults(func=_serve)

    b = sub.add_parser(
        "bench",
        help="benchmark suite (attention, e2e, longdoc, tree, serve; cost-rule): `hydragen bench NAME -h`",
    )
    b.add_argument(
        "which",
        choices=[*BENCHMARKS, "all", *EXTRA_BENCHMARKS],
        help="which benchmark ('all': the suite; 'cost-rule': calibrates the engine's sharing threshold)",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
