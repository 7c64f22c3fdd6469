"""Start a tensor-parallel group for ``LLM(..., tensor_parallel_size=N)`` and take it down again.

Two ways in:

* **spawned** (plain ``tensor_parallel_size``): this process is rank 0 and starts ranks 1..N-1 itself as
  ``python -m hydragen.tp.spawned`` processes, meeting them through a file store in a private
  temporary folder. Each reports "started", then "loaded" (or the error that stopped it) on a pipe, so a
  worker that cannot load its shard is a clear error here, not a timeout. The workers are reaped on
  ``close()``, at interpreter exit, on error and when they die; they exit by themselves if this process
  dies (parent-death signal, and a watchdog on the parent's pid).
* **torchrun** (``WORLD_SIZE`` > 1 in the environment): the ranks exist already; rank 0 builds the
  engine, the others call ``run_torchrun_worker``; torchrun itself reaps them.

The C++ CPU ops are compiled (or loaded) here before any worker starts, so N processes never
race to build them, and torch gets ``cores // N`` threads per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

from hydragen.model.loader import keeps_compact, random_config, random_gguf_or
from hydragen.tp.checkpoint import load_shard, read_config
from hydragen.tp.coordinator import DEATH_GRACE_S, Coordinator, TPPagePool, TPRunner
from hydragen.tp.group import TPGroup, join_group, torchrun_env
from hydragen.tp.sharding import Shard, check_split
from hydragen.tp.worker import serve_rank

START_TIMEOUT_S = float(os.environ.get("HYDRAGEN_TP_START_TIMEOUT", "600"))


def threads_per_rank(world: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // world)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CPU for every rank; on CUDA, one GPU per rank counting from the requested one."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TensorParallel:
    """Rank 0's handle on the group: its shard, the coordinator, and (spawned) the worker processes."""

    def __init__(self, group: TPGroup, model, cfg, path: Path, shard: Shard, procs=(), store_dir=None):
        self.group, self.model, self.config, self.model_path, self.shard = group, model, cfg, path, shard
        self.procs: list[subprocess.Popen] = list(procs)
        self.coordinator = Coordinator(group, self.dead_workers)
        self._finalizer = weakref.finalize(self, _take_down, self.coordinator, self.procs, group, store_dir)

    @property
    def world(self) -> int:
        return self.group.world

    def failure(self) -> str | None:
        """Why the group cannot run a step (a worker died, hung or fell out of step), or None."""
        return self.coordinator.failure()

    def dead_workers(self) -> list[str]:
        return [_exit_text(rank, p) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]

    # ---- what the EngineCore builds through (see EngineCore(parallel=...)) -----------------------------
    def make_pool(
        self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, layout=None
    ) -> TPPagePool:
        """Rank 0's page pool: the same pages as every rank's, each holding this rank's KV heads."""
        heads = self.shard.kv_heads
        pool = TPPagePool(num_layers, num_pages, page_size, heads, head_dim, dtype, device, layout)
        pool.coordinator = self.coordinator
        return pool

    def make_runner(self, model, cfg, pool, device, attention: str) -> TPRunner:
        if attention == "triton":
            raise ValueError("attention='triton' is not supported with tensor_parallel_size > 1")
        runner = TPRunner(model, cfg, pool, device, attention)
        runner.attention_name, runner.coordinator = attention, self.coordinator
        runner.setup_workers()
        return runner

    def close(self) -> None:
        """Stop the workers (STOP, then kill what is left after a few seconds) and leave the group."""
        self._finalizer()


def _exit_text(rank: int, proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"worker rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
    return f"worker rank {rank} (pid {proc.pid}) exited with code {code}"


def _take_down(coordinator: Coordinator, procs: list[subprocess.Popen], group: TPGroup, store_dir) -> None:
    told = coordinator.stop()
    deadline = time.monotonic() + (5.0 if told else 0.0)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()
    if told or not procs:
        group.close()  # a broken gloo group is left alone: tearing it down can wait on dead peers
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)


def start(
    model,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
    random_weights: bool = False,
    dequantize: bool = False,
) -> TensorParallel:
    """Rank 0 of a new (spawned) or existing (torchrun) group, with its shard loaded and workers ready."""
    if attention == "triton":
        raise ValueError("attention='triton' is not supported with tensor_parallel_size > 1")
    model, random_weights = random_gguf_or(model, random_weights)
    if random_weights:
        check_split(random_config(model)[0], world)
    else:
        cfg, _, blocks = read_config(model, keeps_compact(device, dtype, dequantize))
        check_split(cfg, world, blocks)
    env = torchrun_env()
    if env is not None:
        if env.world != world:
            raise ValueError(
                f"tensor_parallel_size {world} does not match the {env.world} ranks torchrun started "
                "(WORLD_SIZE); pass --tensor-parallel-size equal to the number of ranks"
            )
        if env.rank != 0:
            raise RuntimeError("only rank 0 builds the LLM; other ranks run run_torchrun_worker()")
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", env.world))))
        return _start_rank0(
            model,
            world,
            rank_device(device, env.local_rank),
            dtype,
            random_weights,
            "env://",
            dequantize=dequantize,
        )
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {world} needs {world} GPUs from {device}, but torch sees "
            f"{torch.cuda.device_count()}"
        )
    _prepare_native_ops(device)
    torch.set_num_threads(threads_per_rank(world))
    store_dir = tempfile.mkdtemp(prefix="hydragen-tp-")
    init_method = f"file://{store_dir}/store"
    procs, pipes = [], []
    try:
        for rank in range(1, world):
            proc, pipe = _spawn(rank, world, init_method, model, device, dtype, random_weights, dequantize)
            procs.append(proc)
            pipes.append(pipe)
        _await(procs, pipes, "started")
        tp = _start_rank0(
            model, world, device, dtype, random_weights, init_method, procs, store_dir, dequantize, pipes
        )
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
    try:
        _await(procs, pipes, "loaded")
    except BaseException:
        tp.close()
        raise
    finally:
        for pipe in pipes:
            pipe.close()
    return tp


