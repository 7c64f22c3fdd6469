"""``hydragen serve``: options checked before the model loads, then the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import sys

from hydragen.cli.common import UsageError, engine_config_of
from hydragen.engine.config import EngineConfig


def run_serve(args: argparse.Namespace) -> int:
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
        step_timeout=args.step_timeout,
        max_restarts_per_minute=args.max_restarts_per_minute,
    )
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.log_level.lower() not in LOG_LEVELS:
        problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.api_key is not None and not args.api_key.strip():
        problems.append("--api-key must not be empty")
    try:
        config = engine_config_of(args)
    except UsageError as e:
        problems.append(str(e))
        config = EngineConfig(model=args.model)
    tp = config.tensor_parallel_size
    from hydragen.dp import ray_launch  # imports Ray only when asked to run on it

    if args.ray:
        problems += ray_launch.check(args, tp)
    else:
        problems += data_parallel_problems(args, tp) + ray_launch.flags_without_ray(args)
    if config.model is not None and not os.path.exists(config.model):
        problems.append(f"--model {config.model!r} does not exist")
    try:
        options.check()
    except ValueError as e:
        problems.append(str(e))
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        problems.append("--kv-events-replay-endpoint needs --kv-events-endpoint")
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        address = getattr(args, name)
        if address is not None and not address.startswith(("tcp://", "ipc://")):
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag} must be a ZMQ address like tcp://127.0.0.1:5557, got {address!r}")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    log_level = args.log_level.lower()
    if args.ray:  # Ray Serve's proxy binds the port
        configure_logging(log_level)
        return ray_launch.run(args, config, options, api_key)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.data_parallel_size > 1:
        from hydragen.dp.launch import run_data_parallel

        configure_logging(log_level)
        return run_data_parallel(args, config, options, sock, log_level, api_key)
    try:
        events = kv_event_publisher(args, config.page_size)  # bound before the model loads, like the port
    except Exception as e:
        sock.close()
        print(f"error: cannot publish KV events: {e}", file=sys.stderr)
        return 2
    configure_logging(log_level)

    from hydragen.server.app import create_app
    from hydragen.server.launch import run
    from hydragen.tp.group import torchrun_env

    def build_llm():
        """The LLM with the serve flags, set up to serve (built again on every restart of its group)."""
        from hydragen import LLM

        llm = LLM.from_config(config)
        governor = llm.engine.threads
        if governor is not None:  # said once, if --threads is too many
            governor.on_busy = logging.getLogger("hydragen.server").warning
        if events is not None:
            llm.engine.publish_kv_events(events.publish)
        return llm

    def rebuild_llm():
        if events is not None:
            events.clear_all()  # the new engine's prefix cache starts empty
        return build_llm()

    try:
        llm = build_llm()
    except BaseException:
        sock.close()
        if events is not None:
            events.close()
        raise
    name = args.served_model_name or llm.model_path.stem
    kv = llm.engine.pool.num_slots
    mib = kv * llm.engine.pool.bytes_per_token / 2**20
    host = f"[{args.host}]" if ":" in args.host else args.host
    governor = llm.engine.threads
    ready = (
        f"ready: serving {name!r} on http://{host}:{{port}}/v1 | KV cache {kv} tokens ({mib:.0f} MiB)"
        f" | API key {'required' if api_key else 'not required'}"
        + (f" | {governor.describe()}" if governor is not None else "")
    )
    if events is not None:
        ready += f" | KV events {events.endpoint}" + (
            f" (replay {events.replay_endpoint})" if events.replay_endpoint else ""
        )
    # A group this process spawned can be rebuilt in place; torchrun's ranks are torchrun's to restart.
    restartable = tp > 1 and torchrun_env() is None
    app = create_app(llm, name, options, rebuild=rebuild_llm if restartable else None)
    del llm, governor  # the app owns the LLM now: a restart must be able to free it
    client = app.state.engine_client
    try:
        run(app, sock, options, log_level, ready)
    finally:
        client.close_llm()
        if events is not None:
            events.close()
    return 0


def kv_event_publisher(args: argparse.Namespace, page_size: int):
    """The KV event publisher ``--kv-events-endpoint`` asks for, or None."""
    if not args.kv_events_endpoint:
        return None
    from hydragen.dp.kv_events import KVEventPublisher

    return KVEventPublisher(
        args.kv_events_endpoint, page_size, args.kv_events_replay_endpoint, topic=args.kv_events_topic
    )


def data_parallel_problems(args: argparse.Namespace, tensor_parallel: int) -> list[str]:
    """The --data-parallel-size / --router-* checks (imported only when asked for more than one replica)."""
    if args.data_parallel_size == 1 and args.router_balance_bound >= 0:
        return []
    from hydragen.cpu_threads import usable_cores
    from hydragen.dp.launch import check

    return check(args, len(usable_cores()), tensor_parallel)
