"""Streaming a reply with tool calls as OpenAI's ``delta`` objects: content first, then for each call one
delta with its id and name and then its arguments as they are written, which is how the ``openai``
client (and its stream accumulators) put ``message.tool_calls`` back together.

What the stream sends adds up to what the same reply gives unstreamed (``ToolRequest.reply``): the
complete calls, and a call cut by ``max_tokens`` as far as it was written, with finish_reason "length".
A reply can end inside a call for no other reason, except at a stop string or stop token; a request that
has those gets each call whole (``whole_calls``), once its arguments are complete, so that a call a stop
cuts is never sent, as it is not returned unstreamed.
"""

from __future__ import annotations

from hydragen.tools.formats import CallFormat
from hydragen.tools.parser import ArgumentsWritten, CallComplete, CallScanner, CallStarted, Content


class ToolCallStream:
    """One choice's reply, fed as it grows; ``feed`` returns the deltas to send for the new text. Its work
    per piece is proportional to the piece (``CallScanner``). ``complete``: calls whose arguments are
    complete so far."""

    def __init__(self, fmt: CallFormat, whole_calls: bool = False):
        self.scanner = CallScanner(fmt)
        self.whole_calls = whole_calls
        self.complete = 0
        self._held: list[dict] = []  # with whole_calls: the deltas of the call still being written

    def feed(self, piece: str, finish_reason: str | None = None) -> list[dict]:
        """The deltas for ``piece``; ``finish_reason``: the engine's, once the reply has ended."""
        deltas: list[dict] = []
        for event in self.scanner.feed(piece, final=finish_reason is not None):
            if isinstance(event, Content):
                deltas.append({"content": event.text})
            elif isinstance(event, CallStarted):
                fn = {"name": event.name, "arguments": ""}
                start = {
                    "index": event.index,
                    "id": self.scanner.fmt.new_id(),
                    "type": "function",
                    "function": fn,
                }
                self._send([start], deltas)
            elif isinstance(event, ArgumentsWritten):
                self._send([{"index": event.index, "function": {"arguments": event.text}}], deltas)
            elif isinstance(event, CallComplete):
                self.complete += 1
                deltas += self._release()
        if finish_reason == "length":  # a call cut by max_tokens is handed over as far as it was written
            deltas += self._release()
        return deltas

    def _send(self, tool_calls: list[dict], deltas: list[dict]) -> None:
        (self._held if self.whole_calls else deltas).append({"tool_calls": tool_calls})

    def _release(self) -> list[dict]:
        """The held call: its first delta, then its arguments in one piece."""
        if not self._held:
            return []
        first, *rest = self._held
        self._held = []
        if not rest:
            return [first]
        index = first["tool_calls"][0]["index"]
        arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest)
        return [first, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]


def finish_reason(reason: str | None, complete_calls: int) -> str | None:
    """OpenAI's finish_reason for a reply that made ``complete_calls`` complete calls: "tool_calls" when it
    ended by itself after calling, else the engine's reason ("length" stays "length")."""
    return "tool_calls" if complete_calls and reason == "stop" else reason
