"""Structured outputs offline: the constraint API, compile errors, every schema of the shared set
validated (jump-forward on and off, temperature 0 and 1, n = 1 and 8), regex / choice / grammar,
jump-forward's boundary re-tokenization, logprobs / max_tokens / stop strings with forced text, and
the forced text of n samples prefilled once."""

from __future__ import annotations

import json
import re

import pytest

from hydragen import LLM, SamplingParams, StructuredOutputsParams
from hydragen.errors import ParamError
from hydragen.structured.schemas import SCHEMAS
from tests.helpers.server_helpers import tiny_chat_model
from tests.helpers.structured_helpers import assert_valid, tiny_bpe_model

SO = StructuredOutputsParams


@pytest.fixture(scope="module")
def bpe_llm(tmp_path_factory):
    path = tiny_bpe_model(tmp_path_factory.mktemp("bpe") / "model")
    return LLM(path, kv_cache_tokens=65536)


@pytest.fixture(scope="module")
def byte_path(tiny_models, tmp_path_factory):
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("bytes") / "model")


@pytest.fixture(scope="module")
def byte_llm(byte_path):
    return LLM(byte_path, kv_cache_tokens=16384)


def _jump(llm, on: bool):
    llm.engine.structured.jump_forward = on


# ---- the API ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({}, "exactly one"),
        ({"json": {}, "regex": "a"}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "JSON object"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"json_object": "yes"}, "must be True"),
    ],
)
def test_params_name_the_problem(kwargs, problem):
    with pytest.raises(ParamError, match=problem) as e:
        SO(**kwargs)
    assert e.value.param == "structured_outputs"


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ParamError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert SamplingParams(structured_outputs=SO(regex="a+")).structured_outputs.regex == "a+"


