"""What a request's reports add up to, in pieces every API's module shares: the counts its usage and log
line need (``Tally``), its whole choices for a non-streaming answer (``Collected``), its token ``Usage``,
token strings for log-probabilities, and server-sent events. None of it knows an API's JSON shapes, so
chat, completions and any API beside them count and stream alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from hydragen.engine.outputs import RequestOutput


class Tally:
    """A request's reports counted as they come: tokens generated, finish reasons, and the final report of
    each of its prompts (which holds the prompt's token counts)."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.reasons: list[str] = []
        self.finals: list[RequestOutput] = []

    def add(self, report: RequestOutput) -> None:
        for piece in report.outputs:
            self.completion_tokens += len(piece.token_ids)
            if piece.finish_reason:
                self.reasons.append(piece.finish_reason)
        if report.finished:
            self.finals.append(report)

    def usage(self) -> Usage:
        return Usage.of(self.finals, self.completion_tokens)


class Collected:
    """A non-streaming request's choices, accumulated from its reports (choice ``first_index + i`` is
    sample ``i`` of the prompt whose reports ``add`` gets), and their ``tally``."""

    def __init__(self) -> None:
        self.tally = Tally()
        self.texts: dict[int, str] = {}
        self.ids: dict[int, list[int]] = {}
        self.lps: dict[int, list] = {}
        self.reasons: dict[int, str | None] = {}

    def add(self, first_index: int, report: RequestOutput) -> None:
        self.tally.add(report)
        for d in report.outputs:
            k = first_index + d.index
            self.texts[k] = self.texts.get(k, "") + d.text
            self.ids.setdefault(k, []).extend(d.token_ids)
            if d.logprobs:
                self.lps.setdefault(k, []).extend(d.logprobs)
            if d.finish_reason:
                self.reasons[k] = d.finish_reason

    def choices(self) -> Iterator[tuple[int, str, list[int], list, str | None]]:
        """(index, text, token ids, logprobs, finish reason) of each choice, in index order."""
        for k in sorted(self.texts.keys() | self.reasons.keys()):
            yield k, self.texts.get(k, ""), self.ids.get(k, []), self.lps.get(k, []), self.reasons.get(k)


@dataclass(frozen=True)
class Usage:
    """A request's tokens: its prompts', the part of them the prefix cache held, and those generated."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, finals: list[RequestOutput], completion_tokens: int) -> Usage:
        """From the final reports of a request's prompts."""
        prompt_tokens = sum(len(r.prompt_token_ids) for r in finals)
        return cls(prompt_tokens, completion_tokens, sum(r.cached_prompt_tokens for r in finals))

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def token_text(tokenizer, token: int) -> str:
    """A token as log-probabilities show it (its id as text for a model without a tokenizer)."""
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
