"""Ctrl-C at a prompt interrupts it even when it lands before readline starts waiting for keys.

Such a Ctrl-C is recorded but wakes nothing: the main thread's wait never sees it. The test makes that
certain by raising SIGINT on a helper thread once the prompt is on the screen (the helper cannot run Python
handlers, so the signal is only recorded, and the main thread's wait is not interrupted). Plain ``input()``
then ignores it until a line is entered; ``PromptReader.input`` must raise KeyboardInterrupt at once.
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
    import os, readline, signal, sys, threading, time
    sys.path.insert(0, {src!r})
    from hydragen.prompt_input import PromptReader

    def ctrl_c_in_the_window():
        # The test creates the flag once the prompt is on the screen.
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # recorded; the main thread sleeps on
        print("ARMED", flush=True)

    threading.Thread(target=ctrl_c_in_the_window).start()
    with PromptReader() as reader:
        read = reader.input if sys.argv[1] == "reader" else input
        for _ in range(2):
            try:
                print("LINE", read(">>> "))
            except KeyboardInterrupt:
                print("INTERRUPTED")
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
        return first, _screen_until(fd, r"(LINE hello|INTERRUPTED)\r\n", 120)
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
