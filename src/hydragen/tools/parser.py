"""Reading tool calls out of a reply, whole or while it streams.

``CallScanner`` is fed the reply in pieces and says what each piece adds (``Content``, ``CallStarted``,
``ArgumentsWritten``, ``CallComplete``): the content before the first call, each call's name once its
header is complete, its arguments as they are written, and when they form a whole JSON object. What it
reports never changes once reported, so streaming can send it at once (``tools/stream.py``), and a whole
reply is the same scanner fed once (``parse``), so the two agree by construction.

The scanner keeps only what it cannot decide yet: a possible start of the call marker, trailing
whitespace, a header being written. So the work for a piece is proportional to the piece plus that
small remainder, never to the reply so far; ``scanned`` counts the characters it examined. Grammar-
enforced replies always have the shape it reads; it stays lenient about whitespace between the parts.

What it reads comes from the format's description (tools/formats.py): a *header* is the text from the
marker (or from the end of the previous call's arguments) up to the next call's arguments, with the
function's name in it (``[TOOL_CALLS] [{"name": "f", "arguments": ``, ``}, {"name": "g", "arguments": ``,
``[TOOL_CALLS]f[ARGS]``); after a call, anything but the next header (the list's closer, say) ends the
calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hydragen.tools.formats import CallFormat
from hydragen.tools.spec import NAME, ToolCall

# A header is `{"name": "f", "arguments": ` (with the end of the previous call and the separator before it)
# and a name of at most 64 characters: one that has not matched within this many characters never will
# (whitespace aside), and the scanner stops looking.
MAX_HEADER = 256
_IN_STRING = re.compile(r'["\\]')  # what ends a run of plain characters inside a JSON string
_OUTSIDE_STRING = re.compile(r'[{}\[\]"]')  # what changes the nesting outside strings


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsWritten:
    index: int
    text: str


@dataclass(frozen=True)
class CallComplete:
    index: int


Event = Content | CallStarted | ArgumentsWritten | CallComplete


@dataclass
class PartialCall:
    name: str
    pieces: list[str] = field(default_factory=list)  # the arguments as written so far
    complete: bool = False  # the arguments are a whole JSON object (they parse)

    @property
    def arguments(self) -> str:
        return "".join(self.pieces)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _lenient(fmt: CallFormat, text: str) -> str:
    """A regex for the literal ``text`` that allows whitespace between its parts (markers, JSON punctuation
    and words) and none inside them."""
    markers = "".join(f"{re.escape(m)}|" for m in sorted(fmt.tokens, key=len, reverse=True))
    parts = re.findall(rf"{markers}[{{}}\[\],:]|[^\s{{}}\[\],:]+", text)
    return r"\s*".join(re.escape(p) for p in parts)


def _header(fmt: CallFormat, before: str) -> str:
    """A regex for a header: ``before`` (the text up to a call's name), the name, and the text up to its
    arguments."""
    return rf"\s*{_lenient(fmt, before)}(?P<name>{NAME.pattern}){_lenient(fmt, fmt.before_arguments)}\s*"


def _patterns(fmt: CallFormat) -> tuple[re.Pattern, re.Pattern]:
    """(the first call's header, from the end of the marker; what follows a call's arguments: the end of
    the call, the separator and the next call's header). Anything else after a call, the list's closer
    included, ends the calls."""
    after_marker = fmt.lead[fmt.lead.index(fmt.marker) + len(fmt.marker) :]
    after_call = rf"\s*{_lenient(fmt, fmt.after_arguments)}"
    return re.compile(_header(fmt, after_marker)), re.compile(
        after_call + _header(fmt, fmt.separator + fmt.before_name)
    )


class _ObjectEnd:
    """Finds where a JSON object ends, across pieces: nesting depth and string state only."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False  # the previous character was a backslash inside a string

    def feed(self, text: str, pos: int) -> int | None:
        """The index just past the object's closing brace, or None when ``text`` ends first."""
        while pos < len(text):
            if self.escaped:
                self.escaped, pos = False, pos + 1
            elif self.in_string:
                m = _IN_STRING.search(text, pos)
                if m is None:
                    return None
                pos = m.end()
                if m.group() == '"':
                    self.in_string = False
                else:
                    self.escaped = True
            else:
                m = _OUTSIDE_STRING.search(text, pos)
                if m is None:
                    return None
                pos, ch = m.end(), m.group()
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth == 0:
                        return pos
        return None


class CallScanner:
    """One reply, fed in pieces; ``feed`` returns the events the new piece adds. ``calls`` are the calls
    seen so far (the last may be unfinished); ``scanned`` counts the characters examined."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.calls: list[PartialCall] = []
        self.scanned = 0
        self._state = "content" if fmt.marker else "start"
        self._whitespace: list[str] = []  # content's trailing whitespace, held until text follows it
        self._tail = ""  # content's end that may be the start of the marker
        self._head = ""  # a call header being written
        self._object: _ObjectEnd | None = None
        self._first, self._next = _patterns(fmt)
        self._pattern = self._first  # the header the scanner looks for now
        self._handlers = {
            "content": self._content,
            "start": self._start,
            "text": self._text,
            "header": self._header,
            "arguments": self._arguments,
        }

    def feed(self, piece: str, final: bool = False) -> list[Event]:
        """The events of ``piece``; ``final``: the reply is complete, so nothing is held back."""
        events: list[Event] = []
        pos = 0
        while pos < len(piece) and self._state != "done":
            pos = self._handlers[self._state](piece, pos, final, events)
        if final and self._state == "content":
            self._content("", 0, True, events)
        return events

    # ---- the states: each consumes from ``pos`` and returns where it stopped ---------------------------
    def _content(self, text: str, pos: int, final: bool, events: list[Event]) -> int:
        """Text before the first call (formats with a marker)."""
        trigger = self.fmt.trigger
        buf = self._tail + text[pos:]
        self.scanned += len(buf)
        at = buf.find(trigger)
        if at >= 0:
            before = buf[:at].rstrip()
            if before:
                events.append(Content("".join(self._whitespace) + before))
            self._whitespace, self._state = [], "header"
            consumed = at + len(trigger) - len(self._tail)
            self._tail = ""
            return pos + consumed
        hold = 0 if final else _partial_suffix(buf, trigger)
        visible, self._tail = buf[: len(buf) - hold], buf[len(buf) - hold :]
        if final:
            rest = "".join(self._whitespace) + visible
            if rest:
                events.append(Content(rest))
            self._whitespace = []
            return len(text)
        kept = visible.rstrip()
        if kept:
            events.append(Content("".join(self._whitespace) + kept))
            self._whitespace = []
        if len(visible) > len(kept):
            self._whitespace.append(visible[len(kept) :])
        return len(text)

    def _start(self, text: str, pos: int, final: bool, events: list[Event]) -> int:
        """Bare-JSON formats: a reply whose first character is "{" is calls, as the grammar has it."""
        self.scanned += 1
        self._state = "header" if text[pos] == self.fmt.trigger else "text"
        return pos

    def _text(self, text: str, pos: int, final: bool, events: list[Event]) -> int:
        """A bare-JSON reply that is not calls: all content."""
        self.scanned += len(text) - pos
        events.append(Content(text[pos:]))
        return len(text)

    def _header(self, text: str, pos: int, final: bool, events: list[Event]) -> int:
        """A call's header (after a call: the rest of that call first)."""
        before = len(self._head)
        self._head += text[pos : pos + MAX_HEADER - before]
        self.scanned += len(self._head)
        m = self._pattern.match(self._head)
        if m is None:
            if len(self._head) >= MAX_HEADER:
                self._state = "done"
            return pos + len(self._head) - before
        self.calls.append(PartialCall(m.group("name")))
        events.append(CallStarted(len(self.calls) - 1, self.calls[-1].name))
        self._head, self._object, self._state = "", _ObjectEnd(), "arguments"
        return pos + m.end() - before

    def _arguments(self, text: str, pos: int, final: bool, events: list[Event]) -> int:
        call, index = self.calls[-1], len(self.calls) - 1
        if not call.pieces:  # whitespace before the object is no part of it; anything else but "{" ends all
            while pos < len(text) and text[pos].isspace():
                pos, self.scanned = pos + 1, self.scanned + 1
            if pos == len(text):
                return pos
            if text[pos] != "{":
                self._state = "done"
                return pos
        end = self._object.feed(text, pos)
        stop = len(text) if end is None else end
        self.scanned += stop - pos
        call.pieces.append(text[pos:stop])
        events.append(ArgumentsWritten(index, text[pos:stop]))
        if end is None:
            return stop
        try:
            json.loads(call.arguments)  # once per call: the object's end is found without parsing it
        except json.JSONDecodeError:
            self._state = "done"
            return stop
        call.complete = True
        events.append(CallComplete(index))
        self._pattern, self._state = self._next, "header"
        return stop


def parse(text: str, fmt: CallFormat, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a finished reply. ``cut``: the reply was cut by ``max_tokens``
    (finish_reason "length"); then a last call it left unfinished is returned too, its arguments as far as
    written (``complete`` False: they do not parse). Otherwise only the complete calls."""
    scanner = CallScanner(fmt)
    content = "".join(e.text for e in scanner.feed(text, final=True) if isinstance(e, Content))
    calls = [
        ToolCall(c.name, c.arguments, fmt.new_id(), complete=c.complete)
        for c in scanner.calls
        if c.complete or cut
    ]
    return (content or None), calls
