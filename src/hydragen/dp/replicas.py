"""Data-parallel replicas: N ``hydragen serve`` processes on loopback, each on its own cores, watched and
started again when they die.

Each replica is ``hydragen serve --host 127.0.0.1 --port 0 --threads k --kv-events-endpoint
tcp://127.0.0.1:0 ...`` with the user's model options. Between fork and exec it is pinned to its share of
the cores (``sched_setaffinity``), put in a session of its own (Ctrl-C in the terminal reaches only the
front, which decides) and set to die with the front (Linux parent-death signal). Its ready line says the
port it bound, its KV cache size and its KV-event addresses.

A replica that exits is reported (a log line naming it and its exit code or signal, ``exits`` counted) and
started again after a backoff that doubles from 0.5 s up to 30 s; no more than ``max_restarts_per_minute``
restarts happen in any minute (the wait is said in the log; ``restart_backoff``). ``replace`` stops a
replica whose process runs on but cannot serve (its engine failed or is stuck: ``dp.health``), and it is
then started again the same way. A replica that cannot start at all when the set starts is an error for
the whole command (``ReplicaStartError``): a bad model option fails once, it does not loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hydragen.restart_backoff import DEFAULT_MAX_PER_MINUTE, RestartBackoff

log = logging.getLogger("hydragen.dp")

START_TIMEOUT_S = float(os.environ.get("HYDRAGEN_DP_START_TIMEOUT", "600"))  # model load included
LOG_LINE = re.compile(r"^(CRITICAL|ERROR|WARNING|INFO|DEBUG):\s+(.*)$")


class ReplicaStartError(RuntimeError):
    """A replica could not start (its own one-line error, or how it ended)."""


@dataclass(frozen=True)
class ReadyLine:
    """What one run of a replica said when it was ready."""

    port: int
    kv_tokens: int
    events: str | None  # its KV-event PUB address
    replay: str | None  # its KV-event replay address

    @classmethod
    def parse(cls, line: str) -> ReadyLine | None:
        m = re.search(r"ready: serving .* on http://127\.0\.0\.1:(\d+)/v1 \| KV cache (\d+) tokens", line)
        if m is None:
            return None
        events = re.search(r"\| KV events (\S+)(?: \(replay (\S+)\))?", line)
        return cls(
            int(m.group(1)),
            int(m.group(2)),
            events.group(1) if events else None,
            events.group(2) if events else None,
        )


@dataclass
class Replica:
    """One replica slot: its cores, and the process running in it now (if any)."""

    index: int
    cores: list[int] | None  # None: not pinned (more replicas than cores)
    process: asyncio.subprocess.Process | None = None
    ready: ReadyLine | None = None
    exits: int = 0  # times its process ended while the set was running, unasked
    replacing: str | None = None  # why ``replace`` stopped the running process (until it is down)
    started_at: float = 0.0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)  # its deaths and restarts so far

    @property
    def restarts(self) -> int:
        """Times it was started again."""
        return self.backoff.restarts

    @property
    def url(self) -> str | None:
        return None if self.ready is None else f"http://127.0.0.1:{self.ready.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


Listener = Callable[[Replica], Awaitable[None]]


def split_cores(cores: list[int], replicas: int) -> list[list[int] | None]:
    """Each replica's cores: an even split of ``cores`` (2 replicas on 2 cores: one core each), or no
    pinning at all when there are more replicas than cores."""
    if replicas > len(cores):
        return [None] * replicas
    return [cores[i * len(cores) // replicas : (i + 1) * len(cores) // replicas] for i in range(replicas)]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up here: the child only calls it (no dynamic loading after fork)
_PR_SET_PDEATHSIG = 1


def _child_setup(cores: list[int] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: pin to ``cores``, die with the front."""

    def setup() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return setup


