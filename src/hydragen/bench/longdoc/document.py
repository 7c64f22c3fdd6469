"""The long document of ``bench longdoc`` and the prompts that ask about it, made from a seed (no downloads).

Filler prose from word lists that hold no colour, no dog and no fur, with N facts "The dog named X has fur
that is Y." spread evenly through it, so the planted facts are the only answers; names are distinct and
none is a prefix of another. A prompt is the instruction, the document, a few answered examples and one
question, in one of three formats (``FORMATS``; why "stem" is the default: many_questions.py).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

COLORS = ("black", "white", "brown", "gray", "red", "blue", "green", "yellow", "purple", "orange")
FORMATS = ("stem", "raw", "chat")
DEFAULT_FORMAT = "stem"


def _words(text: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(text.split(sep))


# Dog names: distinct, and none is a prefix of another, so each occurs in the document exactly once.
_NAMES = _words(
    "Biscuit Pepper Waffles Juniper Pickle Nugget Sprout Tofu Muffin Pretzel Dumpling Noodle Bramble Clover "
    "Fennel Thistle Sorrel Quince Parsnip Turnip Radish Walnut Hazel Acorn Cobble Pebble Boulder Gravel "
    "Marble Flint Sable Tundra Monsoon Zephyr Cyclone Drizzle Blizzard Thunder Comet Meteor Nebula Quasar "
    "Orbit Rocket Gadget Widget Sprocket Piston Bolt Rivet Gizmo Doodle Scribble Tinker Jigsaw Domino "
    "Yahtzee Bingo Kazoo Banjo Cello Oboe Tuba Piccolo Mandolin Ukulele Lute Harp"
)
_SYLLABLES = ("ka", "lo", "mi", "ren", "du", "sa", "bo", "ti", "nax", "pel", "vor", "zu", "quen", "fi")

# Filler vocabulary: no colors, no dogs, no fur, so the only color facts are the planted ones.
_ADJ = _words(
    "old quiet busy tired cheerful careful patient restless clever humble proud gentle stubborn curious "
    "weary young elderly nervous brave cautious"
)
_PEOPLE = _words(
    "baker miller farmer sailor teacher merchant weaver carpenter fisherman shepherd potter blacksmith "
    "gardener traveler scholar innkeeper mason tailor courier clerk"
)
_VERBS = _words(
    "walked wandered hurried strolled rode climbed drifted marched paced lingered waited rested worked "
    "sang whistled read studied argued laughed dreamed"
)
_PLACES = _words(
    "the mill;the harbor;the market square;the narrow bridge;the village well;the orchard;the chapel;"
    "the riverbank;the stone wall;the old library;the crossroads;the meadow;the quarry;the granary;"
    "the lighthouse;the town gate;the vineyard;the ferry landing;the schoolhouse;the bakery",
    ";",
)
_PREPS = _words("near;beside;past;behind;around;toward;across from;far from", ";")
_TIMES = _words(
    "at dawn;before noon;in the afternoon;at dusk;late at night;after the rain;during the festival;"
    "on market day;in early spring;before the harvest;after supper;on a windy morning",
    ";",
)
_THINGS = _words(
    "a basket of apples;an old letter;a heavy sack of grain;a wooden ladder;a bundle of firewood;"
    "a small lantern;a map of the valley;a jar of honey;a broken wheel;a loaf of bread;a coil of rope;"
    "a box of nails",
    ";",
)
_MOODS = _words(
    "The weather stayed mild for many days;Nobody in the village could remember a quieter season;"
    "The river rose a little after the storms;Travelers spoke of the long road to the coast;"
    "The bells rang twice every evening;Prices at the market had not changed in years;"
    "The council met to discuss the new road;Children played games until it grew too dark to see",
    ";",
)


@dataclass(frozen=True)
class Fact:
    name: str
    color: str

    @property
    def sentence(self) -> str:
        return f"The dog named {self.name} has fur that is {self.color}."

    @property
    def question(self) -> str:
        return f"What color is the fur of the dog named {self.name}?"


@dataclass
class Document:
    text: str
    facts: list[Fact]  # in the order they appear in the text

    @property
    def answer_key(self) -> dict[str, str]:
        return {f.name: f.color for f in self.facts}


def dog_names(n: int, seed: int = 0) -> list[str]:
    """n distinct names, no one a prefix of another; beyond the built-in list, made-up syllable names."""
    rng = random.Random(seed)
    names = list(_NAMES)
    rng.shuffle(names)
    taken = set(names)
    while len(names) < n:
        cand = "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()
        if not any(c.startswith(cand) or cand.startswith(c) for c in taken):
            names.append(cand)
            taken.add(cand)
    return names[:n]


def filler_sentence(rng: random.Random) -> str:
    a, p, v = rng.choice(_ADJ), rng.choice(_PEOPLE), rng.choice(_VERBS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"The {a} {p} {v} {rng.choice(_PREPS)} {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
    if kind == 1:
        when, what, where = rng.choice(_TIMES).capitalize(), rng.choice(_THINGS), rng.choice(_PLACES)
        return f"{when}, a {a} {p} carried {what} to {where}."
    if kind == 2:
        q = rng.choice(_PEOPLE)
        return f"The {p} and the {q} {v} together {rng.choice(_PREPS)} {rng.choice(_PLACES)}."
    return f"{rng.choice(_MOODS)}."


def make_document(
    num_facts: int,
    doc_tokens: int,
    count_tokens: Callable[[str], int] | None = None,
    seed: int = 0,
    sentences_per_paragraph: int = 6,
) -> Document:
    """Filler prose of about ``doc_tokens`` tokens with ``num_facts`` facts spread evenly through it.

    ``count_tokens`` measures a sentence (default: ~1.3 tokens per word); names are unique and colors are
    drawn uniformly from ``COLORS``.
    """
    if num_facts < 1:
        raise ValueError(f"num_facts must be >= 1, got {num_facts}")
    count = count_tokens or (lambda s: round(1.3 * len(s.split())))
    rng = random.Random(seed)
    facts = [Fact(name, rng.choice(COLORS)) for name in dog_names(num_facts, seed)]
    budget = doc_tokens - sum(count(" " + f.sentence) for f in facts)
    filler: list[str] = []
    while budget > 0 or len(filler) < num_facts:
        s = filler_sentence(rng)
        filler.append(s)
        budget -= count(" " + s)
    # Fact i goes before filler sentence floor((i + 0.5) * len / num_facts): evenly spread, all distinct.
    at = {int((i + 0.5) * len(filler) / num_facts): f for i, f in enumerate(facts)}
    sentences: list[str] = []
    for i, s in enumerate(filler):
        if i in at:
            sentences.append(at[i].sentence)
        sentences.append(s)
    paragraphs = [
        " ".join(sentences[i : i + sentences_per_paragraph])
        for i in range(0, len(sentences), sentences_per_paragraph)
    ]
    return Document("\n\n".join(paragraphs), [at[i] for i in sorted(at)])


INSTRUCTION = (
    "Read the story below. Some of its sentences say what color the fur of a dog is. "
    "Then answer each question about a dog's fur with its color."
)


def _answer(fact: Fact, fmt: str) -> str:
    return f"The dog named {fact.name} has fur that is {fact.color}." if fmt == "stem" else fact.color


def build_prompts(doc: Document, shots: list[Fact], questions: list[Fact], fmt: str) -> list:
    """One prompt per question: strings for "raw"/"stem", chat conversations for "chat"."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "chat":
        head = f"{INSTRUCTION} Answer with one word.\n\nStory:\n{doc.text}\n\n"
        turns: list[dict] = []
        for i, f in enumerate(shots):
            turns.append({"role": "user", "content": (head if i == 0 else "") + f"Question: {f.question}"})
            turns.append({"role": "assistant", "content": f.color})
        return [
            turns + [{"role": "user", "content": ("" if shots else head) + f"Question: {q.question}"}]
            for q in questions
        ]
    prefix = f"{INSTRUCTION}\n\nStory:\n{doc.text}\n\n"
    prefix += "".join(f"Question: {f.question}\nAnswer: {_answer(f, fmt)}\n\n" for f in shots)
    stem = lambda q: f" The dog named {q.name} has fur that is" if fmt == "stem" else ""  # noqa: E731
    return [f"{prefix}Question: {q.question}\nAnswer:{stem(q)}" for q in questions]


def first_word(text: str) -> str:
    """The answer's first word, lowercased, punctuation stripped ("" if none)."""
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words else ""
