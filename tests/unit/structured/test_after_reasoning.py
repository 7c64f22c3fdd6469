"""Output constraints of a reasoning model hold for what follows its reasoning: the <think> block is free
text, the grammar starts after </think> (tiny reasoning models whose replies the test writes: where the
script breaks the constraint, the reply leaves the script)."""

from __future__ import annotations

import pytest

from hydragen import LLM, SamplingParams, StructuredOutputsParams
from hydragen.reasoning.formats import CONTENT, OPENING, REASONING
from hydragen.structured.after_reasoning import AfterReasoning
from tests.helpers.reasoning_helpers import script_replies
from tests.helpers.structured_helpers import assert_valid

ASK = [{"role": "user", "content": "Is 7 prime? Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "checked": {"type": "integer", "minimum": 2, "maximum": 6},
    },
    "required": ["answer", "checked"],
}
# Reasoning that no JSON grammar would let through, then an answer that breaks the schema.
THOUGHT = 'Divisors? 7 % 2 = 1, {"not": json} <- ignore, 1 < 2 < 7.\nSo: prime.'
ANSWER = '{"answer": "maybe", "checked": 40}'


def _params(jump_forward: bool = True, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(temperature=0, max_tokens=120, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def models(reasoning_models):
    llms = {kind: LLM(path, kv_cache_tokens=8192) for kind, path in reasoning_models.items()}
    llms["qwen3-plain"] = LLM(reasoning_models["qwen3"], kv_cache_tokens=8192, jump_forward=False)
    llms["qwen3-none"] = LLM(reasoning_models["qwen3"], kv_cache_tokens=8192, reasoning_parser="none")
    return llms


@pytest.mark.parametrize("kind", ["qwen3", "r1", "qwen3-plain"])
def test_a_json_schema_holds_after_the_reasoning_and_not_in_it(models, kind):
    llm = models[kind]
    opens = "" if kind == "r1" else "<think>\n"  # R1's generation prompt opened the block already
    script_replies(llm.engine, f"{opens}{THOUGHT}\n</think>\n\n{ANSWER}")
    out = llm.chat(ASK, _params(n=2, seed=0), use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        assert c.reasoning_content == THOUGHT  # written exactly as scripted: nothing masked it
        assert c.text.startswith(f"{opens}{THOUGHT}\n</think>")
        assert c.content == c.text.split("</think>", 1)[1]  # the grammar allows no whitespace first
        assert_valid(c.content, SCHEMA, kind)
        assert c.content != ANSWER  # the script broke the schema, and the grammar held


def test_a_reply_that_does_not_open_its_reasoning_is_constrained_from_its_first_token(models):
    llm = models["qwen3"]
    script_replies(llm.engine, f"Sure! {ANSWER}")
    c = llm.chat(ASK, _params(), use_tqdm=False)[0].outputs[0]
    assert c.reasoning_content is None and c.text == c.content and c.text.startswith("{")
    assert_valid(c.content, SCHEMA, "no reasoning")


def test_with_thinking_switched_off_in_the_template_the_reply_cannot_open_a_block(models):
    llm = models["qwen3"]
    script_replies(llm.engine, f"<think>\n{THOUGHT}\n</think>{ANSWER}")
    out = llm.chat(ASK, _params(), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    c = out.outputs[0]
    assert c.reasoning_content is None and c.text.startswith("{") and "<think>" not in c.text
    assert_valid(c.content, SCHEMA, "thinking off")


def test_without_a_reasoning_parser_the_grammar_holds_from_the_first_token(models):
    llm = models["qwen3-none"]
    assert llm.engine.reasoning is None
    script_replies(llm.engine, f"<think>\n{THOUGHT}\n</think>{ANSWER}")
    c = llm.chat(ASK, _params(), use_tqdm=False)[0].outputs[0]
    assert c.reasoning_content is None and c.content is None  # no reasoning model: outputs as before
    assert THOUGHT not in c.text and c.text.startswith("{")
    assert_valid(c.text, SCHEMA, "no parser")


def test_an_unconstrained_reply_is_split_too_and_a_cut_reply_is_all_reasoning(models):
    llm = models["r1"]
    script_replies(llm.engine, f"{THOUGHT}\n</think>\n\nYes, 7 is prime.")
    c = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)[0].outputs[0]
    assert (c.reasoning_content, c.content) == (THOUGHT, "Yes, 7 is prime.")
    c = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and c.content == "" and THOUGHT.startswith(c.reasoning_content)
    assert llm.generate("1 + 1 =", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].content is None


def test_the_phases_of_a_grammar_after_reasoning(models):
    llm = models["qwen3"]
    so, r, tok = llm.engine.structured, llm.engine.reasoning, llm.tokenizer
    think = tok.encode("a {b} c", add_special_tokens=False)
    good = tok.encode('{"answer":"no","checked":3}', add_special_tokens=False)
    bad = tok.encode("no json", add_special_tokens=False)

    def state(phase):
        return AfterReasoning(
            so.compiler.matcher_for(StructuredOutputsParams(json=SCHEMA)), r.start_id, r.end_id, phase
        )

    s = state(OPENING)
    assert s.masked and s.also_allowed == (r.start_id,) and s.forced_tokens() == []
    assert s.fits([r.start_id, *think, *bad, r.end_id, *good]) and s.fits(good)
    assert not s.fits(think) and not s.fits([r.start_id, *think, r.end_id, *bad])
    s.accept_all([r.start_id, *think])
    assert s.phase == REASONING and not s.masked and not s.done and s.also_allowed == ()
    assert not s.accept(r.end_id) and s.phase == CONTENT and s.masked
    assert s.forced_tokens()  # the grammar's opening: jump-forward appends it after </think>
    s.accept_all(good)
    assert s.done
    s = state(REASONING)
    assert s.fits([*bad, r.end_id, *good]) and not s.fits([*bad, r.end_id, *bad])
    with pytest.raises(ValueError, match="reasoning"):
        s.rollback(1)


def test_a_raw_prompt_that_opens_the_reasoning_is_constrained_after_it_too(models):
    """LLM.generate (and /v1/completions) read where a reply starts from the prompt as chat does; the text
    is not split there."""
    llm = models["qwen3"]
    script_replies(llm.engine, f"{THOUGHT}\n</think>{ANSWER}")
    c = llm.generate("Is 7 prime?\n<think>\n", _params(), use_tqdm=False)[0].outputs[0]
    assert c.text.startswith(f"{THOUGHT}\n</think>") and c.reasoning_content is None
    assert_valid(c.text.split("</think>", 1)[1], SCHEMA, "raw prompt")
    script_replies(llm.engine, f"Well: {ANSWER}")  # a raw prompt that does not open it: constrained at once
    c = llm.generate("Is 7 prime?", _params(), use_tqdm=False)[0].outputs[0]
    assert_valid(c.text, SCHEMA, "raw prompt, no reasoning")