class ReplicaSet:
    """Starts, watches and restarts the replicas. ``on_up(replica)`` runs once a replica is ready (first
    start and every restart), ``on_down(replica)`` once its process has ended (not on ``stop``)."""

    def __init__(
        self,
        serve_args: list[str],
        cores: list[list[int] | None],
        *,
        on_up: Listener,
        on_down: Listener,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        max_restarts_per_minute: int = DEFAULT_MAX_PER_MINUTE,
        start_timeout: float = START_TIMEOUT_S,
    ):
        self.serve_args = list(serve_args)
        self.replicas = [
            Replica(i, c, backoff=RestartBackoff(max_restarts_per_minute)) for i, c in enumerate(cores)
        ]
        self.on_up, self.on_down = on_up, on_down
        self.command = command or [sys.executable, "-m", "hydragen"]
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.start_timeout = start_timeout
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    # ---- starting -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica at once and wait until all are ready; ReplicaStartError (all stopped again)
        when one cannot start."""
        tasks = {asyncio.ensure_future(self._launch(r)): r for r in self.replicas}
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # the first failure (or our own cancellation) stops the others at once
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            await self.stop(timeout=5)
            error, index = failed[0].exception(), tasks[failed[0]].index
            if isinstance(error, ReplicaStartError):
                raise ReplicaStartError(f"replica {index} could not start: {error}") from None
            raise error
        for r in self.replicas:
            await self.on_up(r)
            self._tasks.append(asyncio.ensure_future(self._supervise(r)))

    async def _launch(self, replica: Replica) -> None:
        """Start the replica's process and wait for its ready line (ReplicaStartError if it ends first)."""
        replica.ready = None
        proc = await asyncio.create_subprocess_exec(
            *self.command,
            "serve",
            *self.serve_args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            start_new_session=True,
            preexec_fn=_child_setup(replica.cores),
            limit=2**20,
        )
        replica.process = proc
        lines: list[str] = []
        try:
            ready = await asyncio.wait_for(self._read_until_ready(proc, lines), self.start_timeout)
        except asyncio.TimeoutError:
            _kill(proc)
            await proc.wait()
            raise ReplicaStartError(f"not ready after {self.start_timeout:g} s") from None
        except BaseException:
            _kill(proc)
            raise
        if ready is None:
            code = await proc.wait()
            errors = [x for x in lines if x.startswith("error:")]
            raise ReplicaStartError(
                errors[-1].removeprefix("error: ")
                if errors
                else f"it {describe_exit(code)}: {' '.join(lines[-3:])}"
            )
        replica.ready, replica.started_at = ready, time.monotonic()
        self._tasks.append(asyncio.ensure_future(self._forward_log(replica, proc)))
        log.info(
            "replica %d ready: pid %d, %s, cores %s, KV cache %d tokens",
            replica.index,
            proc.pid,
            replica.url,
            ",".join(map(str, replica.cores)) if replica.cores is not None else "any",
            ready.kv_tokens,
        )

    @staticmethod
    async def _read_until_ready(proc, lines: list[str]) -> ReadyLine | None:
        """Reads the replica's stderr until its ready line (None: it ended first); keeps what it said."""
        while True:
            raw = await proc.stderr.readline()
            if not raw:
                return None
            line = raw.decode("utf-8", "replace").rstrip("\n")
            lines.append(line)
            del lines[:-50]
            if (ready := ReadyLine.parse(line)) is not None:
                return ready

    async def _forward_log(self, replica: Replica, proc) -> None:
        """A replica's later log lines into ours, named: warnings and errors at their level, the rest (its
        one line per request, which the front also logs) at debug."""
        while raw := await proc.stderr.readline():
            line = raw.decode("utf-8", "replace").rstrip("\n")
            m = LOG_LINE.match(line)
            level = logging.getLevelName(m.group(1)) if m else logging.WARNING
            if level < logging.WARNING:
                level = logging.DEBUG
            log.log(level, "replica %d: %s", replica.index, m.group(2) if m else line)

    # ---- watching -------------------------------------------------------------------------------------
    async def _supervise(self, replica: Replica) -> None:
        """Waits for the replica's process to end, reports it, and starts it again, until ``stop``."""
        while not self._stopping:
            proc = replica.process
            code = await proc.wait()
            if self._stopping:
                return
            ran = time.monotonic() - replica.started_at
            replica.backoff.ended(ran)
            if replica.replacing is None:
                replica.exits += 1
                log.error(
                    "replica %d (pid %d) %s after %.1f s", replica.index, proc.pid, describe_exit(code), ran
                )
            replica.ready = None
            await self.on_down(replica)
            replica.replacing = None
            await self._restart(replica)

    def replace(self, replica: Replica, why: str) -> None:
        """Stop a replica whose process runs but cannot serve; its supervisor then starts it again, with the
        backoff of a dead one. SIGKILL: its engine failed or is stuck, so it has nothing to drain, and a
        stuck step could keep a gentler signal from being handled."""
        proc = replica.process
        if self._stopping or proc is None or proc.returncode is not None:
            return
        replica.replacing = why
        log.error("replica %d (pid %d) is restarted: %s", replica.index, proc.pid, why)
        _kill(proc)

    async def _restart(self, replica: Replica) -> None:
        while not self._stopping:
            delay = self._next_delay(replica)
            log.warning("replica %d: starting it again in %.1f s", replica.index, delay)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            replica.backoff.restarting()
            try:
                await self._launch(replica)
            except ReplicaStartError as e:
                replica.exits += 1
                replica.backoff.start_failed()
                log.error("replica %d could not start again: %s", replica.index, e)
                continue
            await self.on_up(replica)
            return

    def _next_delay(self, replica: Replica) -> float:
        """The backoff, stretched so that at most ``max_restarts_per_minute`` restarts fall in a minute."""
        delay, wait = replica.backoff.delay(), replica.backoff.cap_wait()
        if wait > delay:
            log.error(
                "replica %d restarted %d times in the last minute (the most allowed); next try in %.0f s",
                replica.index,
                len(replica.backoff.recent),
                wait,
            )
            delay = wait
        return delay

    # ---- stopping -------------------------------------------------------------------------------------
    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every replica (each drains what it still has); SIGKILL what is left after ``timeout``."""
        self._stopping = True
        procs = [r.process for r in self.replicas if r.process is not None and r.process.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout)
            if pending:
                log.warning("%d replicas did not stop within %g s: killing them", len(pending), timeout)
                for p in procs:
                    _kill(p)
                await asyncio.wait(pending, timeout=5)
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    def kill_all(self) -> None:
        """SIGKILL every replica now (the front is going away without a graceful stop)."""
        self._stopping = True
        for r in self.replicas:
            if r.process is not None:
                _kill(r.process)


def _kill(proc) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
