"""Ctrl-C at a prompt interrupts it even when it lands before readline starts waiting for keys.

The race is made certain: readline's pre-input hook (it runs after the prompt is drawn, before the wait)
blocks until a helper thread has raised SIGINT. The helper cannot run Python handlers, so the signal is
only recorded, exactly like a Ctrl-C that arrives in that window. Plain ``input()`` then ignores it until a
line is entered; ``PromptReader.input`` must raise KeyboardInterrupt at once.
"""

from __future__ import annotations

import os
import re
import select
import sys
import textwrap
import time
from pathlib import Path

import pytest

pty = pytest.importorskip("pty")  # POSIX only
pytest.importorskip("readline")

SRC = str(Path(__file__).resolve().parents[1] / "src")
CHILD = textwrap.dedent(
    """
    import functools, os, readline, signal, sys, threading, time
    sys.path.insert(0, {src!r})
    from hydragen.prompt_input import PromptReader

    hook_waits = threading.Lock()
    hook_waits.acquire()

    def ctrl_c_in_the_window():
        # The test creates the flag once the prompt is on the screen: from then on the main thread is in
        # readline's C code (drawing done, the hook below, no Python bytecode) and not yet waiting for keys.
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # only recorded, as a real Ctrl-C here
        print("ARMED", flush=True)
        hook_waits.release()

    readline.set_pre_input_hook(functools.partial(hook_waits.acquire, True, 120))
    threading.Thread(target=ctrl_c_in_the_window).start()
    with PromptReader() as reader:
        read = reader.input if sys.argv[1] == "reader" else input
        for _ in range(2):
            try:
                print("LINE", read(">>> "))
            except KeyboardInterrupt:
                print("INTERRUPTED")
            readline.set_pre_input_hook(None)
    """
)


def _screen_until(fd: int, pattern: str, seconds: float) -> str:
    screen, deadline = "", time.monotonic() + seconds
    while not re.search(pattern, screen) and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], min(left, 0.2))[0]:
            try:
                screen += os.read(fd, 1024).decode(errors="replace")
            except OSError:
                break
    return screen


def _run(mode: str, tmp_path: Path, until: str) -> tuple[str, str]:
    """The screen until ``until`` shows (after the Ctrl-C was sent), then the screen after a line is
    entered. The waits are only bounds for a broken child: nothing here assumes how fast the machine is."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(src=SRC))
    flag = tmp_path / "prompt-is-drawn"
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, str(script), mode, str(flag)])
    try:
        drawn = _screen_until(fd, ">>> ", 120)
        flag.touch()
        first = drawn + _screen_until(fd, until, 120)
        assert "ARMED" in first, first
        os.write(fd, b"hello\r")
        return first, _screen_until(fd, r"hello\r\n(LINE hello|INTERRUPTED)\r\n", 120)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)


def test_ctrl_c_in_the_window_interrupts_the_prompt(tmp_path):
    first, after = _run("reader", tmp_path, until="ARMED(.|\n)*INTERRUPTED")
    assert "INTERRUPTED" in first, first
    assert "LINE hello" in after, after  # the next prompt works normally


def test_plain_input_misses_it(tmp_path):
    """The control: without the reader the same Ctrl-C waits for a line and then throws that line away."""
    first, after = _run("plain", tmp_path, until="ARMED")
    assert "INTERRUPTED" not in first, first
    assert "INTERRUPTED" in after and "LINE hello" not in after, after
