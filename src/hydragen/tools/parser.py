"""Reading tool calls out of a reply, whole or while it streams.

``scan`` reads as far as the text allows: the content before the first call, each call's name once its
header is complete, its arguments as far as they are written, and whether it is closed. A reply that is
still growing is scanned again as it grows; what the scan reports never changes once reported, so
streaming can send it at once (``tools/stream.py``). Grammar-enforced replies always have this shape;
the scan stays lenient about whitespace so a reply written without the grammar parses too when it can.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hydragen.tools.formats import CallFormat
from hydragen.tools.spec import ToolCall

_DECODER = json.JSONDecoder()
_STRING = r'"(?:[^"\\]|\\.)*"'


@dataclass
class PartialCall:
    name: str | None = None  # known once the header `{"name": "f", "arguments": ` is complete
    arguments: str = ""  # as far as written (all of it once closed)
    closed: bool = False  # the call's wrapper is complete


@dataclass
class Scan:
    content: str  # text before the first call, as far as it is final
    calls: list[PartialCall] = field(default_factory=list)


def _header(fmt: CallFormat) -> re.Pattern:
    return re.compile(rf'\s*\{{\s*"name"\s*:\s*({_STRING})\s*,\s*"{fmt.arguments_key}"\s*:\s*')


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def scan(text: str, fmt: CallFormat, final: bool) -> Scan:
    """What ``text`` says so far; ``final``: the reply is complete (nothing is held back)."""
    trigger = fmt.trigger
    if fmt.begin:
        at = text.find(trigger)
        if at < 0:
            hold = 0 if final else _partial_suffix(text, trigger)
            content = text[: len(text) - hold]
            return Scan(content if final else content.rstrip())
        pos = at + len(trigger)
    else:  # bare JSON: a reply that starts with "{" is calls
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return Scan(text if (final or stripped) else "")
        at, pos = 0, len(text) - len(stripped)
    out = Scan(text[:at].rstrip())
    header = _header(fmt)
    close = fmt.end.strip()
    while True:
        call = PartialCall()
        out.calls.append(call)
        m = header.match(text, pos)
        if not m:
            return out
        call.name = json.loads(m.group(1))
        start = m.end()
        try:
            _, stop = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            call.arguments = text[start:]
            return out
        call.arguments = text[start:stop]
        rest = re.compile(r"\s*\}\s*" + re.escape(close)).match(text, stop)
        if not rest:
            return out
        call.closed = True
        pos = rest.end()
        nxt = re.compile(r"\s*" + re.escape(fmt.separator.strip()) + r"\s*" + re.escape(trigger)).match(
            text, pos
        )
        if not nxt:
            return out
        pos = nxt.end() if fmt.begin else nxt.end() - 1  # a bare-JSON call starts at its "{"


def parse(text: str, fmt: CallFormat) -> tuple[str | None, list[ToolCall]]:
    """(content or None, the complete calls) of a finished reply. A call the reply left unfinished (it
    hit ``max_tokens``, finish_reason "length") is not returned."""
    s = scan(text, fmt, final=True)
    return (s.content or None), [ToolCall(c.name, c.arguments) for c in s.calls if c.closed]
