"""StopChecker: stop strings across chunk boundaries, earliest completion wins, minimal hold-back."""

from __future__ import annotations

import random

import pytest

from hydragen.engine.stop_strings import StopChecker


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Read character by character; the first stop to complete wins (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


def feed_chunks(checker: StopChecker, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for chunk in chunks:
        safe, hit = checker.feed(chunk)
        out.append(safe)
        if hit:
            return "".join(out), hit
    return "".join(out) + checker.flush(), None


def test_stop_split_across_chunks():
    checker = StopChecker(["o w"])
    assert checker.feed("Hel") == ("Hel", None)
    assert checker.feed("lo") == ("l", None)  # "o" may start "o w"
    assert checker.feed(" ") == ("", None)
    assert checker.feed("world") == ("", "o w")
    assert checker.hit == "o w"


def test_stop_at_the_very_start():
    assert StopChecker(["STOP"]).feed("STOP and more") == ("", "STOP")
    checker = StopChecker(["STOP"])
    assert checker.feed("ST") == ("", None)
    assert checker.feed("OP") == ("", "STOP")


def test_self_overlapping_stop():
    # "aab" inside "aaab": a naive matcher that restarts after the failed third "a" misses it.
    assert feed_chunks(StopChecker(["aab"]), ["a", "a", "a", "b", "c"]) == ("a", "aab")
    assert feed_chunks(StopChecker(["abab"]), ["ababab"]) == ("", "abab")


def test_earliest_completion_wins_among_several():
    # "bc" completes at the third character, before "abcd" does, though "abcd" starts earlier.
    assert feed_chunks(StopChecker(["abcd", "bc"]), ["abcd"]) == ("a", "bc")
    # Both complete at the same character: the longer one cuts more.
    assert feed_chunks(StopChecker(["b", "ab"]), ["xab"]) == ("x", "ab")
    assert feed_chunks(StopChecker(["zz", "\n\n", "END"]), ["one\n", "\ntwo END"]) == ("one", "\n\n")


def test_holds_back_only_what_can_start_a_stop():
    checker = StopChecker(["</answer>", "###"])
    assert checker.feed("x </ans") == ("x ", None)
    assert checker.feed("wer is #") == ("</answer is ", None)
    assert checker.flush() == "#"


def test_random_texts_and_chunkings_match_the_reference():
    rng = random.Random(0)
    alphabet = "ab \n"
    for _ in range(400):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(3)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        checker, seen, emitted = StopChecker(stops), "", ""
        for chunk in chunks:
            safe, hit = checker.feed(chunk)
            seen, emitted = seen + chunk, emitted + safe
            if hit:
                break
            # Held back: exactly the longest suffix of the text that is a proper prefix of a stop.
            held = max((k for s in stops for k in range(len(s)) if seen.endswith(s[:k])), default=0)
            assert emitted == seen[: len(seen) - held]
        assert feed_chunks(StopChecker(stops), chunks) == reference(text, stops), (stops, chunks)


def test_bad_stops_and_feeding_after_a_hit_raise():
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker([""])
    with pytest.raises(ValueError, match="list"):
        StopChecker("stop")
    checker = StopChecker(["x"])
    checker.feed("x")
    with pytest.raises(ValueError, match="after the stop string 'x'"):
        checker.feed("more")