def _start_rank0(
    model,
    world,
    device,
    dtype,
    random_weights,
    init_method,
    procs=(),
    store_dir=None,
    dequantize=False,
    pipes=(),
):
    try:
        group = join_group(0, world, init_method, device)
    except Exception as e:
        if (dead := _dead_worker(procs, pipes, DEATH_GRACE_S)) is not None:
            raise RuntimeError(f"tensor-parallel {dead} while starting") from e
        raise
    try:
        net, cfg, path, shard = load_shard(model, 0, world, device, dtype, random_weights, dequantize)
    except BaseException:
        for p in procs:
            p.kill()
        group.close()
        raise
    net.attach(group, shard.vocab[0], cfg.vocab_size)
    return TensorParallel(group, net, cfg, path, shard, procs, store_dir)


def _prepare_native_ops(device: torch.device) -> None:
    """Build (or load) the C++ ops once, here, before N processes would each want them."""
    if device.type == "cpu":
        from hydragen.native.build import load_ops

        load_ops()


def _spawn(rank, world, init_method, model, device, dtype, random_weights, dequantize=False):
    read_fd, write_fd = os.pipe()
    spec = {
        "rank": rank,
        "world": world,
        "init_method": init_method,
        "model": None if model is None else str(model),
        "device": str(rank_device(device, rank)),
        "dtype": str(dtype).removeprefix("torch."),
        "random_weights": bool(random_weights),
        "dequantize": bool(dequantize),
        "parent": os.getpid(),
        "status_fd": write_fd,
    }
    threads = str(threads_per_rank(world))
    env = worker_env(OMP_NUM_THREADS=threads, HYDRAGEN_TP_THREADS=threads)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydragen.tp.spawned", json.dumps(spec)],
        env=env,
        pass_fds=(write_fd,),
        stdin=subprocess.DEVNULL,
        start_new_session=False,
    )
    os.close(write_fd)
    return proc, os.fdopen(read_fd, "r")


def worker_env(**overrides: str) -> dict[str, str]:
    """The environment for a worker process: this one's, with ``overrides``, and the folder holding this
    hydragen package first on its path, so the worker runs the same code."""
    env = dict(os.environ, **overrides)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    return env


def _await(procs: list[subprocess.Popen], pipes, stage: str) -> None:
    """Wait until every worker reports ``stage``; a worker's error or death raises, naming it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = dict(enumerate(pipes, start=1))
    while waiting:
        ready, _, _ = select.select(list(waiting.values()), [], [], 0.2)
        for rank, pipe in list(waiting.items()):
            if pipe not in ready:
                continue
            line = pipe.readline().strip()
            if line == stage:
                del waiting[rank]
            elif line.startswith("error "):
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {line[6:]}")
            elif not line:  # pipe closed: the worker is gone
                procs[rank - 1].wait(timeout=5)
                raise RuntimeError(f"tensor-parallel {_exit_text(rank, procs[rank - 1])} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel workers {sorted(waiting)} not {stage} after {START_TIMEOUT_S} s"
            )


def _dead_worker(procs: list[subprocess.Popen], pipes, grace: float) -> str | None:
    """The first spawned worker whose status pipe closes unreported within ``grace`` seconds (it died),
    described; None when none does (those that report something live on, for now).

    Rank 0 asks when its own join failed. gloo's handshake is not symmetric: a worker's join can return
    while rank 0's is still reading its side of it, so a worker that dies right after joining (running out
    of memory as it loads its shard) can fail rank 0's join ("Connection closed by peer") instead of being
    seen at the wait for "loaded". Its death closes its status pipe as it closes its sockets, so the pipe
    tells, within a moment, whether that is what happened."""
    deadline = time.monotonic() + grace
    waiting = dict(enumerate(pipes, start=1))
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting.values()), [], [], left)
        for rank, pipe in list(waiting.items()):
            if pipe not in ready:
                continue
            if pipe.readline():  # a report ("loaded", or its own error): it did not die here
                del waiting[rank]
                continue
            procs[rank - 1].wait(timeout=5)
            return _exit_text(rank, procs[rank - 1])
    return None


def run_torchrun_worker(
    model, device: torch.device, dtype: torch.dtype, random_weights: bool = False, dequantize: bool = False
) -> int:
    """A non-zero torchrun rank: join, load the shard, follow rank 0 until it stops. Returns an exit code."""
    env = torchrun_env()
    if env is None or env.rank == 0:
        raise RuntimeError("run_torchrun_worker is for ranks 1..N-1 of a torchrun job")
    device = rank_device(device, env.local_rank)
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", env.world))))
    group = join_group(env.rank, env.world, "env://", device)
    try:
        net, cfg, _, shard = load_shard(model, env.rank, env.world, device, dtype, random_weights, dequantize)
        net.attach(group, shard.vocab[0], cfg.vocab_size)
        return serve_rank(group, net, cfg, shard, dtype)
    finally:
        group.close()
