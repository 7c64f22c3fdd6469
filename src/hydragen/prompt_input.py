"""A terminal prompt for `hydragen chat`, read by prompt_toolkit.

``input()`` lets the terminal turn Ctrl-C into SIGINT and looks at it only when its wait for keys is
interrupted, so a Ctrl-C that lands after the prompt is drawn but before that wait begins is ignored until a
line is entered. prompt_toolkit reads the terminal in raw mode, where Ctrl-C is a key like any other, and
turns a SIGINT that still arrives (sent before raw mode began, or by ``kill``) into that same key: it has no
such window. It also gives line editing, a history (up and down arrows) and multi-line input (Alt-Enter or
Esc then Enter starts a new line; a text pasted where the terminal marks pastes, as xterm's kind do, keeps
its lines).

prompt_toolkit is imported only here, when a prompt is made: piped input never needs it.
"""

from __future__ import annotations

from typing import Any

CONTINUATION = "... "  # the prompt of a message's second and later lines


class TerminalPrompt:
    """A prompt with its own history. ``input`` is ``input()``'s contract: the line (without its newline),
    KeyboardInterrupt on Ctrl-C, EOFError on Ctrl-D at an empty line."""

    def __init__(self) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        self._session: Any = PromptSession(
            history=InMemoryHistory(),
            key_bindings=_new_line_bindings(),
            prompt_continuation=lambda width, line, wrapped: CONTINUATION.rjust(width),
        )

    def input(self, prompt: str) -> str:
        # Raw mode from before the prompt is drawn: on a dumb terminal prompt_toolkit writes the prompt first,
        # and a key typed at once would be echoed twice, by the terminal and by prompt_toolkit.
        with self._session.input.raw_mode():
            return self._session.prompt(prompt)


def _new_line_bindings() -> Any:
    """Alt-Enter (which terminals send as Esc, Enter) inserts a new line; Enter alone sends the message."""
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    return bindings
