"""A terminal prompt that Ctrl-C always interrupts.

CPython's ``input()`` with readline draws the prompt, then waits in ``select()`` on the terminal alone, and
looks at signals only when that wait is interrupted. A Ctrl-C that lands in between (the prompt is on screen,
the wait has not begun) is recorded but wakes nothing: the prompt ignores it until a line is entered. On a
busy machine that window is wide enough to hit.

``PromptReader`` closes it. A watcher thread hears of every SIGINT through the signal wakeup fd; while a
prompt waits and its Ctrl-C has not been handled yet, the watcher interrupts the main thread's wait with a
signal whose handler does nothing, and readline then runs the pending Ctrl-C handler.
"""

from __future__ import annotations

import os
import signal
import threading
import time

KICK = getattr(signal, "SIGUSR1", None)  # interrupts the main thread's select(); its handler does nothing
KICK_EVERY_S = 0.05  # a kick can land in the same window as the Ctrl-C; the next one finds the wait
KICK_FOR_S = 2.0  # then give up: the Ctrl-C was handled elsewhere (it raced the end of the prompt)


def _ignore(signum: int, frame: object) -> None:
    """The kick's handler: its only job is to make select() return EINTR."""


class PromptReader:
    """``input()`` for the main thread, where Ctrl-C raises KeyboardInterrupt at once, whenever it comes.

    Use as a context manager around the whole session: it owns the process's signal wakeup fd and the
    kick signal's handler while open. Off the main thread or without POSIX signals it is plain ``input()``.
    """

    def __init__(self) -> None:
        self._active = False
        self._waiting = False  # a prompt is in input() now
        self._prompt = 0  # which prompt; a kick loop stops when it changes
        self._handled = False  # this prompt's Ctrl-C already raised KeyboardInterrupt

    def __enter__(self) -> PromptReader:
        if KICK is None or threading.current_thread() is not threading.main_thread():
            return self
        self._main = threading.main_thread().ident
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._old_kick = signal.signal(KICK, _ignore)
        self._closing = False
        # The watcher blocks both signals: the kernel hands them to the main thread, whose wait they break.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, KICK})
        try:
            self._watcher = threading.Thread(target=self._watch, name="prompt-ctrl-c", daemon=True)
            self._watcher.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        self._active, self._closing = False, True
        signal.set_wakeup_fd(self._old_wakeup)
        os.write(self._write_fd, b"\0")  # wakes the watcher, which sees _closing and ends
        self._watcher.join()
        signal.signal(KICK, self._old_kick)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def input(self, prompt: str) -> str:
        """Like ``input(prompt)``: raises KeyboardInterrupt on Ctrl-C and EOFError at the end of input."""
        if not self._active:
            return input(prompt)
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        self._prompt += 1
        self._handled, self._waiting = False, True
        try:
            return input(prompt)
        finally:
            self._waiting = False
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self._handled = True
        raise KeyboardInterrupt

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 512)
            except InterruptedError:
                continue
            if self._closing:
                return
            if signal.SIGINT in data and self._waiting:
                self._kick_until_handled(self._prompt)

    def _kick_until_handled(self, prompt: int) -> None:
        deadline = time.monotonic() + KICK_FOR_S
        while self._waiting and self._prompt == prompt and not self._handled and time.monotonic() < deadline:
            signal.pthread_kill(self._main, KICK)
            time.sleep(KICK_EVERY_S)
