"""A reply's text split into its reasoning and its answer, whole or while it streams.

``ReasoningSplitter`` is fed the reply in pieces, as the engine reports them, and returns what each piece
adds to the reasoning and to the answer (the *content*). It never hands out text it may still have to
take back: an end of the reasoning that could be the start of ``</think>`` (``</th``), whitespace that may
turn out to end the reasoning or begin the answer, and, while a reply may still open its reasoning, a start
that could be ``<think>``. A whole reply is the same splitter fed once (``split_reasoning``), so the two
agree by construction.

What comes out: the reasoning is the text between the tags without the whitespace around it (None when the
reply had no reasoning, or an empty block); the content is the text after ``</think>`` without the
whitespace that follows the tag, or the whole reply when it did not reason. A reply that ends inside its
reasoning (``max_tokens``) has only reasoning, and its content is "". The tags themselves are in neither.
"""

from __future__ import annotations

from hydragen.reasoning.formats import CONTENT, OPENING, REASONING, ReasoningFormat


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One reply's text, fed as it grows. ``phase``: where the reply starts (``ReasoningFormat.first_phase``
    of its prompt). ``reasoned``: whether it has had a reasoning block so far."""

    def __init__(self, fmt: ReasoningFormat, phase: str):
        self.start, self.end = fmt.start, fmt.end
        self.phase = phase
        self.reasoned = phase == REASONING
        self._held = ""  # text not decided yet
        self._fresh = True  # nothing handed out yet in the current phase (its leading whitespace is dropped)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that ``piece`` adds; ``final``: the reply has ended, decide everything."""
        text, self._held = self._held + piece, ""
        reasoning = content = ""
        if self.phase == OPENING:
            text = self._opening(text, final)
            if text is None:
                return "", ""
        if self.phase == REASONING:
            reasoning, text = self._reasoning(text, final)
            if text is None:
                return reasoning, ""
        content = self._content(text, final)
        return reasoning, content

    def _opening(self, text: str, final: bool) -> str | None:
        """Decide whether the reply opens its reasoning; None while it cannot tell yet."""
        bare = text.lstrip()
        if bare.startswith(self.start):
            self.phase, self.reasoned = REASONING, True
            return bare[len(self.start) :]
        if not final and self.start.startswith(bare):  # "", "<", "<thi": wait for more
            self._held = text
            return None
        self.phase, self._fresh = CONTENT, False  # a reply that does not reason: its text is content as is
        return text

    def _reasoning(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning handed out, the text after the reasoning's end, or None while it goes on)."""
        if self._fresh:
            bare = text.lstrip()
            if not final and (not bare or self.start.startswith(bare)):
                self._held = text  # only whitespace, or maybe a repeated "<think>", so far
                return "", None
            if bare.startswith(self.start):  # the prompt opened the block and the reply opens it again
                bare = bare[len(self.start) :].lstrip()
            text = bare
        at = text.find(self.end)
        if at >= 0:
            self.phase, self._fresh = CONTENT, True
            out = text[:at].rstrip()
            return out, text[at + len(self.end) :]
        if final:
            out = text.rstrip()
        else:
            keep_from = len(text) - _partial_suffix(text, self.end)
            out = text[:keep_from].rstrip()
            self._held = text[len(out) :]
        if out:
            self._fresh = False
        elif self._fresh:
            self._held = text if not final else ""
        return out, None

    def _content(self, text: str, final: bool) -> str:
        if self._fresh:  # just after the reasoning: the whitespace after the tag is not the answer's
            text = text.lstrip()
            if not text:
                return ""
            self._fresh = False
        return text


def split_reasoning(text: str, fmt: ReasoningFormat, phase: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished reply that started in ``phase``."""
    splitter = ReasoningSplitter(fmt, phase)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning or None), content