@pytest.mark.parametrize(
    "constraint, problem",
    [
        (SO(regex="[a"), "regex"),
        (SO(json={"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}), "json"),
        (SO(json={"type": "nonsense"}), "json"),
        (SO(grammar="start: foo\nfoo: bar"), "grammar"),
        (SO(grammar="root ::= ("), "grammar"),
    ],
)
def test_bad_constraint_is_a_param_error_and_leaves_nothing_behind(byte_llm, constraint, problem):
    with pytest.raises(ParamError, match=f"cannot compile the {problem}|cannot compile") as e:
        byte_llm.generate("x", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not byte_llm.engine.has_unfinished()


def test_compiled_grammars_are_cached(byte_llm):
    compiler = byte_llm.engine.structured.compiler
    first = compiler.compile(SO(json=SCHEMAS["flat_person"]))
    assert compiler.compile(SO(json=dict(SCHEMAS["flat_person"]))) is first


# ---- every schema validates ---------------------------------------------------------------------------
@pytest.mark.parametrize("jump", [True, False], ids=["jump", "no_jump"])
def test_every_schema_validates(bpe_llm, jump):
    """One batched generate per jump setting: every schema at temperature 0 and 1, n = 1 and 8."""
    _jump(bpe_llm, jump)
    names = list(SCHEMAS)
    configs = [(n, t) for n in (1, 8) for t in (0.0, 1.0)]
    prompts, params = [], []
    for n, t in configs:
        for name in names:
            prompts.append(f"Fill in the {name.replace('_', ' ')} record as JSON:")
            params.append(
                SamplingParams(
                    n=n, temperature=t, seed=7, max_tokens=200, structured_outputs=SO(json=SCHEMAS[name])
                )
            )
    forced0 = bpe_llm.engine.stats.forced_tokens
    outs = bpe_llm.generate(prompts, params, use_tqdm=False)
    for out, p, name in zip(outs, params, names * len(configs), strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            assert_valid(c.text, p.structured_outputs.json, f"{name} n={p.n} T={p.temperature}")
    forced = bpe_llm.engine.stats.forced_tokens - forced0
    assert (forced > 0) == jump
    _jump(bpe_llm, True)


@pytest.mark.parametrize("chat", [False, True], ids=["generate", "chat"])
def test_regex_choice_and_grammar_outputs_match(bpe_llm, chat):
    cases = [
        (SO(regex=r"[a-z]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        (SO(choice=["yes", "no", 'say "hi"']), lambda t: t in ("yes", "no", 'say "hi"')),
        (
            SO(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
            lambda t: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", t),
        ),
        (SO(grammar='root ::= "ab" [0-9] [0-9]?'), lambda t: re.fullmatch(r"ab[0-9][0-9]?", t)),
    ]
    params = [
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60, structured_outputs=c) for c, _ in cases
    ]
    if chat:
        outs = bpe_llm.chat([[{"role": "user", "content": "answer"}]] * len(cases), params, use_tqdm=False)
    else:
        outs = bpe_llm.generate(["answer:"] * len(cases), params, use_tqdm=False)
    for out, (constraint, ok) in zip(outs, cases, strict=True):
        for c in out.outputs:
            assert ok(c.text), (constraint, c.text, c.finish_reason)


# ---- jump-forward ---------------------------------------------------------------------------------------
def test_boundary_is_retokenized_canonically(bpe_llm):
    """A sampled `"` closing a string, then forced `,"age":`: the sampled token is re-split with the
    forced text as the tokenizer would split it (`","` is one token), not left as `"` + `,"`."""
    from hydragen.structured.jump import jump_forward
    from hydragen.structured.matcher import GrammarState

    engine = bpe_llm.engine
    tok = engine.tokenizer
    so = engine.structured
    state = GrammarState(so.compiler.matcher_for(SO(json=SCHEMAS["flat_person"])))
    state.accept_all(tok.encode('{"name":"Bob', add_special_tokens=False))
    quote = tok.encode('"', add_special_tokens=False)
    assert len(quote) == 1
    state.accept(quote[0])
    tokens = jump_forward(state, so.compiler.ll_tokenizer, so._encode, quote[0])
    text = tok.decode(tokens)
    assert text.startswith('","age":')
    assert tokens == tok.encode(text, add_special_tokens=False)
    assert tokens[0] != quote[0]
    # the grammar state follows the re-split tokens: a number may come next, a letter may not
    assert state.fits(tok.encode("7", add_special_tokens=False))
    assert not state.fits(tok.encode("x", add_special_tokens=False))


def test_jump_equals_token_by_token_with_a_byte_tokenizer(byte_llm):
    """With one token per byte, jump-forward only changes how many forwards run: the tokens are the
    same as constrained decoding token by token, seeded sampling included."""
    names = ["entity_movie", "anyof_objects", "defs_ref"]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=300, structured_outputs=SO(json=SCHEMAS[k]))
        for k in names
    ]
    runs = {}
    for jump in (True, False):
        _jump(byte_llm, jump)
        steps0 = byte_llm.engine.stats.decode_steps
        outs = byte_llm.generate(["{" + k for k in names], params, use_tqdm=False)
        runs[jump] = (
            [[c.token_ids for c in o.outputs] for o in outs],
            byte_llm.engine.stats.decode_steps - steps0,
        )
        for o, k in zip(outs, names, strict=True):
            for c in o.outputs:
                assert_valid(c.text, SCHEMAS[k], k)
    _jump(byte_llm, True)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1] / 2  # most bytes of these schemas are forced


def test_forced_text_of_n_samples_is_prefilled_once(byte_path):
    """Greedy n = 8: the samples are forced through the same text; it is computed once, as a shared
    tree node, not once per sample. Counted in tokens run through the model."""
    schema = SO(json=SCHEMAS["entity_company"])
    work = {}
    for share in (True, False):
        llm = LLM(byte_path, kv_cache_tokens=16384, prefix_sharing=share)
        res = {}
        for n in (1, 8):
            llm.reset_prefix_cache()
            st = llm.engine.stats
            f0, forced0 = st.forward_tokens, st.forced_tokens
            out = llm.generate(
                "company:",
                SamplingParams(n=n, temperature=0, max_tokens=300, structured_outputs=schema),
                use_tqdm=False,
            )[0]
            assert len({c.text for c in out.outputs}) == 1
            res[n] = (st.forward_tokens - f0, (st.forced_tokens - forced0) // n, out.outputs[0].token_ids)
            usage = llm.engine.kv_usage()
            assert usage["used"] == usage["cached"]  # nothing leaked by moving forced text into the tree
        work[share] = res
    forced = work[True][1][1]
    sampled = len(work[True][1][2]) - forced
    assert forced > 50
    assert work[True][8][2] == work[False][8][2] == work[True][1][2]
    # sharing on: the 7 extra samples cost their sampled tokens (+ the prompt's last token), not forced text
    assert work[True][8][0] - work[True][1][0] <= 7 * (sampled + 2)
    # sharing off: every sample computes the forced text itself
    assert work[False][8][0] - work[False][1][0] >= 7 * forced


def test_logprobs_mark_forced_tokens(bpe_llm):
    out = bpe_llm.generate(
        "x",
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=200,
            logprobs=2,
            structured_outputs=SO(json=SCHEMAS["entity_movie"]),
        ),
        use_tqdm=False,
    )[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        forced = [lp for lp, t in zip(c.logprobs, c.token_ids, strict=True) if lp == {t: None}]
        sampled = [lp for lp, t in zip(c.logprobs, c.token_ids, strict=True) if lp[t] is not None]
        assert forced and sampled and len(forced) + len(sampled) == len(c.token_ids)
        assert all(len(lp) <= 3 for lp in sampled)


def test_forced_tokens_count_toward_max_tokens(bpe_llm):
    for limit in (1, 2, 5, 9):
        out = bpe_llm.generate(
            "x",
            SamplingParams(n=2, max_tokens=limit, structured_outputs=SO(json=SCHEMAS["entity_movie"])),
            use_tqdm=False,
        )[0]
        for c in out.outputs:
            assert len(c.token_ids) <= limit and c.finish_reason == "length"
    assert not bpe_llm.engine.has_unfinished()


def test_stop_string_inside_forced_text(bpe_llm):
    out = bpe_llm.generate(
        "x",
        SamplingParams(
            n=2, max_tokens=100, stop=['"year"'], structured_outputs=SO(json=SCHEMAS["entity_movie"])
        ),
        use_tqdm=False,
    )[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.stop_reason == '"year"'
        assert c.text.startswith('{"title":"') and '"year"' not in c.text


def test_append_forced_checks_the_grammar(bpe_llm):
    engine = bpe_llm.engine
    tok = engine.tokenizer
    req = engine.add_request(
        tok.encode("x"), SamplingParams(max_tokens=50, structured_outputs=SO(regex="[0-9]+"))
    )
    try:
        with pytest.raises(ValueError, match="constraint"):
            engine.append_forced(req.request_id, 0, tok.encode("abc", add_special_tokens=False))
        engine.append_forced(req.request_id, 0, tok.encode("12", add_special_tokens=False))
        while engine.has_unfinished():
            engine.step()
        assert re.fullmatch("12[0-9]*", req.seqs[0].text)
    finally:
        engine.abort(req.request_id)


def test_bench_structured_reports_every_mode(bpe_llm, tmp_path):
    """The benchmark's measuring loop at toy size: every mode runs, jump-forward forces tokens, the
    nothing-forced grammar forces none and runs to its fixed length, the plots are drawn."""
    from hydragen.bench.structured import jump_forward as bench

    result = bench.run(bpe_llm, [2], requests=2, serial=1, max_tokens=24, free_tokens=4, seed=0)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == set(bench.MODES + bench.FREE_MODES)
    assert rows["jump"]["forced_fraction"] > 0 == rows["no_jump"]["forced_fraction"]
    assert all(0 <= rows[m]["cut"] <= 1 for m in bench.MODES) and "cut" in bench.COLUMNS
    assert rows["jump"]["decode_steps"] < rows["no_jump"]["decode_steps"]
    assert rows["free"]["output_tokens"] == rows["free_masked"]["output_tokens"] == 2 * 4
    assert rows["free_masked"]["forced_fraction"] == 0 and rows["free_masked"]["mask_us_per_token_mean"] > 0
    assert set(result["compile_ms"]) >= set(bench.SCHEMAS)
    paths = bench.plots({"rows": result["rows"], "quick": True}, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    assert bpe_llm.engine.structured.jump_forward


def test_generate_cli_constraints(bpe_llm, capsys):
    """`hydragen generate --regex / --json-schema`: the output matches; a bad constraint exits 2."""
    from hydragen.cli import main

    path = str(bpe_llm.model_path)
    base = ["generate", "x", "--model", path, "--raw", "-q", "--max-tokens", "40", "--temperature", "0"]
    assert main([*base, "--regex", "[0-9]{3}-[a-z]{2}"]) == 0
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", capsys.readouterr().out.strip())
    assert main([*base, "--json-schema", json.dumps(SCHEMAS["flat_person"]), "--no-jump-forward"]) == 0
    assert_valid(capsys.readouterr().out.strip(), SCHEMAS["flat_person"], "generate --json-schema")
    assert main([*base, "--regex", "[a"]) == 2
    assert "cannot compile" in capsys.readouterr().err
    assert main([*base, "--regex", "a", "--choice", "b"]) == 2  # refused before loading anything
    assert "at most one" in capsys.readouterr().err


def test_logprob_alternatives_are_only_allowed_tokens(bpe_llm):
    """Top alternatives come from the masked distribution: a token the constraint excludes is never
    listed (its logprob would be -inf), even when fewer tokens are allowed than alternatives asked."""
    out = bpe_llm.generate(
        "x",
        SamplingParams(max_tokens=10, logprobs=5, structured_outputs=SO(choice=["yes", "no"]), seed=1),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text in ("yes", "no")
    for lp in out.logprobs:
        assert all(v is None or v > float("-inf") for v in lp.values())
    tok = bpe_llm.engine.tokenizer
    first = [tok.decode([t]) for t in out.logprobs[0]]  # only spellings of the start of `yes` or `no`
    assert first and all("yes".startswith(p) or "no".startswith(p) for p in first), first


def test_structured_outputs_under_tensor_parallelism_match_one_process(bpe_llm, tmp_path):
    """Masks and jump-forward run on rank 0 and forced tokens travel in the broadcast batch: TP = 2 gives
    the same valid JSON, token for token, as one process (greedy, n = 2, jump-forward on)."""
    from hydragen.structured.schemas import SCHEMAS

    schemas = list(SCHEMAS.values())[:4]
    params = [
        SamplingParams(n=2, temperature=0, max_tokens=96, structured_outputs=SO(json=s)) for s in schemas
    ]
    prompts = [f"Describe item {i} as JSON." for i in range(len(schemas))]
    _jump(bpe_llm, True)
    want = bpe_llm.generate(prompts, params, use_tqdm=False)
    path = tiny_bpe_model(tmp_path / "model")
    with LLM(path, kv_cache_tokens=16384, tensor_parallel_size=2) as tp:
        got = tp.generate(prompts, params, use_tqdm=False)
        assert tp.engine.stats.forced_tokens > 0  # jump-forward really extended under TP
    for w, g, schema in zip(want, got, schemas, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for c in g.outputs:
            assert_valid(c.text, schema, "TP=2")
