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
    import uvicorn

    from hydragen import LLM
    from hydragen.server.app import create_app

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        prefix_sharing=not args.no_sharing,
    )
    name = args.served_model_name or llm.model_path.stem
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(create_app(llm, name), host=args.host, port=args.port, log_level=args.log_level)
    return 0


BENCHMARKS = {
    "attention": "hydragen.bench.attention",
    "e2e": "hydragen.bench.e2e",
    "longdoc": "hydragen.bench.longdoc",
    "tree": "hydragen.bench.tree",
    "serve": "hydragen.bench.serve",
}
# Calibrations, run on their own (not part of `bench all`).
EXTRA_BENCHMARKS = {"cost-rule": "hydragen.bench.cost_rule", "exactness": "hydragen.bench.exactness"}


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
    v.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
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
