"""Memory pressure at the seam between planning and memory: each failure a review of engine v2 found,
as a test through the engine (``docs/design.md``, "engine core v3", has the list).

1. a planned prefill chunk's pages evicted before its forward (the forward then re-ran chunk by chunk);
2. a cache insert between planning and the forward moving what a plan addressed;
3. admission counting pages from an ideal layout (a request admitted, then preempting itself forever);
4. a failure inside the scheduler's hand-off for one request leaking its pages, failing others;
5. sampling settings cached by ``id()`` of sequences (a new request sampled with an old one's settings);
6. /metrics and the tokenizer shared between threads (``test_server*.py``, ``test_tokenizer.py``);
7. append_forced() past the context, a stop string inside forced text, mixed steps counted as decode.
"""

from __future__ import annotations

import random

import pytest

from hydragen import LLM, SamplingParams
from tests.helpers.server_helpers import tiny_chat_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def tiny_chat_dir(tiny_models, tmp_path_factory):
    """The tiny model with a byte-level tokenizer (one token per byte)."""
    return tiny_chat_model(tiny_models["llama"], tmp_path_factory.mktemp("pressure") / "tiny")


def run(engine, max_steps: int = 3000) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, "the engine did not finish: a request is stuck"
    return steps


def assert_clean(engine) -> None:
    engine.kv.check([])
    usage = engine.kv_usage()
    assert usage["used"] == usage["cached"], usage


