"""The detokenizers on the embedded model's tokenizer: exact text, stable pieces, bounded work. Ours
(IncrementalDetokenizer) and the one on tokenizers' DecodeStream (StreamDetokenizer, which the engine uses
where it is exact) face the same streams; the window's own rules are checked on ours."""

from __future__ import annotations

import random

import pytest

from hydragen.engine.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StreamDetokenizer,
    new_detokenizer,
    unstable_suffix_length,
)
from hydragen.engine.stop_strings import StopChecker
from hydragen.model.default_model import default_model_path
from hydragen.model.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! Ünïcödé – café, naïve, jalapeño.",
    "日本語のテキストと中文字符，还有한국어.",
    "Emoji: 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵 in a row 🤖🤖🤖",
    "  leading spaces,\ttabs\n\n  and   runs of   spaces  ",
    "def f(x):\n    return x ** 2  # squares\n",
    "I don't know , he said . What 's that ? It 's fine !",
]
SPECIAL_IDS = list(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
KINDS = {"incremental": IncrementalDetokenizer, "stream": StreamDetokenizer}


class CountingTokenizer:
    """Passes decode through, counting the calls and the token ids decoded."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0
        self.tokens = 0
        self.largest = 0

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.calls += 1
        self.tokens += len(ids)
        self.largest = max(self.largest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def pools(tok):
    """Token ids by kind: pieces of multibyte characters (decode alone to U+FFFD), text, specials."""
    text_ids = sorted({i for t in TEXTS for i in tok.encode(t, add_special_tokens=False)})
    partial = [i for i in range(17, 2000) if REPLACEMENT in tok.decode([i])]
    partial += [i for i in text_ids if REPLACEMENT in tok.decode([i])]
    assert len(partial) > 50
    return {"text": text_ids, "partial": partial, "special": SPECIAL_IDS, "space": tok.encode(" \t  \n ")}


def random_sequence(rng: random.Random, pools, vocab: int, length: int) -> list[int]:
    kinds = ["text", "partial", "special", "space", "any"]
    weights = [5, 4, 1, 1, 2]
    out = []
    while len(out) < length:
        kind = rng.choices(kinds, weights)[0]
        if kind == "any":
            out.append(rng.randrange(vocab))
        elif kind == "text" and rng.random() < 0.5:  # a real run of text, so characters span tokens
            ids = pools["text"]
            out.extend(ids[rng.randrange(len(ids)) :][: rng.randint(1, 6)])
        else:
            out.append(rng.choice(pools[kind]))
    return out[:length]


def run_stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, check=None) -> str:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        pieces.append(detok.add(ids[i : i + n]))
        i += n
        if check is not None:
            check(ids[:i], "".join(pieces))
    pieces.append(detok.flush())
    return "".join(pieces)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_random_sequences_decode_exactly(tok, pools, skip_special, kind):
    """Pieces + flush equal the full decode; emitted text is never taken back and lags only by the
    suffix that later tokens could still change (DecodeStream holds all the text since its last piece
    while the text ends in U+FFFD)."""
    rng = random.Random(11 if skip_special else 12)

    def check(prefix_ids, emitted):
        full = tok.decode(prefix_ids, skip_special_tokens=skip_special)
        if kind == "incremental":
            assert emitted == full[: len(full) - unstable_suffix_length(full)]
        else:
            assert full.startswith(emitted) and (emitted == full or full.endswith(REPLACEMENT))

    for _ in range(60):
        ids = random_sequence(rng, pools, tok.vocab_size, rng.randint(1, 60))
        detok = KINDS[kind](tok, skip_special_tokens=skip_special)
        text = run_stream(detok, ids, rng, check)
        assert text == tok.decode(ids, skip_special_tokens=skip_special)
        assert detok.text == text


@pytest.mark.parametrize("kind", KINDS)
def test_long_runs_of_partial_characters(tok, pools, kind):
    """Text that keeps ending in U+FFFD for hundreds of tokens, with characters completing now and then:
    the window must slide (checked) without ever cutting a character."""
    rng = random.Random(7)

    def check(prefix_ids, emitted):
        assert tok.decode(prefix_ids).startswith(emitted)

    for _ in range(4):
        ids = [rng.choice(pools["partial"]) for _ in range(400)]
        assert run_stream(KINDS[kind](tok), ids, rng, check) == tok.decode(ids)


class ByteTokenizer:
    """A made-up byte vocabulary whose tokens cut characters anywhere (unlike the embedded BPE), with
    the two decoders' conventions: lossy UTF-8 (one U+FFFD per bad run, as byte-level BPE) or one U+FFFD
    per bad byte (as SentencePiece byte fallback), and optionally the first token's space dropped."""

    def __init__(self, seed: int, per_byte: bool, strip_first_space: bool):
        rng = random.Random(seed)
        utf8 = "aé日🙂 ".encode()
        self.pieces = [bytes([b]) for b in range(256)] + [
            utf8[i : i + n] for i in range(len(utf8)) for n in (2, 3, 4) if i + n <= len(utf8)
        ]
        self.pieces += [bytes(rng.choice(utf8) for _ in range(rng.randint(2, 4))) for _ in range(40)]
        self.special = {len(self.pieces) + i for i in range(3)}
        self.per_byte, self.strip = per_byte, strip_first_space

    def sample(self, rng: random.Random, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            r = rng.random()
            ids.append(
                rng.choice(sorted(self.special))
                if r < 0.05
                else rng.randrange(256, len(self.pieces))
                if r < 0.6
                else rng.choice(b"\x80\xa5\xe6\x97\xf0\x9f\x99\x82\xc3\xa9a ")
            )
        return ids

    def decode(self, ids, skip_special_tokens=True):
        out = b""
        for i in ids:
            if i in self.special:
                out += b"" if skip_special_tokens else f"<s{i}>".encode()
            else:
                out += self.pieces[i]
        if self.strip and out.startswith(b" "):
            out = out[1:]
        if not self.per_byte:
            return out.decode("utf-8", "replace")
        text = out.decode("utf-8", "surrogateescape")
        return "".join(REPLACEMENT if "\udc80" <= c <= "\udcff" else c for c in text)


@pytest.mark.parametrize("per_byte", [False, True])
@pytest.mark.parametrize("strip_first_space", [False, True])
def test_tokens_that_cut_characters_anywhere(per_byte, strip_first_space):
    """Exactness and prompt emission where characters straddle every kind of boundary, including the
    checked slide of a window whose text keeps ending in U+FFFD."""
    tok = ByteTokenizer(1, per_byte, strip_first_space)
    rng = random.Random(2)
    for skip_special in (True, False):

        def check(prefix_ids, emitted, skip_special=skip_special):
            full = tok.decode(prefix_ids, skip_special_tokens=skip_special)
            assert emitted == full[: len(full) - unstable_suffix_length(full)]

        for _ in range(40):
            ids = tok.sample(rng, rng.randint(1, 120))
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
            assert run_stream(detok, ids, rng, check) == tok.decode(ids, skip_special_tokens=skip_special)


def test_slide_never_cuts_an_unfinished_character():
    """Skipped special tokens keep a character unfinished across two attempted slides: a window may
    not start between its bytes, or its last byte would decode as a stray U+FFFD."""
    tok = ByteTokenizer(1, per_byte=False, strip_first_space=False)
    specials = [min(tok.special)] * 10
    ids = [*b"ab", 0x80, 0x80, 0x80, 0x80, 0xE6, 0x97, *specials, 0xA5, *b"c"]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids) == "ab" + REPLACEMENT * 4 + "日c"


def test_skipped_special_token_does_not_become_the_window_start():
    """Decoders drop the first token's leading space; a window starting at a skipped special token would
    make the next word first and lose its space."""
    tok = ByteTokenizer(1, per_byte=False, strip_first_space=True)
    ids = [*b"a", min(tok.special), *b" b"]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == tok.decode(ids) == "a b"


@pytest.mark.parametrize("kind", KINDS)
def test_real_text_round_trips(tok, kind):
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert run_stream(KINDS[kind](tok), ids, rng) == tok.decode(ids) == text


def test_prompt_context_gives_the_generated_part_of_the_joint_decode(tok, pools):
    rng = random.Random(5)
    for text in TEXTS:
        prompt = tok.encode(text, add_special_tokens=False)
        for _ in range(5):
            gen = random_sequence(rng, pools, tok.vocab_size, rng.randint(1, 30))
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
            expected = tok.decode(prompt + gen)[len(tok.decode(prompt)) :]
            assert run_stream(detok, gen, rng) == expected


def test_unfinished_character_is_held_then_completed(tok):
    ids = tok.encode(" 日本", add_special_tokens=False)
    assert tok.decode(ids[:1]).endswith(REPLACEMENT)  # the first token is a partial character
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == " "  # the space is final, the half character is held
    assert "".join(detok.add([i]) for i in ids[1:]) + detok.flush() == "日本"
    stream = StreamDetokenizer(tok)
    assert stream.add(ids[:1]) == ""  # DecodeStream holds the space too
    assert "".join(stream.add([i]) for i in ids[1:]) + stream.flush() == " 日本"


@pytest.mark.parametrize("kind", KINDS)
def test_an_unfinished_character_at_the_end_is_flushed(tok, kind):
    """A sequence that ends inside a character: flush hands over what the full decode has there (DecodeStream
    alone would never hand it over)."""
    ids = tok.encode("ab 日本", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT))
    detok = KINDS[kind](tok)
    streamed = "".join(detok.add([i]) for i in ids[:cut])
    assert streamed + detok.flush() == tok.decode(ids[:cut]) and detok.text == tok.decode(ids[:cut])


