"""bench longdoc: the document generator's answer key, and a quick run's well-formed output (not speed)."""

from __future__ import annotations

import json
import re

import pytest

from hydragen.bench.longdoc.document import COLORS, build_prompts, dog_names, first_word, make_document
from hydragen.bench.longdoc.many_questions import run as run_longdoc

FACT = re.compile(r"The dog named (\w+) has fur that is (\w+)\.")


@pytest.mark.parametrize("num_facts,doc_tokens", [(1, 50), (12, 600), (40, 1500), (90, 400)])
def test_document_facts_once_and_answer_key(num_facts, doc_tokens):
    doc = make_document(num_facts, doc_tokens, seed=3)
    names = [f.name for f in doc.facts]
    assert len(doc.facts) == num_facts and len(set(names)) == num_facts
    found = FACT.findall(doc.text)
    assert dict(found) == doc.answer_key and len(found) == num_facts  # the key is what the text says
    assert [n for n, _ in found] == names  # facts listed in document order
    for f in doc.facts:
        assert doc.text.count(f.sentence) == 1
        assert len(re.findall(rf"\b{f.name}\b", doc.text)) == 1  # the name identifies one fact
        assert f.color in COLORS
    # Filler never mentions a color or a dog outside the planted facts.
    filler = FACT.sub("", doc.text).lower()
    assert not any(re.search(rf"\b{c}\b", filler) for c in COLORS) and "dog" not in filler
    # The requested length, as measured by the given counter, and deterministic in the seed.
    words = make_document(num_facts, doc_tokens, lambda s: len(s.split()), seed=3)
    assert len(words.text.split()) >= doc_tokens
    if doc_tokens > 25 * num_facts:  # else the floor of one filler sentence per fact makes it longer
        assert len(words.text.split()) <= doc_tokens + 30
    assert make_document(num_facts, doc_tokens, seed=3) == doc
    assert make_document(num_facts, doc_tokens, seed=4).text != doc.text


def test_dog_names_unique_beyond_builtin_list():
    names = dog_names(200)
    assert len(set(names)) == 200
    assert not any(a != b and b.startswith(a) for a in names for b in names)


def test_prompts_share_the_document_and_examples():
    doc = make_document(6, 200, seed=0)
    shots, questions = doc.facts[:2], doc.facts[2:5]
    for fmt in ("stem", "raw"):
        prompts = build_prompts(doc, shots, questions, fmt)
        prefix = prompts[0][: prompts[0].index(f"Question: {questions[0].question}")]
        assert all(p.startswith(prefix) for p in prompts) and doc.text in prefix
        assert all(f"Question: {q.question}\nAnswer:" in p for p, q in zip(prompts, questions, strict=True))
    convs = build_prompts(doc, shots, questions, "chat")
    assert all(c[:4] == convs[0][:4] and c[-1]["role"] == "user" for c in convs)
    assert first_word(" Green.\n") == "green" and first_word("...") == ""


def test_longdoc_quick(tmp_path):
    rows = run_longdoc(None, out=tmp_path, quick=True)
    assert [(r["mode"], r["questions"]) for r in rows] == [("on", 1), ("on", 3), ("off", 1), ("off", 3)]
    data = json.loads((tmp_path / "longdoc.json").read_text())
    assert data["machine"] and len(data["rows"]) == 4
    for r in data["rows"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["time_s"] > 0 and r["doc_tokens"] > 100
        assert r["answers_match"] is True and len(r["answers"]) == r["questions"]
        assert r["prefill_tokens"] + r["shared_tokens"] == r["prompt_tokens"]
    by = {(r["mode"], r["questions"]): r for r in data["rows"]}
    assert by[("on", 3)]["answers"] == by[("off", 3)]["answers"]
    assert by[("on", 3)]["shared_tokens"] > by[("on", 3)]["doc_tokens"]  # 2 of 3 questions reuse it
    assert by[("off", 3)]["shared_tokens"] == 0  # sharing off prefills every prompt in full
    md = (tmp_path / "longdoc.md").read_text()
    for mode in ("on", "off"):
        assert md.count(f"\n| {mode} |") == 2
    assert "identical" in md and "10% is chance" in md
    png = (tmp_path / "longdoc_time_vs_questions.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_longdoc_needs_a_tokenizer(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        run_longdoc(tiny_models["llama"], out=tmp_path, quick=True)