def mixed_prompts(seed: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    stems = [[rng.randrange(20, 250) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    return [
        rng.choice(stems)[: rng.randrange(1, 90)]
        + [rng.randrange(20, 250) for _ in range(rng.randrange(1, 40))]
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed, default_rule", [(0, False), (1, False), (2, True)])
def test_1_one_forward_per_step_under_pressure(path, seed, default_rule, share_every_common_node):
    """A small pool, chunked prefill and a few dozen mixed prompts: every step runs exactly one forward
    (nothing it planned went missing), and every output equals an unpressured run's. The suite shares
    every page held by two sequences; one case runs the cost rule's production default instead."""
    prompts = mixed_prompts(seed)
    params = SamplingParams(n=2, max_tokens=12, **GREEDY)
    rule = dict(min_shared_reads=share_every_common_node) if default_rule else {}
    llm = LLM(path, kv_cache_tokens=16 * 12, page_size=16, max_num_seqs=16, **rule)
    eng = llm.engine
    eng.scheduler.prefill_chunk = eng.scheduler.prefill_budget = 32
    forwards = []
    inner = eng.runner.forward
    eng.runner.forward = lambda batch: forwards.append(1) or inner(batch)
    reqs = [eng.add_request(p, params) for p in prompts]
    steps_with_work = 0
    while eng.has_unfinished():
        eng.step()
        steps_with_work += bool(eng.last_plan.work)
        assert steps_with_work < 5000
    assert len(forwards) == steps_with_work
    assert eng.stats.preemptions > 0  # the pool was really under pressure
    ref = LLM(path, kv_cache_tokens=65536)
    want = ref.generate(prompts, params, use_tqdm=False)
    assert [[s.generated for s in r.seqs] for r in reqs] == [[c.token_ids for c in o.outputs] for o in want]
    assert_clean(eng)


@pytest.mark.parametrize("seed", [0, 1])
def test_2_forced_appends_aborts_and_preemption_change_no_token(path, seed, share_every_common_node):
    """Forcing onto sequences the very tokens they would have produced changes nothing, whatever is
    preempted, aborted or cached around them in the same steps: outputs equal plain greedy decoding."""
    rng = random.Random(seed)
    prompts = mixed_prompts(seed + 10, 16)
    params = SamplingParams(n=3, max_tokens=20, **GREEDY)
    want = LLM(path, kv_cache_tokens=65536).generate(prompts, params, use_tqdm=False)
    rule = dict(min_shared_reads=share_every_common_node) if seed else {}  # seed 1: the production default
    llm = LLM(path, kv_cache_tokens=16 * 10, page_size=16, max_num_seqs=12, **rule)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    victims = set(rng.sample(range(len(prompts)), 3))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 5000
        for k, r in enumerate(reqs):
            if r.request_id not in eng.requests:
                continue
            if k in victims and any(s.generated for s in r.seqs) and rng.random() < 0.2:
                eng.abort(r.request_id)
                continue
            for s in r.seqs:
                gen, full = len(s.generated), want[k].outputs[s.index].token_ids
                if not s.finished and gen and s.pending == 1 and gen + 4 < len(full) and rng.random() < 0.3:
                    eng.append_forced(r.request_id, s.index, full[gen : gen + rng.randrange(2, 5)])
    for k, r in enumerate(reqs):
        if k in victims and r.seqs[0].finish_reason == "abort":
            continue
        assert r.error is None
        assert [s.generated for s in r.seqs] == [c.token_ids for c in want[k].outputs], k
    assert_clean(eng)


def test_3_admission_counts_pages_as_laid_out(path):
    """The review's repro: page size 16, a 3-page pool; A caches 21 tokens; B shares A's first 17 tokens,
    has a 33-token prompt and 15 tokens to generate. B must finish, with the tokens of a big pool."""
    a = [(i * 7) % 200 + 20 for i in range(21)]
    b = a[:17] + [(i * 11) % 200 + 21 for i in range(16)]
    llm = LLM(path, kv_cache_tokens=48, page_size=16)
    eng = llm.engine
    eng.add_request(a, SamplingParams(max_tokens=1, **GREEDY))
    run(eng)
    req = eng.add_request(b, SamplingParams(max_tokens=15, **GREEDY))
    run(eng, max_steps=200)
    want = LLM(path, kv_cache_tokens=4096).generate(
        [b], SamplingParams(max_tokens=15, **GREEDY), use_tqdm=False
    )
    assert req.seqs[0].generated == want[0].outputs[0].token_ids
    assert_clean(eng)


def test_4_a_failure_inside_admission_ends_its_request_alone(path):
    """An exception (not a shortage of pages) while a request is being admitted: it fails alone with
    the reason, its pages come back, and the request admitted with it finishes."""
    llm = LLM(path, kv_cache_tokens=4096)
    eng = llm.engine
    inner = eng.kv._hold  # inside admission, after its fit was checked

    def hold(table, nodes):
        if any(s.kv is table for s in eng.requests["bad"].seqs):
            raise RuntimeError("injected admission failure")
        inner(table, nodes)

    eng.kv._hold = hold
    good = eng.add_request(list(range(40, 90)), SamplingParams(n=2, max_tokens=6, **GREEDY))
    bad = eng.add_request(
        list(range(40, 80)) + [7, 7], SamplingParams(n=2, max_tokens=6, **GREEDY), request_id="bad"
    )
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        assert all(w.seq.request is not bad for w in eng.last_plan.work)  # never planned once failed
    assert bad.error and "injected admission failure" in bad.error
    assert good.error is None and all(len(s.generated) == 6 for s in good.seqs)
    assert {o.request_id for o in outs} == {good.request_id, "bad"}
    assert_clean(eng)


def test_4_a_failure_while_forking_ends_its_request_alone(path):
    """A sibling sample that cannot take its leader's KV (the copy fails) ends its request alone."""
    llm = LLM(path, kv_cache_tokens=4096)
    eng = llm.engine
    inner = eng.kv.fork

    def fork(dst, src, upto, shared, reserved):
        if any(s.kv is src and s.request.request_id == "bad" for s in eng.scheduler.running):
            raise RuntimeError("injected fork failure")
        inner(dst, src, upto, shared, reserved)

    eng.kv.fork = fork
    good = eng.add_request(list(range(40, 67)), SamplingParams(n=3, max_tokens=6, **GREEDY))
    bad = eng.add_request(
        list(range(40, 67)) + [9], SamplingParams(n=3, max_tokens=6, **GREEDY), request_id="bad"
    )
    run(eng)
    assert bad.error and "injected fork failure" in bad.error
    assert good.error is None and all(len(s.generated) == 6 for s in good.seqs)
    assert_clean(eng)


def test_5_sequential_requests_keep_their_own_sampling_settings(path):
    """Requests one after another on one LLM, alternating greedy and seeded sampling with different
    top_p/top_k: each gets exactly what it gets on a fresh LLM (never a finished request's settings)."""
    llm = LLM(path, kv_cache_tokens=4096)
    kinds = [
        SamplingParams(max_tokens=8, **GREEDY),
        SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=4, ignore_eos=True),
    ]
    prompt = [5, 6, 7, 8, 9]
    fresh = [LLM(path, kv_cache_tokens=4096).generate([prompt], p, use_tqdm=False)[0] for p in kinds]
    for i in range(30):
        got = llm.generate([prompt], kinds[i % 3], use_tqdm=False)[0]
        assert got.outputs[0].token_ids == fresh[i % 3].outputs[0].token_ids, i


def test_7a_append_forced_past_the_context_is_refused(path):
    llm = LLM(path, kv_cache_tokens=4096)
    eng = llm.engine
    context = llm.config.max_position_embeddings
    req = eng.add_request([3] * (context - 10), SamplingParams(max_tokens=20, **GREEDY))
    eng.step()  # 503 tokens now
    with pytest.raises(ValueError, match="context"):
        eng.append_forced(req.request_id, 0, [4] * 9)  # 512: no room left to sample after it
    eng.append_forced(req.request_id, 0, [4] * 8)  # 511: one token left to sample
    run(eng)
    assert req.error is None and len(req.seqs[0].generated) == 10
    assert req.seqs[0].finish_reason == "length"


def test_7b_a_stop_string_inside_forced_text_ends_it_everywhere(tiny_chat_dir):
    """Forced tokens that complete a stop string end the sequence at that token: text, token_ids, usage
    and finish reason agree (the tokens after it are dropped)."""
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096)
    eng = llm.engine
    tok = llm.tokenizer
    req = eng.add_request(tok.encode("say"), SamplingParams(max_tokens=40, stop=["END"], **GREEDY))
    eng.step()
    forced = tok.encode("abcENDxyz", add_special_tokens=False)
    before = len(req.seqs[0].generated)
    eng.append_forced(req.request_id, 0, forced)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (out,) = [o for o in outs if o.request_id == req.request_id]
    c = out.outputs[0]
    kept = len(tok.encode("abcEND", add_special_tokens=False))
    assert c.finish_reason == "stop" and c.stop_reason == "END"
    assert c.token_ids[before:] == forced[:kept]  # nothing after the stop's last token
    assert c.text.endswith("abc") and "xyz" not in c.text


def test_7c_steps_are_counted_by_kind(path):
    """Prefill-only, decode-only and mixed steps keep their own time and tokens, so a decode rate is
    decode tokens over decode time (bench tree's figures)."""
    llm = LLM(path, kv_cache_tokens=8192)
    eng = llm.engine
    eng.scheduler.prefill_chunk = eng.scheduler.prefill_budget = 16
    eng.add_request(list(range(20, 80)), SamplingParams(max_tokens=12, **GREEDY))
    for _ in range(6):  # 60 prompt tokens in chunks of 16, then decoding alone
        eng.step()
    eng.add_request(list(range(90, 150)), SamplingParams(max_tokens=4, **GREEDY))  # prefills beside it
    run(eng)
    st = eng.stats
    assert st.prefill_steps >= 3 and st.mixed_steps >= 1 and st.decode_steps >= 1
    assert st.steps == st.prefill_steps + st.mixed_steps + st.decode_steps
    assert st.decode_step_tokens <= 2 * st.decode_steps  # at most both sequences in a pure decode step
    assert st.generated_tokens == 16 > st.decode_step_tokens  # some were sampled in mixed steps
    assert min(st.decode_seconds, st.mixed_seconds, st.prefill_seconds) > 0
