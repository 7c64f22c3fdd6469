"""Streaming a reply with tool calls as OpenAI's ``delta`` objects: content first, then for each call one
delta with its id and name and then its arguments as they are written, which is how the ``openai``
client (and its stream accumulators) put ``message.tool_calls`` back together."""

from __future__ import annotations

from hydragen.tools.formats import CallFormat
from hydragen.tools.parser import scan
from hydragen.tools.spec import new_call_id


class ToolCallStream:
    """One choice's reply, fed as it grows; ``feed`` returns the deltas to send for the new text."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_arguments: list[int] = []
        self.closed = 0

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        self.text += piece
        s = scan(self.text, self.fmt, final)
        deltas = []
        if len(s.content) > self.sent_content:
            deltas.append({"content": s.content[self.sent_content :]})
            self.sent_content = len(s.content)
        for i, call in enumerate(s.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                fn = {"name": call.name, "arguments": ""}
                deltas.append(
                    {"tool_calls": [{"index": i, "id": self.ids[i], "type": "function", "function": fn}]}
                )
            if len(call.arguments) > self.sent_arguments[i]:
                more = call.arguments[self.sent_arguments[i] :]
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": more}}]})
                self.sent_arguments[i] = len(call.arguments)
        self.closed = sum(c.closed for c in s.calls)
        return deltas


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason for a reply that made ``calls`` complete calls: "tool_calls" when it ended by
    itself after calling, else the engine's reason ("length" stays "length")."""
    return "tool_calls" if calls and reason == "stop" else reason
