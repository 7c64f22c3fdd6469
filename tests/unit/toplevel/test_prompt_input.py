"""The chat's terminal prompt (prompt_toolkit) on a real pseudo-terminal: Ctrl-C interrupts it whenever it
comes, Ctrl-D at an empty line ends the input, a line typed at once is echoed once, and it keeps a history
and takes a multi-line message.

A Ctrl-C that lands before ``input()`` starts waiting for keys is recorded but wakes nothing. The test makes
that certain by raising SIGINT on a helper thread once the prompt is on the screen (the helper cannot run
Python handlers, so the signal is only recorded, and the main thread's wait is not interrupted). Plain
``input()`` then ignores it until a line is entered (the control); the chat's prompt raises
KeyboardInterrupt at once.
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
pytest.importorskip("prompt_toolkit")

from tests.helpers.paths import SRC  # noqa: E402

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    sys.path.insert(0, {src!r})
    from hydragen.prompt_input import TerminalPrompt

    def ctrl_c_in_the_window():
        # The test creates the flag once the prompt is on the screen.
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # recorded; the main thread sleeps on
        print("ARMED", flush=True)

    if sys.argv[2] != "-":
        threading.Thread(target=ctrl_c_in_the_window).start()
    if sys.argv[1] == "plain":
        import readline
        read = input
    else:
        read = TerminalPrompt().input
    for _ in range(int(sys.argv[3])):
        try:
            print("LINE", repr(read(">>> ")), flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        except EOFError:
            print("END", flush=True)
    """
)
TERMINALS = ["dumb", "xterm-256color"]  # prompt_toolkit's plain prompt, and its full one
# Colours, cursor moves and terminal modes, not screen text; and the start of one not read in full yet.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b(\[[0-9;?]*)?$")
PROMPT = ">>>"  # its space is a cursor move on a full terminal


class Child:
    """The child program on a pseudo-terminal; ``until`` reads its screen (the text it wrote, without escape
    sequences) until a pattern shows."""

    def __init__(self, tmp_path: Path, mode: str, term: str, prompts: int, flag: str = "-") -> None:
        script = tmp_path / "child.py"
        script.write_text(CHILD.format(src=str(SRC)))
        # No cursor position requests: this harness is no terminal emulator and would not answer them.
        env = {**os.environ, "TERM": term, "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.execve(sys.executable, [sys.executable, str(script), mode, flag, str(prompts)], env)
        self.written = ""

    @property
    def screen(self) -> str:
        return ANSI.sub("", self.written)

    def until(self, pattern: str, start: int = 0, seconds: float = 120) -> str:
        """The screen from ``start`` once ``pattern`` shows there (or when the time is up: the caller checks).
        The time is only a bound for a broken child: nothing here assumes how fast the machine is."""
        deadline = time.monotonic() + seconds
        while not re.search(pattern, self.screen[start:]) and (left := deadline - time.monotonic()) > 0:
            if select.select([self.fd], [], [], min(left, 0.2))[0]:
                try:
                    self.written += os.read(self.fd, 1024).decode(errors="replace")
                except OSError:
                    break
        return self.screen[start:]

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self) -> None:
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        os.close(self.fd)


def _ctrl_c_in_the_window(tmp_path: Path, mode: str, term: str, until: str) -> tuple[str, str]:
    """The screen until ``until`` shows (after the Ctrl-C was raised), then the screen after a line is
    entered."""
    flag = tmp_path / "prompt-is-drawn"
    child = Child(tmp_path, mode, term, 2, str(flag))
    try:
        child.until(PROMPT)
        flag.touch()
        first = child.until(until)
        assert "ARMED" in first, first
        child.send("hello\r")
        return first, child.until(r"(LINE 'hello'|INTERRUPTED)\r\n", len(first))
    finally:
        child.close()


@pytest.mark.parametrize("term", TERMINALS)
def test_ctrl_c_in_the_window_interrupts_the_prompt(tmp_path, term):
    both = r"(?s)(?=.*ARMED)(?=.*INTERRUPTED)"  # in either order: the prompt may answer before ARMED prints
    first, after = _ctrl_c_in_the_window(tmp_path, "prompt", term, until=both)
    assert "INTERRUPTED" in first, first
    assert "LINE 'hello'" in after, after  # the next prompt works normally


def test_plain_input_misses_it(tmp_path):
    """The control: with ``input()`` the same Ctrl-C waits for a line and then throws that line away."""
    pytest.importorskip("readline")
    first, after = _ctrl_c_in_the_window(tmp_path, "plain", "dumb", until="ARMED")
    assert "INTERRUPTED" not in first, first
    assert "INTERRUPTED" in after and "LINE 'hello'" not in after, after


@pytest.mark.parametrize("term", TERMINALS)
def test_keys_at_the_prompt(tmp_path, term):
    """Ctrl-C, history (up arrow), Alt-Enter for a second line, a pasted text of two lines, Ctrl-D: each
    typed as soon as the line before is read, as a fast typist would."""
    child = Child(tmp_path, "prompt", term, 6)
    try:
        steps = [
            ("first\r", "LINE 'first'"),
            ("\x03", "INTERRUPTED"),
            ("\x1b[A\r", "LINE 'first'"),  # up arrow: the line before, again
            ("one\x1b\rtwo\r", r"LINE 'one\\ntwo'"),  # Alt-Enter (Esc, Enter) starts a new line
            ("\x1b[200~a\rb\x1b[201~\r", r"LINE 'a\\nb'"),  # a bracketed paste keeps its line break
            ("\x04", "END"),
        ]
        child.until(PROMPT)
        for keys, shows in steps:
            seen = len(child.screen)
            child.send(keys)
            assert re.search(shows, child.until(shows + rf"(.|\n)*{PROMPT}|END", seen)), (keys, child.screen)
        if term == "dumb":  # no redrawing here: a line typed at once is on the screen once
            assert ">>> first\r\r\nLINE 'first'" in child.screen, child.screen
    finally:
        child.close()
