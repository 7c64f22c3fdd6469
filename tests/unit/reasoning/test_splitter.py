"""The reasoning splitter: a reply's <think> block apart from its answer, the same whole or in any pieces,
never handing out a partial tag (or text it may still take back) while it streams."""

from __future__ import annotations

import random

import pytest

from hydragen.reasoning.formats import CONTENT, OPENING, REASONING, ReasoningFormat
from hydragen.reasoning.splitter import ReasoningSplitter, split_reasoning

FMT = ReasoningFormat("qwen3", "<think>", "</think>", 1, 2, decode=lambda ids: "")

# (phase, reply, reasoning, content)
CASES = [
    # Qwen3: the reply opens its reasoning itself
    (OPENING, "<think>\nLet me see: 1 < 2.\n</think>\n\nIt is 2.", "Let me see: 1 < 2.", "It is 2."),
    # no reasoning at all: the reply is content as it is, leading whitespace and all
    (OPENING, "\nHello <b>there</b>, see </thin", None, "\nHello <b>there</b>, see </thin"),
    (OPENING, "<thinking>not a tag</thinking>", None, "<thinking>not a tag</thinking>"),
    (OPENING, "", None, ""),
    # an empty block (Qwen3 with thinking off, when the model writes it itself)
    (OPENING, "<think>\n\n</think>\n\nHi.", None, "Hi."),
    # R1 distills: the prompt opened the block, the reply carries only the closing tag
    (
        REASONING,
        "Okay, 2 + 2.\nSo 4.\n</think>\n\nThe answer is 4.",
        "Okay, 2 + 2.\nSo 4.",
        "The answer is 4.",
    ),
    (REASONING, "<think>\nagain</think>x", "again", "x"),  # a reply that opens the block once more
    (REASONING, "cut off mid-thought </thi", "cut off mid-thought </thi", ""),  # max_tokens inside it
    (REASONING, '</think>{"a": 1}', None, '{"a": 1}'),
    # the prompt closed the block (enable_thinking=False): all content, tags and all
    (CONTENT, "<think>x</think>y", None, "<think>x</think>y"),
    # only the first </think> ends the reasoning; what follows is content as it is
    (REASONING, "a</think> b </think> c", "a", "b </think> c"),
]


@pytest.mark.parametrize("phase, reply, reasoning, content", CASES)
def test_a_whole_reply_is_split(phase, reply, reasoning, content):
    assert split_reasoning(reply, FMT, phase) == (reasoning, content)


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("phase, reply, reasoning, content", CASES)
def test_any_pieces_add_up_to_the_whole_split_and_never_show_a_partial_tag(phase, reply, reasoning, content):
    rng = random.Random(hash(reply) & 0xFFFF)
    splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)]  # every single cut
    splits += [list(reply)] + [_pieces(reply, rng) for _ in range(50)]  # one character at a time, at random
    for pieces in splits:
        splitter = ReasoningSplitter(FMT, phase)
        got_r, got_c = "", ""
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, final=i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
            # what was handed out is a start of the final answer: nothing is ever taken back
            assert (reasoning or "").startswith(got_r) and content.startswith(got_c), pieces
        assert (got_r or None, got_c) == (reasoning, content), pieces


def test_a_tag_split_over_pieces_is_held_back_until_it_is_decided():
    s = ReasoningSplitter(FMT, OPENING)
    assert s.feed("<th") == ("", "")  # may still open the reasoning
    assert s.feed("ink>\nStep one") == ("Step one", "")
    assert s.feed(".\n</th") == (".", "")  # "\n</th" could end the reasoning: held
    assert s.feed("ink") == ("", "")
    assert s.feed(">\n") == ("", "")  # whitespace after the tag is not the answer's
    assert s.feed("\nAnswer") == ("", "Answer")
    assert s.feed(" </think> stays") == ("", " </think> stays")
    s = ReasoningSplitter(FMT, REASONING)
    assert s.feed("a </t") == ("a", "")
    assert s.feed("ypo") == (" </typo", "")  # not the tag after all: it was reasoning


def test_the_end_of_a_reply_decides_what_was_held():
    s = ReasoningSplitter(FMT, OPENING)
    assert s.feed("<thi") == ("", "")
    assert s.feed("", final=True) == ("", "<thi")
    s = ReasoningSplitter(FMT, REASONING)
    assert s.feed("why </thin") == ("why", "")
    assert s.feed("", final=True) == (" </thin", "")
