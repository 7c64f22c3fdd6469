"""A grammar that starts after the reasoning: a reasoning model's ``<think> ... </think>`` is free text, and
the constraint (JSON Schema, regex, grammar, tool calls) holds for what comes after ``</think>``.

``AfterReasoning`` is a ``GrammarState`` in one of three phases (``hydragen.reasoning``): *reasoning*, where
any token may come (the mask is not applied) until the end-of-reasoning token, after which the grammar starts
from its first state; *opening*, the reply's first token, which may be the start-of-reasoning token (and the
reply then reasons) or any token the grammar allows (and the reply is all answer); *content*, the grammar as
any ``GrammarState``. The engine calls the same methods either way: ``accept``, ``accept_all``, ``fits``,
``done``, ``forced_tokens``; the controller reads ``masked`` and ``also_allowed`` to build the step's mask.
Nothing is forced during the reasoning, nor at the opening (the model chooses whether to reason).
"""

from __future__ import annotations

from hydragen.reasoning.formats import CONTENT, OPENING, REASONING
from hydragen.structured.matcher import GrammarState


class AfterReasoning(GrammarState):
    def __init__(self, matcher, start_id: int, end_id: int, phase: str):
        super().__init__(matcher)
        if phase not in (REASONING, OPENING, CONTENT):
            raise ValueError(f"unknown phase {phase!r}")
        self.start_id, self.end_id, self.phase = start_id, end_id, phase

    @property
    def masked(self) -> bool:
        return self.phase != REASONING

    @property
    def also_allowed(self) -> tuple[int, ...]:
        return (self.start_id,) if self.phase == OPENING else ()

    @property
    def done(self) -> bool:
        return self.phase == CONTENT and super().done

    def _step(self, phase: str, token: int) -> tuple[str, bool]:
        """(the phase after ``token``, whether the grammar takes the token) from ``phase``."""
        if phase == REASONING:
            return (CONTENT if token == self.end_id else REASONING), False
        if phase == OPENING and token == self.start_id:
            return REASONING, False
        return CONTENT, True

    def accept(self, token: int) -> bool:
        self.phase, grammar = self._step(self.phase, token)
        if grammar:
            super().accept(token)
        return grammar

    def accept_all(self, tokens: list[int]) -> None:
        tokens = list(tokens)
        while tokens and self.phase != CONTENT:
            self.accept(tokens.pop(0))
        if tokens:
            super().accept_all(tokens)

    def fits(self, tokens: list[int]) -> bool:
        phase, i = self.phase, 0
        while i < len(tokens) and phase != CONTENT:
            phase, grammar = self._step(phase, tokens[i])
            if grammar:
                break
            i += 1
        rest = list(tokens[i:])
        return not rest or self.matcher.validate_tokens(rest) == len(rest)

    def rollback(self, count: int) -> None:
        if self.phase != CONTENT:
            raise ValueError("cannot roll back tokens of the reasoning")
        super().rollback(count)

    def forced_tokens(self) -> list[int]:
        return super().forced_tokens() if self.phase == CONTENT else []
