"""A benchmark's peer engine (llama.cpp, transformers) in a process of its own, so that a peer that crashes
ends only itself. llama-cpp-python built with llama.cpp's AMX path segfaults inside ``llama_decode`` on an
Intel Xeon with AMX; in the benchmark's own process that ended the whole run with signal 11, no message and
no partial output. Here the benchmark is told which peer crashed, how (the signal or exit status) and the
peer's last lines of output, and goes on without it.

The peer is built in the child (``make(*args, **kwargs)``) and every call runs there (``fn(peer, *args)``;
``make`` and ``fn`` are pickled by name, so they are module-level). A timer (``llamacpp_peer.timer``,
``e2e.time_hf``) runs in the child as it ran in the benchmark's process before, timing itself around the
same calls: the pipe's cost lies outside every timed region, and the times compare with earlier runs. The
child runs with the parent's torch thread count and ``sys.path``, and ends when the parent closes it or
dies.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection, Pipe
from typing import Any

import torch

KEPT_LINES = 64  # the child's last lines of output, kept for a crash report


class PeerCrashed(RuntimeError):
    """The peer's process ended in the middle of a call: a signal (a segfault) or an exit."""

    def __init__(self, peer: str, how: str, last_lines: list[str]):
        said = f"; its last output: {' | '.join(last_lines)}" if last_lines else "; it printed nothing"
        super().__init__(f"{peer} crashed ({how}){said}")
        self.peer, self.how, self.last_lines = peer, how, last_lines


def crash_lines(lines: list[str], most: int = 3) -> list[str]:
    """What a crash report quotes of the child's last output: its own last ``most`` lines and, when Python's
    fault handler reported the crash, its first line and the innermost ``most`` frames (where it crashed:
    ``llama_decode`` in the peer's ``_decode``), not the list of extension modules that ends it."""
    lines = [line.strip() for line in lines if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is None:
        return lines[-most:]
    frames = [line for line in lines[fatal:] if line.startswith("File ")]
    return lines[max(0, fatal - most) : fatal + 1] + frames[:most]


def exit_words(returncode: int | None) -> str:
    """'signal 11, SIGSEGV' or 'exit status 3'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {-returncode}, {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class PeerProcess:
    """A peer built and called in a child process; ``call`` raises PeerCrashed when the child dies."""

    def __init__(self, name: str, make: Callable[..., Any], *args: Any, **kwargs: Any):
        self.name = name
        ours, theirs = Pipe()
        self._conn: Connection | None = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hydragen.bench.peers.peer_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # anything the peer prints, on this process's stderr
            stderr=subprocess.STDOUT,
        )
        theirs.close()
        self._tail: deque[str] = deque(maxlen=KEPT_LINES)
        self._relay = threading.Thread(target=self._relay_output, daemon=True)
        self._relay.start()
        try:
            self._request(("setup", list(sys.path), torch.get_num_threads()))
            self._request(("make", make, args, kwargs))
        except BaseException:
            self.close()
            raise

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(peer, *args)`` run in the child, its result back (an exception it raises is raised here)."""
        return self._request(("call", fn, args))

    def _request(self, message: tuple) -> Any:
        if self._conn is None:
            raise RuntimeError(f"{self.name}'s process is closed")
        try:
            self._conn.send(message)
            kind, value = self._conn.recv()
        except (EOFError, OSError):  # the child died: a closed pipe, or a reset one
            raise self._crashed() from None
        if kind == "error":
            raise value
        return value

    def _crashed(self) -> PeerCrashed:
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # the pipe broke but the process lives on: end it
            self._proc.kill()
            self._proc.wait()
        self._relay.join(timeout=5)  # its last lines
        self._close_pipe()
        return PeerCrashed(self.name, exit_words(self._proc.returncode), crash_lines(list(self._tail)))

    def _relay_output(self) -> None:
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def _close_pipe(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Ends the child (it frees the peer as it exits)."""
        if self._conn is not None:
            with contextlib.suppress(OSError):  # already gone
                self._conn.send(("close",))
            self._close_pipe()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._relay.join(timeout=5)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_conn", None) is not None:
            with contextlib.suppress(Exception):  # at exit: the child ends by itself once the pipe closes
                self.close()


def in_peer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(peer, *args)`` as the benchmark calls it on a PeerProcess: run in the peer's process."""
    return partial(_call_in, fn)


def _call_in(fn: Callable[..., Any], remote: PeerProcess, *args: Any) -> Any:
    return remote.call(fn, *args)


def _reply(conn: Connection, kind: str, value: Any) -> None:
    try:
        conn.send((kind, value))
    except Exception as e:  # an exception (or a result) that does not pickle: its words still go back
        conn.send(("error", RuntimeError(f"{type(value).__name__}: {value} (unpicklable: {e})")))


def serve(fd: int) -> None:
    """The child: build the peer, then run calls until the parent closes the pipe."""
    faulthandler.enable()  # a crash prints the Python stack first: the lines the parent reports
    conn = Connection(fd)
    peer = None
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        except Exception as e:  # a message naming what this process cannot import
            _reply(conn, "error", e)
            continue
        kind = message[0]
        if kind == "close":
            return
        try:
            if kind == "setup":
                sys.path[:] = message[1]
                torch.set_num_threads(message[2])
                result = None
            elif kind == "make":
                _, make, args, kwargs = message
                peer = make(*args, **kwargs)
                result = None
            else:
                _, fn, args = message
                result = fn(peer, *args)
        except Exception as e:
            import traceback

            traceback.print_exc()
            _reply(conn, "error", e)
            continue
        _reply(conn, "ok", result)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
