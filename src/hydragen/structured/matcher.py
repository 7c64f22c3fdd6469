"""One sequence's position in its grammar: which tokens may come next, what text is forced, when it ends.

A thin layer over an llguidance matcher that turns its error state (it never raises for a grammar or
token problem) into an exception naming what went wrong, so the engine fails that request alone.
"""

from __future__ import annotations


class GrammarViolation(RuntimeError):
    """The sequence left its grammar (a token the mask should have excluded, or a backend error)."""


class GrammarState:
    def __init__(self, matcher):
        self.matcher = matcher

    # The step's mask: whether this state masks its row now, and tokens it allows beyond its grammar's
    # (``AfterReasoning`` leaves the reasoning unmasked and lets a reply open it).
    masked = True
    also_allowed: tuple[int, ...] = ()

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the sequence ends here."""
        return self.matcher.is_stopped()

    def _check(self, ok: bool, what: str) -> None:
        if not ok or self.matcher.is_error():
            raise GrammarViolation(f"{what}: {self.matcher.get_error() or 'rejected by the grammar'}")

    def accept(self, token: int) -> bool:
        """Advance over ``token``; True (the grammar took it: ``AfterReasoning`` may say otherwise)."""
        self._check(self.matcher.consume_token(token), f"token {token} does not fit the grammar")
        return True

    def accept_all(self, tokens: list[int]) -> None:
        self._check(self.matcher.consume_tokens(tokens), f"tokens {tokens[:8]} do not fit the grammar")

    def fits(self, tokens: list[int]) -> bool:
        """Whether the grammar would take ``tokens`` next (the state does not change)."""
        return self.matcher.validate_tokens(tokens) == len(tokens)

    def rollback(self, count: int) -> None:
        self._check(self.matcher.rollback(count), f"cannot roll back {count} tokens")

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, as the tokenizer would split the forced text, minus a
        last token that a longer token could replace once more text follows (llguidance's rule)."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())