def test_the_engine_streams_with_decode_stream_where_it_is_exact(tok, monkeypatch):
    """DecodeStream is exact for a byte-level BPE decoder whose text transformers does not clean up: the
    engine uses it there, and ours elsewhere (SentencePiece byte fallback, clean-up, no Rust backend)."""
    from tests.helpers.tool_helpers import INST_TEMPLATE, sentencepiece_bpe

    assert isinstance(new_detokenizer(tok), StreamDetokenizer)
    monkeypatch.setattr(type(tok), "clean_up_tokenization_spaces", True)
    assert isinstance(new_detokenizer(tok), IncrementalDetokenizer)
    hf = sentencepiece_bpe(INST_TEMPLATE)
    hf.clean_up_tokenization_spaces = False
    assert isinstance(new_detokenizer(hf), IncrementalDetokenizer)
    assert isinstance(new_detokenizer(ByteTokenizer(1, False, False)), IncrementalDetokenizer)


def test_decode_stream_breaks_on_byte_fallback_runs():
    """Why not DecodeStream for SentencePiece byte fallback: byte tokens "N", "O" then a stray continuation
    byte decode as one run, "���", so the "NO" already handed over is no longer the start of the text, and
    DecodeStream raises (the request would fail). Ours cannot take "NO" back either (no streaming
    detokenizer can: "N" alone is a finished character), but it streams on, its text differing only there."""
    from tests.helpers.tool_helpers import INST_TEMPLATE, sentencepiece_bpe

    hf = sentencepiece_bpe(INST_TEMPLATE)
    ids = [hf.convert_tokens_to_ids(t) for t in ["<0x4E>", "<0x4F>", "<0xAC>", ",", "<0x7D>", "<0x39>"]]
    assert hf.decode(ids) == REPLACEMENT * 3 + ",}9"
    with pytest.raises(Exception, match="Invalid prefix"):
        StreamDetokenizer(hf).add(ids)
    detok = IncrementalDetokenizer(hf)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "NO" + hf.decode(ids)[2:]


