"""``hydragen serve --data-parallel-size N``: its checks, each replica's command line, and running the front.

The replicas get the user's model and engine options unchanged, plus: loopback on a port of their own
choosing, ``--threads`` (their share of the cores, or the user's ``--threads``), KV events on loopback for
the router, the KV cache's dtype as the front resolved it (so the cache a replica builds is the one its
budget was sized for), and, when ``--kv-cache-tokens`` is not given, their part of the default KV budget (a
quarter of free memory split N ways, instead of a quarter each). The API key reaches them in their
environment, never on a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hydragen.dp.replicas import split_cores

# server flags every replica gets as the user gave them (the engine's settings come from its config)
SERVER_FLAGS = (
    ("served_model_name", "--served-model-name"),
    ("max_request_bytes", "--max-request-bytes"),
    ("read_timeout", "--read-timeout"),
    ("shutdown_timeout", "--shutdown-timeout"),
    ("step_timeout", "--step-timeout"),
)
# engine settings the front decides for each replica instead of passing the user's
DECIDED_BY_THE_FRONT = ("threads", "kv_cache_tokens", "kv_cache_dtype")


def check(args: argparse.Namespace, cores: int, tensor_parallel: int) -> list[str]:
    """Problems with the data-parallel flags (checked before anything starts)."""
    n, problems = args.data_parallel_size, []
    if n < 1:
        problems.append(f"--data-parallel-size must be at least 1, got {n}")
    elif n > cores and args.threads is None:
        problems.append(
            f"--data-parallel-size {n} needs {n} cores, but this process may use {cores}; give --threads "
            "to run more replicas than cores (they then share the cores)"
        )
    if n > 1 and tensor_parallel > 1:
        problems.append("--data-parallel-size and --tensor-parallel-size cannot be combined")
    if args.router_balance_bound < 0:
        problems.append(f"--router-balance-bound must be >= 0, got {args.router_balance_bound}")
    if n > 1 and (args.kv_events_endpoint or args.kv_events_replay_endpoint):
        problems.append("with --data-parallel-size the front sets each replica's KV-event addresses itself")
    return problems


def replica_threads(args: argparse.Namespace, cores: list[list[int] | None]) -> int:
    """Threads of each replica: --threads N, else the cores it is pinned to (``check`` made sure that
    without --threads every replica is pinned)."""
    if isinstance(args.threads, int):
        return args.threads
    return min(len(c) for c in cores if c is not None)


def replica_kv_cache(engine, config, replicas: int) -> tuple[int, str]:
    """(tokens, dtype) of each replica's KV cache: --kv-cache-tokens, else its part of the default budget
    (``default_kv_cache_tokens``), sized for the dtype that --kv-cache-dtype resolves to. The replicas are
    given that dtype by name, not "auto", so the cache each builds is the one its budget was sized for.
    ``engine``: the user's engine settings; ``config``: the model's."""
    import torch

    from hydragen.llm import default_kv_cache_tokens
    from hydragen.model.gguf import open_gguf_tensors
    from hydragen.model.loader import (
        keeps_compact,
        resolve_device,
        resolve_dtype,
        resolve_kv_dtype,
        resolve_model_path,
    )

    device, dtype = resolve_device(engine.device), resolve_dtype(engine.dtype)
    # "auto" is float16 where the model keeps GGUF quantized blocks: the header's tensor types tell, without
    # reading a weight.
    path = resolve_model_path(engine.model)
    quantized = (
        path.suffix == ".gguf"
        and open_gguf_tensors(path, keeps_compact(device, dtype, engine.dequantize))[1].keeps_quantized()
    )
    kv_dtype = resolve_kv_dtype(engine.kv_cache_dtype, dtype, quantized)
    name = str(kv_dtype).removeprefix("torch.")
    if engine.kv_cache_tokens is not None:
        return engine.kv_cache_tokens, name
    bytes_per_token = config.kv_bytes_per_token_per_elem * torch.finfo(kv_dtype).bits // 8
    useful = engine.max_num_seqs * config.max_position_embeddings
    return default_kv_cache_tokens(bytes_per_token, device, useful, share=replicas), name


def replica_args(
    args: argparse.Namespace, engine, threads: int, kv_cache: tuple[int, str], log_level: str
) -> list[str]:
    """The ``hydragen serve`` arguments of every replica: ``engine``'s settings (an ``EngineConfig``) as
    flags, with the threads and ``kv_cache`` (from ``replica_kv_cache``) the front decided."""
    from hydragen.engine.config_flags import engine_flags

    out = ["--host", "127.0.0.1", "--port", "0", "--threads", str(threads)]
    out += ["--kv-cache-tokens", str(kv_cache[0]), "--kv-cache-dtype", kv_cache[1]]
    out += ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    # Replicas log at info at least: their ready line says where they listen (their request lines are
    # forwarded at debug; the front logs every request itself).
    out += ["--log-level", "debug" if log_level in ("debug", "trace") else "info"]
    out += engine_flags(engine, skip=DECIDED_BY_THE_FRONT)
    for attr, flag in SERVER_FLAGS:
        if (value := getattr(args, attr)) is not None:
            out += [flag, str(value)]
    return out


def build_front(
    args: argparse.Namespace, engine, api_key: str | None, log_level: str, command: list[str] | None = None
):
    """(Front, resolved model path) for the parsed serve flags and ``engine``'s settings (``EngineConfig``);
    ``command`` starts a replica (default ``python -m hydragen``). Reads the model's config and tokenizer,
    nothing is started yet."""
    from hydragen.cpu_threads import usable_cores
    from hydragen.dp.front import Front
    from hydragen.dp.prompts import RequestPrompts
    from hydragen.dp.router import Router
    from hydragen.tp.checkpoint import read_config

    n = args.data_parallel_size
    config, path, _ = read_config(engine.model)
    prompts = RequestPrompts.from_files(config, path, engine.tool_format, args.router_policy == "approx")
    cores = split_cores(usable_cores(), n)
    threads = replica_threads(args, cores)
    serve_args = replica_args(args, engine, threads, replica_kv_cache(engine, config, n), log_level)
    router = Router(n, args.router_policy, args.router_balance_bound, page_size=engine.page_size)
    env = {"HYDRAGEN_API_KEY": api_key or ""}
    front = Front(
        router, prompts, serve_args, cores, command=command, env=env, restart_after=args.step_timeout
    )
    return front, path


async def serve_front(front, server, sock, options, ready) -> int:
    """Start the replicas, then serve (``server`` from ``make_server``) on ``sock`` until it is told to stop;
    the replicas stop after it. ``ready()`` makes the ready line once the replicas are up. 1 (with the
    one-line error on stderr) when a replica cannot start."""
    from hydragen.dp.replicas import ReplicaStartError

    try:
        await front.start()
    except ReplicaStartError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    server.ready = ready()
    try:
        await server.serve(sockets=[sock])
    finally:
        await front.stop(options.shutdown_timeout)
    return 0


def run_data_parallel(
    args: argparse.Namespace, engine, options, sock, log_level: str, api_key: str | None
) -> int:
    """``hydragen serve --data-parallel-size N`` after its checks, with its port bound: until a signal."""
    from hydragen.dp.front import create_front_app
    from hydragen.server.launch import make_server

    try:
        front, path = build_front(args, engine, api_key, log_level)
    except BaseException:
        sock.close()
        raise
    server = make_server(create_front_app(front, options), options, log_level)
    try:
        return asyncio.run(
            serve_front(front, server, sock, options, lambda: ready_line(args, path, api_key, front))
        )
    finally:
        front.replicas.kill_all()  # only reaches replicas still running after an error or a second signal


def ready_line(args: argparse.Namespace, path, api_key: str | None, front) -> str:
    threads = replica_threads(args, [r.cores for r in front.replicas.replicas])
    name = args.served_model_name or path.stem
    host = f"[{args.host}]" if ":" in args.host else args.host
    replicas = front.replicas.replicas
    kv = min(r.ready.kv_tokens for r in replicas)
    pinned = all(r.cores is not None for r in replicas)
    cores = "/".join(",".join(map(str, r.cores)) for r in replicas) if pinned else "shared"
    quoted = repr(name).replace("{", "{{").replace("}", "}}")  # the line is formatted with the port later
    return (
        f"ready: serving {quoted} on http://{host}:{{port}}/v1 | {len(replicas)} data-parallel replicas "
        f"(router policy {args.router_policy}), each with KV cache {kv} tokens and {threads} "
        f"thread{'s' * (threads != 1)} (cores {cores}) | API key {'required' if api_key else 'not required'}"
    )
