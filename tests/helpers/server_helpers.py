"""Helpers for server tests: a tiny random model that has a tokenizer and a chat template, and a live
server on a loopback port in a background thread (the production server class, bound the same way), and
``hydragen serve`` as a process (``spawn``) with its stderr read on a thread (``Lines``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.helpers.paths import SLOWED

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def byte_level_tokenizer(dest: Path) -> None:
    """Save a 256-token byte-level tokenizer (one token per UTF-8 byte, no merges) with a chat template:
    it fits the tiny models' 256-entry vocabulary exactly, so any generated id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    shifted = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}
    assert set(char_of.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE).save_pretrained(dest)


def tiny_chat_model(tiny_dir: str, dest: Path) -> str:
    """A copy of a tiny random checkpoint (vocab 256) with the byte-level tokenizer beside it."""
    if not dest.exists():
        shutil.copytree(tiny_dir, dest)
        byte_level_tokenizer(dest)
        assert json.loads((dest / "config.json").read_text())["vocab_size"] == 256
    return str(dest)


class LiveServer:
    """``create_app(llm, name, options, rebuild)`` served on 127.0.0.1 by HydragenServer in a thread. With
    ``rebuild``, the server owns the LLM (a restart replaces and frees it): ``self.llm`` is then None."""

    def __init__(self, llm, name: str = "tiny", options=None, rebuild=None):
        from hydragen.server.app import create_app
        from hydragen.server.launch import bind_socket, make_server
        from hydragen.server.options import ServerOptions

        self.llm, self.name = (llm if rebuild is None else None), name
        self.options = options or ServerOptions()
        self.app = create_app(llm, name, self.options, rebuild=rebuild)
        del llm
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, self.options, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def engine(self):
        """The engine being served now."""
        return self.app.state.engine_client.engine

    def headers(self) -> dict[str, str]:
        key = self.options.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request (client disconnects are processed asynchronously)."""
        deadline = time.time() + timeout
        while self.engine.has_unfinished():
            assert time.time() < deadline, "engine still busy"
            time.sleep(0.02)

    def assert_no_leak(self) -> None:
        self.wait_idle()
        usage = self.engine.kv_usage()
        assert usage["used"] == usage["cached"], usage

    def stop(self, timeout: float = 15.0) -> float:
        """Stop like a signal does; returns how long shutting down took."""
        t0 = time.time()
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "server did not stop"
        return time.time() - t0


class StepGate:
    """Holds the engine before each step until the test lets it through, so a request stays in flight
    exactly as long as a test needs, however fast or slow the machine is. The engine's own ``step`` runs
    unchanged once let through.

    Closed at first: ``allow(k)`` lets k more steps pass, ``open()`` lets every step pass, and
    ``wait_at_gate()`` waits until the allowed steps have run and the next one waits at the gate (so what
    the engine did is settled while the test looks at it). ``steps_started`` counts the steps let through.
    """

    def __init__(self, engine):
        self.engine = engine
        self.steps_started = 0
        self._cond = threading.Condition()
        self._allowed: int | None = 0  # steps that may still pass; None: open
        self._waiting = False
        self._step = engine.step

        def gated_step():
            with self._cond:
                self._waiting = True
                self._cond.notify_all()
                passed = self._cond.wait_for(lambda: self._allowed is None or self._allowed > 0, timeout=300)
                self._waiting = False
                assert passed, "the test never let this engine step through"
                if self._allowed is not None:
                    self._allowed -= 1
                self.steps_started += 1
            return self._step()

        engine.step = gated_step

    def allow(self, steps: int = 1) -> None:
        with self._cond:
            if self._allowed is not None:
                self._allowed += steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._allowed = None
            self._cond.notify_all()

    def wait_at_gate(self, timeout: float = 120) -> bool:
        """True once the next step waits at the gate; False if the engine has nothing left to run."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._waiting and self._allowed == 0):
                if not self._waiting and not self.engine.has_unfinished():
                    return False
                assert time.monotonic() < deadline, "no engine step came to the gate"
                self._cond.wait(timeout=0.05)
        return True

    def remove(self) -> None:
        self.open()
        del self.engine.step  # the instance attribute goes: the class's step is back


@contextmanager
def step_gate(engine):
    """A closed StepGate on ``engine`` for the block; removed (and opened) after it."""
    gate = StepGate(engine)
    try:
        yield gate
    finally:
        gate.remove()


class HeldCalls:
    """A stand-in for a function whose calls wait until the test releases them (then run the real one):
    the test knows the work is in progress, for as long as it looks, however fast the machine."""

    def __init__(self, fn):
        self.fn = fn
        self.released = threading.Event()
        self.arrived = 0
        self._cond = threading.Condition()

    def __call__(self, *args, **kwargs):
        with self._cond:
            self.arrived += 1
            self._cond.notify_all()
        assert self.released.wait(timeout=300), "the test never released a held call"
        return self.fn(*args, **kwargs)

    def wait_arrivals(self, n: int, timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.arrived >= n, timeout=timeout), (
                f"{self.arrived} of {n} calls arrived"
            )

    def release(self) -> None:
        self.released.set()


def wait_for_log(caplog, text: str, timeout: float = 60) -> None:
    """Until a captured log record contains ``text`` (the server logs each request when it ends)."""
    deadline = time.monotonic() + timeout
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"no log line with {text!r}"
        time.sleep(0.02)


def metric(url: str, name: str) -> float:
    """The value of gauge or counter ``name`` on the server's /metrics (fails the test if it is missing)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


def free_port() -> int:
    """A loopback port nobody listens on now (for a server started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie counts as gone (its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def all_gone(pids: list[int], timeout: float = 20) -> bool:
    """Waits up to ``timeout`` seconds for every process in ``pids`` to end; True when they all did."""
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(process_alive(p) for p in pids)


def spawn(*args: str, api_key: str = "", step_delay: float | None = None) -> subprocess.Popen:
    """``hydragen serve`` in a process; with ``step_delay``, every engine step waits that long first."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HYDRAGEN_API_KEY": api_key}
    launcher = ["-m", "hydragen"] if step_delay is None else [SLOWED, str(step_delay)]
    return subprocess.Popen(
        [sys.executable, *launcher, "serve", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


class Lines:
    """Collects a process's stderr lines on a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n" + "\n".join(self.lines[-30:]))
