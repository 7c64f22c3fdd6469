"""Jump-forward is byte-exact: a boundary re-tokenization is used only when it spells exactly the bytes of
the sampled token and the forced text. Checked with a tiny random Llama whose SentencePiece-style
tokenizer adds a dummy-prefix space (its merges make `",` encode as `▁"` `,`), built in the test."""

from __future__ import annotations

import random

import pytest

from hydragen import LLM, SamplingParams, StructuredOutputsParams
from hydragen.structured.jump import jump_forward
from hydragen.structured.matcher import GrammarState
from hydragen.structured.schemas import SCHEMAS
from tests.helpers.structured_helpers import assert_valid
from tests.helpers.tool_helpers import tiny_tool_model

SO = StructuredOutputsParams


@pytest.fixture(scope="module")
def sp_llm(tmp_path_factory):
    return LLM(tiny_tool_model("llama_sp", tmp_path_factory.mktemp("sp") / "model"), kv_cache_tokens=16384)


def _state(llm, schema) -> GrammarState:
    return GrammarState(llm.engine.structured.compiler.matcher_for(SO(json=schema)))


def test_the_tokenizer_adds_a_dummy_prefix(sp_llm):
    tok = sp_llm.engine.tokenizer
    ll = sp_llm.engine.structured.compiler.ll_tokenizer
    ids = tok.encode('",', add_special_tokens=False)
    assert bytes(ll.decode_bytes(ids)) == b' ",'  # the premise of the tests below


def test_a_dummy_prefix_never_enters_a_string(sp_llm):
    """A sampled `"` closes "Bob", then `,"age":` is forced. The tokenizer's own encoding of `","age":`
    starts with `▁"` (a space more), which the grammar would accept as part of the name: it is refused and
    the sampled token is kept, so the name stays "Bob"."""
    so = sp_llm.engine.structured
    ll = so.compiler.ll_tokenizer
    state = _state(sp_llm, SCHEMAS["flat_person"])
    quote = next(t for t in range(ll.vocab_size) if bytes(ll.decode_bytes([t])) == b'"')
    state.accept_all(ll.tokenize_str('{"name":"Bob'))
    state.accept(quote)
    tokens = jump_forward(state, ll, so._encode, quote)
    assert bytes(ll.decode_bytes(tokens)).startswith(b'","age":')
    assert tokens[0] == quote
    assert state.fits(ll.tokenize_str("7}"))  # the grammar followed the same bytes


@pytest.mark.parametrize("name", ["flat_person", "entity_movie", "array_of_objects", "unicode_keys"])
def test_every_jump_spells_exactly_the_forced_bytes(sp_llm, name):
    """Random walks through the grammar (any allowed token, then jump-forward): at every jump the tokens
    appended decode to exactly the sampled token's bytes followed by the forced bytes."""
    import llguidance.numpy as lln
    import numpy

    so = sp_llm.engine.structured
    ll = so.compiler.ll_tokenizer
    vocab = sp_llm.engine.cfg.vocab_size
    rng = random.Random(name)
    jumps = 0
    for _ in range(8):
        state = _state(sp_llm, SCHEMAS[name])
        bits = lln.allocate_token_bitmask(1, vocab)
        while not state.done:
            lln.fill_next_token_bitmask(state.matcher, bits, 0)
            bitset = numpy.unpackbits(bits[0].view(numpy.uint8), bitorder="little")
            allowed = numpy.flatnonzero(bitset[:vocab])
            token = int(rng.choice(list(allowed)))
            if token in sp_llm.engine.eos_ids:
                break
            state.accept(token)
            probe = state.matcher.deep_copy()
            forced = GrammarState(probe).forced_tokens()
            tokens = jump_forward(state, ll, so._encode, token)
            assert bytes(ll.decode_bytes(tokens)) == bytes(ll.decode_bytes([token, *forced]))
            jumps += len(forced) > 0
    assert jumps > 8


def test_every_schema_validates_with_a_dummy_prefix_tokenizer(sp_llm):
    names = list(SCHEMAS)
    params = [
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=300, structured_outputs=SO(json=SCHEMAS[k]))
        for k in names
    ]
    outs = sp_llm.generate([f"{k}:" for k in names], params, use_tqdm=False)
    assert sp_llm.engine.stats.forced_tokens > 0
    for out, k in zip(outs, names, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (k, c.text)
            assert_valid(c.text, SCHEMAS[k], k)
