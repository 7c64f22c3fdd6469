"""`hydragen chat` as a person uses it: a real process on a pseudo-terminal, keys in, screen out.

One session covers the acceptance list: replies stream (the reply arrives in several pieces over time),
the conversation is remembered and its earlier turns come from the prefix cache (the statistics line),
Ctrl-C stops a reply but not the chat, /reset, Ctrl-D exits with status 0. A second run pipes input,
with prompt_toolkit (the terminal's prompt) blocked.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from hydragen.engine.config import DEFAULT_PAGE_SIZE
from tests.helpers.paths import SLOWED, SRC

pty = pytest.importorskip("pty")  # POSIX only

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and terminal modes, not screen text
NEWLINE = re.compile(r"\r+\n")  # a line's end on the screen (prompt_toolkit ends a prompt with \r\r\n)
STATS = re.compile(r"\[(\d+) tokens[^\]]*\| prompt (\d+) tokens, (\d+) from the prefix cache\]")
TIMEOUT = 300  # seconds for any one wait: generous, the test machine is shared
STEP_DELAY = 0.05  # seconds before each engine step: the 200-token reply Ctrl-C stops takes >= 10 s


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(TERM="dumb", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


class Terminal:
    """A child process on a pty; ``until`` reads the screen until a pattern shows up.

    Every engine step of the chat waits STEP_DELAY first (``slowed_hydragen.py``): a reply then arrives
    token by token over time, and a long one is still streaming when Ctrl-C comes, however fast the machine.
    """

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes the program, with the pty as its controlling terminal
            os.execve(sys.executable, [sys.executable, SLOWED, str(STEP_DELAY), *argv], _env())
        self.screen = ""
        self.chunks: list[tuple[float, str]] = []  # (arrival time, text) of every read

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def until(self, pattern: str, start: int | None = None) -> re.Match:
        """Read until ``pattern`` matches the screen after offset ``start`` (default: everything)."""
        deadline = time.monotonic() + TIMEOUT
        rx = re.compile(pattern)
        while (m := rx.search(self.screen, start or 0)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; screen:\n{self.screen[-2000:]}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    data = os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    data = ""
                if not data:
                    raise AssertionError(f"the chat ended early; screen:\n{self.screen[-2000:]}")
                self.screen += NEWLINE.sub("\n", ANSI.sub("", data))
                self.chunks.append((time.monotonic(), data))
        return m

    def wait(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:  # drain what is left so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.screen += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError(f"the chat did not exit; screen:\n{self.screen[-2000:]}")


def _turn(term: Terminal, message: str) -> tuple[str, re.Match, int]:
    """Type a message; returns (reply text, its statistics line, number of reads the reply came in)."""
    start = len(term.screen)
    reads_before = len(term.chunks)
    term.send(message + "\r")
    stats = term.until(STATS.pattern, start)
    term.until(r">>> $", stats.end())
    echoed = term.screen.index(message, start) + len(message)
    reply = term.screen[echoed : stats.start()].strip()
    reads = sum(1 for _, text in term.chunks[reads_before:] if text.strip())
    return reply, stats, reads


def test_chat_on_a_terminal():
    term = Terminal(["chat", "--temperature", "0", "--max-tokens", "200"])
    term.until(r"Ctrl-D leaves\.")
    term.until(r">>> $")

    reply, stats, reads = _turn(term, "My name is Zorblax.")
    first_prompt = int(stats.group(2))
    assert reply and int(stats.group(1)) > 0
    assert reads >= 3, term.chunks[-10:]  # echo, then the reply in pieces as tokens come, then statistics

    reply, stats, _ = _turn(term, "What is my name?")
    assert "Zorblax" in reply  # the conversation is remembered...
    # ...from the cache: the first turn's whole KV pages (the chat runs at the default page size)
    cached_whole_pages = first_prompt // DEFAULT_PAGE_SIZE * DEFAULT_PAGE_SIZE
    assert int(stats.group(2)) > first_prompt and int(stats.group(3)) >= cached_whole_pages > 0

    # Ctrl-C while a reply streams: the reply stops, the chat stays.
    start = len(term.screen)
    term.send("Write a very long story about a dragon who learns to cook.\r")
    term.until(r"dragon who learns to cook\.\n\S", start)  # the first piece of the reply is on screen
    term.send("\x03")
    stopped = term.until(STATS.pattern, start)
    assert "(stopped)" in stopped.group(0) and int(stopped.group(1)) < 200
    term.until(r">>> $", stopped.end())

    # Ctrl-C at the prompt is not an exit either; /reset forgets the conversation.
    start = len(term.screen)
    term.send("\x03")
    term.until(r"Ctrl-D or /exit to leave\)\n>>> $", start)
    start = len(term.screen)
    term.send("/reset\r")
    term.until(r"conversation cleared\n>>> $", start)
    _, stats, _ = _turn(term, "What is my name?")
    assert int(stats.group(2)) < first_prompt + 10  # a fresh conversation: only the new question

    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0


# `python -m hydragen` with prompt_toolkit blocked: a piped chat never needs the terminal's prompt
WITHOUT_PROMPT_TOOLKIT = (
    "import runpy, sys; sys.modules['prompt_toolkit'] = None; "
    "runpy.run_module('hydragen', run_name='__main__')"
)


def test_chat_piped():
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_PROMPT_TOOLKIT, "chat", "--temperature", "0", "--max-tokens", "40"],
        input="My name is Zorblax.\n\nWhat is my name?\n",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    replies = run.stdout.splitlines()
    assert len(replies) == 2 and "Zorblax" in replies[1]  # one line per turn, only replies on stdout
    stats = STATS.findall(run.stderr)
    # turn 2 reuses turn 1's whole KV pages from the cache
    page = DEFAULT_PAGE_SIZE
    assert len(stats) == 2 and int(stats[1][2]) >= int(stats[0][1]) // page * page > 0
    assert ">>>" not in run.stdout and "\x1b" not in run.stderr  # no prompt, no colours in a pipe
    assert re.search(r"loaded in [\d.]+ s, \d+ CPU threads? of \d+ cores?", run.stderr)  # its thread count
