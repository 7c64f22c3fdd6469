"""The ``hydragen`` command line: every subcommand's flags and help."""

from __future__ import annotations

import argparse

from hydragen.cli.bench import BENCHMARKS, EXTRA_BENCHMARKS, run_bench
from hydragen.cli.generate import run_chat, run_generate
from hydragen.cli.serve import run_serve
from hydragen.engine.config_flags import add_engine_flags
from hydragen.restart_backoff import DEFAULT_MAX_PER_MINUTE
from hydragen.server.step_watchdog import DEFAULT_STEP_TIMEOUT_S


def _version() -> str:
    import platform

    from hydragen import __version__

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # --version must work even where torch is broken
        torch_version = "not installed"
    return f"hydragen {__version__} (torch {torch_version}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version())
        parser.exit()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of generate and chat: the engine's settings, and the CLI's own."""
    _add_random_weights_arg(p)
    p.add_argument("--system", default=None, help="system prompt (the chat template's system message)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="context limit, prompt and output together; also sizes the KV cache (default: the model's)",
    )
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    add_engine_flags(p)


def _add_random_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--random-weights",
        default=None,
        metavar="SHAPE:SCHEME",
        help="instead of --model: a random-weights GGUF of a real shape and quantization (e.g. "
        "llama-3.1-8b:Q4_K_M, llama-3.2-1b:Q4_K_M, or a config.json and a scheme), written once into the "
        "cache in llama-quantize's type mix: try or measure a model size without downloading it",
    )


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    """The sampling flags. Each defaults to None: unset, it takes the model's own default (its
    generation_config.json or GGUF metadata, unless --generation-config hydragen), else the one shown."""
    p.set_defaults(default_temperature=temperature)
    model = "the model's own, else "
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature, 0 = greedy (default: {model}{temperature})",
    )
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {model}0.95)")
    p.add_argument(
        "--top-k", type=int, default=None, help=f"keep the k most likely tokens (default: {model}off)"
    )
    p.add_argument(
        "--min-p", type=float, default=None, help=f"drop p < min_p x the top p (default: {model}off)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydragen", description="LLM inference built around shared prefixes."
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="sample completions of one prompt with shared-prefix attention",
        description="Generate N completions of PROMPT; the prompt's KV is computed and stored once and read "
        "by all N sequences in one batched attention call. One completion streams as it is generated; "
        "several are printed when done, with a live token rate meanwhile. A summary goes to stderr.",
    )
    g.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    g.add_argument("-n", type=int, default=1, help="number of completions (default 1)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion (default 64)")
    _add_sampling_args(g, temperature=0.7)
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument(
        "--json-schema", default=None, help="output must match this JSON Schema (inline or a file)"
    )
    g.add_argument("--regex", default=None, help="output must match this regular expression")
    g.add_argument("--choice", action="append", help="output must be one of these strings (repeatable)")
    _add_model_args(g)
    g.add_argument("-q", "--quiet", action="store_true", help="no live rate line and no summary")
    g.set_defaults(func=run_generate)

    c = sub.add_parser(
        "chat",
        help="interactive chat in the terminal (earlier turns are served from the prefix cache)",
        description="Chat with the model: replies stream as they are generated, and each turn reuses the KV "
        "of the conversation so far from the prefix cache. /reset starts over, /exit or Ctrl-D leaves, "
        "Ctrl-C stops a reply. With standard input not a terminal, each input line is one user turn.",
    )
    c.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most new tokens per reply (default: until the model ends its turn or the context is full)",
    )
    _add_sampling_args(c, temperature=0.7)
    _add_model_args(c)
    c.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="JSON file of functions the model may call (OpenAI's tools list); calls are shown and their "
        "results asked for",
    )
    c.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="with --tools: auto (default), required, none, or a function's name",
    )
    c.add_argument("-q", "--quiet", action="store_true", help="no banner and no per-turn statistics")
    c.set_defaults(func=run_chat)

    v = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with a persistent prefix cache",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests that share prefixes share KV, across time.",
    )
    _add_random_weights_arg(v)
    add_engine_flags(v)
    v.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: file/dir name)"
    )
    v.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="publish the prefix cache's stored/removed pages as vLLM KV events on this ZMQ PUB address "
        "(e.g. tcp://127.0.0.1:5557; port 0 picks one), for a cache-aware router (default: off)",
    )
    v.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="with --kv-events-endpoint: a ZMQ ROUTER address where subscribers ask for missed batches",
    )
    v.add_argument(
        "--kv-events-topic",
        default="",
        help="with --kv-events-endpoint: the ZMQ topic of every message (default: none, as vLLM)",
    )
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
    v.add_argument(
        "--step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        metavar="SECONDS",
        help="an engine step running longer than this is stalled: /health and new requests get a 503 "
        "engine_stalled and the log names the step's requests; with --data-parallel-size the front routes "
        "away from that replica and restarts it if it stays stuck as long again; 0: off (default "
        f"{DEFAULT_STEP_TIMEOUT_S:g}, room for a full 2,048-token prefill step of an 8B model on one core)",
    )
    v.add_argument(
        "--max-restarts-per-minute",
        type=int,
        default=DEFAULT_MAX_PER_MINUTE,
        metavar="N",
        help="with --tensor-parallel-size: when the group breaks (a worker died, e.g. killed for memory, or "
        "hung), the server fails the requests in flight and rebuilds it (new workers, the model loaded "
        "again), at most N times in any minute; past that its engine counts as failed (503 engine_failed) "
        f"for a supervisor to restart the process; 0: never rebuild (default {DEFAULT_MAX_PER_MINUTE})",
    )
    v.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run N replicas of the model, each on its share of the cores, behind one endpoint that routes "
        "each request to a replica (default 1: one process)",
    )
    v.add_argument(
        "--router-policy",
        choices=["cache", "approx", "round-robin", "least-loaded", "ray-prefix"],
        default="cache",
        help="with --data-parallel-size: cache (default) sends a request to the replica whose prefix cache "
        "holds most of its prompt, known from the replicas' KV events; approx guesses that from the text of "
        "earlier requests (SGLang's router); round-robin; least-loaded; with --ray also ray-prefix, Ray "
        "Serve LLM's own approximate router (PrefixCacheAffinityRouter)",
    )
    v.add_argument(
        "--router-balance-bound",
        type=int,
        default=4,
        metavar="K",
        help="with --data-parallel-size: the best-matching replica is passed over when it has more than K "
        "requests in flight beyond the least-loaded one (default 4)",
    )
    v.add_argument(
        "--ray",
        action="store_true",
        help="run the --data-parallel-size replicas as a Ray Serve app, on any machines of a Ray cluster, "
        "with the same router (needs pip install 'hydragen[ray]'; docs/data_parallel.md)",
    )
    v.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --ray: the Ray cluster to join (auto: the one 'ray start' runs on this machine; "
        "default: start a Ray instance of this machine alone)",
    )
    v.set_defaults(func=run_serve)

    b = sub.add_parser(
        "bench",
        help="benchmark suite (attention, e2e, longdoc, tree, serve, structured; cost-rule, exactness, "
        "versus, tp, tools, schema-defaults, quant, dp): `hydragen bench NAME -h`; "
        "`hydragen bench NAME --replot DIR` redraws a run's plots from its JSON",
    )
    b.add_argument(
        "which",
        choices=[*BENCHMARKS, "all", *EXTRA_BENCHMARKS],
        help="which benchmark ('all': the suite; 'cost-rule': calibrates the engine's sharing threshold)",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(func=run_bench)
    return parser
