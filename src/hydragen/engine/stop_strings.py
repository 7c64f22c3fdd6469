"""Stop strings found in streamed text at O(new text + longest stop) cost per chunk.

Each stop string has a Knuth-Morris-Pratt matcher whose state (how many of its first characters end the
text seen so far) carries across chunks, so a stop split over chunks is found without rescanning. Text
is released as soon as no stop string can start in it: the checker holds back only the longest suffix
that is a proper prefix of some stop, at most ``max(len(stop)) - 1`` characters.

"Earliest" means the stop that a character-by-character reader sees complete first; among stops that
complete at the same character, the longest (the one starting first) wins. This makes the result
independent of how the text was cut into chunks. The text is cut where that stop starts.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be a list of non-empty strings")
        self.stops = list(stops)
        self._failure = [_failure_function(s) for s in self.stops]
        self._states = [0] * len(self.stops)
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Consume newly stable text; returns (text safe to emit now, the stop string hit or None).

        After a hit the returned text ends where the stop string starts and the checker is done.
        """
        if self.hit is not None:
            raise ValueError(f"StopChecker.feed() after the stop string {self.hit!r} was hit")
        buffer = self._held + text
        base = len(self._held)
        for offset, char in enumerate(text):
            best_length = 0
            for i, stop in enumerate(self.stops):
                state = self._states[i]
                while state and stop[state] != char:
                    state = self._failure[i][state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    if state > best_length:
                        best_length, self.hit = state, stop
                    state = self._failure[i][state - 1]
                self._states[i] = state
            if best_length:
                self._held = ""
                return buffer[: base + offset + 1 - best_length], self.hit
        keep = max(self._states, default=0)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """End of the text without a hit: the held-back characters can no longer start a stop."""
        held, self._held = self._held, ""
        return held


def _failure_function(pattern: str) -> list[int]:
    """failure[j]: length of the longest proper prefix of pattern[: j + 1] that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for j in range(1, len(pattern)):
        while k and pattern[j] != pattern[k]:
            k = failure[k - 1]
        if pattern[j] == pattern[k]:
            k += 1
        failure[j] = k
    return failure