def test_work_per_token_does_not_grow_with_length(tok):
    """Tokens decoded per added token stay bounded (no whole-sequence re-decode), for real text one
    token at a time and for a long run of invalid bytes (text that never stops ending in U+FFFD)."""
    text = " ".join(TEXTS) * 12
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 1500
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.add([i])
    detok.flush()
    assert detok.text == text
    assert counting.largest <= 12
    assert counting.tokens <= 6 * len(ids)

    stray = tok.encode("é", add_special_tokens=False)
    continuation = [i for i in range(17, 2000) if tok.decode([i]) == REPLACEMENT][:3]
    run = (continuation * 400)[:1000] + stray
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    for i in run:
        detok.add([i])
    detok.flush()
    assert detok.text == tok.decode(run)
    # The checked slide costs three extra short decodes every few tokens: still a constant per token.
    assert counting.largest <= 24
    assert counting.tokens <= 20 * len(run)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_is_named(tok, kind):
    detok = KINDS[kind](tok)
    with pytest.raises(ValueError, match="integers"):
        detok.add(["a"])
    with pytest.raises(ValueError, match=">= 0"):
        detok.add([-1])
    detok.flush()
    with pytest.raises(ValueError, match="after flush"):
        detok.add([5])


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_split_across_tokens(tok, kind):
    text = "The answer is 42.\nDone here, then more text follows."
    ids = tok.encode(text, add_special_tokens=False)
    detok, stops = KINDS[kind](tok), StopChecker(["42.\nDo", "never"])
    emitted, hit = [], None
    for i in ids:
        safe, hit = stops.feed(detok.add([i]))
        emitted.append(safe)
        if hit:
            break
    assert hit == "42.\nDo"
    assert "".join(emitted) == "The answer is "


def test_sentencepiece_byte_fallback_groups():
    """A real SentencePiece byte-fallback decoder reads a run of byte tokens as one group: while the group
    ends in an unfinished character, characters it already completed read U+FFFD too. Characters spelled
    in bytes (up to three in a row), between ordinary tokens, still stream exactly."""
    from tests.helpers.tool_helpers import INST_TEMPLATE, sentencepiece_bpe

    hf = sentencepiece_bpe(INST_TEMPLATE)
    byte = {b: hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    words = hf.encode("the name arg", add_special_tokens=False)
    rng = random.Random(5)
    chars = "鄽\U000edcef\ue0bfé日🙂"
    for _ in range(200):
        ids = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.5:
                ids.append(rng.choice(words))
            else:
                ids += [byte[b] for c in rng.choices(chars, k=rng.randint(1, 3)) for b in c.encode()]
        detok = IncrementalDetokenizer(hf)
        streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert streamed == hf.decode(ids), ids
