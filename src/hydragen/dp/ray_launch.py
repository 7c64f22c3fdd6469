"""``hydragen serve --ray``: its checks, the Ray Serve app built from the serve flags, and running it.

The replicas get the user's model and engine options; each reserves ``--threads`` Ray CPUs (default 1) and
runs that many torch threads. Without ``--kv-cache-tokens`` each replica takes its part of the default KV
budget as if all ran on this machine (a quarter of free memory split N ways): on a cluster of several
machines, give ``--kv-cache-tokens``. Ray Serve's HTTP proxy listens on ``--host``/``--port`` of the machine
that runs the command (the head node with ``ray start``; see docs/data_parallel.md, "Across machines").
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

RAY_MISSING = "--ray needs Ray Serve, an optional dependency: pip install 'hydragen[ray]'"


def flags_without_ray(args: argparse.Namespace) -> list[str]:
    """The Ray-only flags given without ``--ray``."""
    problems = []
    if args.ray_address is not None:
        problems.append("--ray-address needs --ray")
    if args.router_policy == "ray-prefix":
        problems.append("--router-policy ray-prefix (Ray Serve LLM's router) needs --ray")
    return problems


def check(args: argparse.Namespace, tensor_parallel: int) -> list[str]:
    """Problems with ``--ray`` and its flags (checked before Ray starts)."""
    problems = []
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        problems.append(RAY_MISSING)
    if args.data_parallel_size < 1:
        problems.append(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if tensor_parallel > 1:
        problems.append("--ray and --tensor-parallel-size cannot be combined")
    if args.router_balance_bound < 0:
        problems.append(f"--router-balance-bound must be >= 0, got {args.router_balance_bound}")
    if args.kv_events_endpoint or args.kv_events_replay_endpoint:
        problems.append("with --ray each replica publishes its KV events on its own node's address")
    return problems


def build_from_args(args: argparse.Namespace, engine, options, api_key: str | None):
    """The Ray Serve app for these serve flags and ``engine``'s settings (``dp.ray_serve.build_app``)."""
    from hydragen.dp.launch import replica_kv_cache
    from hydragen.dp.ray_serve import build_app
    from hydragen.tp.checkpoint import read_config

    config, _, _ = read_config(engine.model)
    threads = args.threads if isinstance(args.threads, int) else 1
    kv_tokens, kv_dtype = replica_kv_cache(engine, config, args.data_parallel_size)
    settings = engine.replace(threads=threads, kv_cache_tokens=kv_tokens, kv_cache_dtype=kv_dtype)
    llm_options = {name: value for name, value in settings.options().items() if name != "model"}
    server_options = dict(
        api_key=api_key,
        allowed_hosts=options.allowed_hosts,
        max_request_bytes=options.max_request_bytes,
        read_timeout=options.read_timeout,
        shutdown_timeout=options.shutdown_timeout,
        step_timeout=options.step_timeout,
    )
    return build_app(
        engine.model,
        data_parallel_size=args.data_parallel_size,
        policy=args.router_policy,
        balance_bound=args.router_balance_bound,
        replica_cpus=threads,
        llm_options=llm_options,
        served_model_name=args.served_model_name,
        server_options=server_options,
        max_ongoing_requests=engine.max_num_seqs,
    )


def run(args: argparse.Namespace, engine, options, api_key: str | None) -> int:
    """Join ``--ray-address`` (or start a Ray instance on this machine), serve until SIGINT/SIGTERM."""
    import ray
    from ray import serve

    from hydragen.dp.ray_serve import APP_NAME

    # No --ray-address: a Ray instance of this machine alone, even where 'ray start' runs one.
    address = args.ray_address or "local"
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        app = build_from_args(args, engine, options, api_key)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"ready: serving on http://{host}:{args.port}/v1 | {args.data_parallel_size} Ray Serve replicas "
            f"(router policy {args.router_policy}) on a Ray cluster of {nodes} node{'s' * (nodes != 1)} | "
            f"API key {'required' if api_key else 'not required'}",
            file=sys.stderr,
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
