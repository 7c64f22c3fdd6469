"""The step engine as a server drives it: persistent prefix cache, chunked prefill, eviction, preemption,
aging, the cost rule. Tiny random models keep it exact and fast; outputs are compared with a fresh engine
run alone. The prefix cache holds whole pages (16 tokens here), so a hit covers the whole pages two
contexts share and the rest of the prompt is computed."""

from __future__ import annotations

import pytest

from hydragen import LLM, SamplingParams
from hydragen.engine.sequence import Status

GREEDY = dict(temperature=0, ignore_eos=True)
SYSTEM = [20 + (7 * i) % 200 for i in range(300)]  # a long shared "system prompt" (vocab is 256)
PAGE = 16


def whole_pages(tokens: int) -> int:
    """Tokens in the whole pages of ``tokens``: what the prefix cache can hold of them."""
    return tokens // PAGE * PAGE


def wait_for_decode(engine, seqs: int) -> None:
    """Step until a step decodes ``seqs`` sequences and nothing else."""
    for _ in range(500):
        engine.step()
        work = engine.last_plan.work
        if len(work) == seqs and all(len(w.tokens) == 1 for w in work):
            return
    raise AssertionError("no pure decode step")


def run_all(engine, max_steps: int = 10_000) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return steps


def alone(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    llm = LLM(path, kv_cache_tokens=4096)
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


def test_second_request_skips_cached_system_prompt_and_batches_with_the_first(path):
    llm = LLM(path, kv_cache_tokens=8192)
    eng = llm.engine
    first = eng.add_request(SYSTEM + [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
    eng.step()
    eng.step()
    before = eng.stats.prefill_tokens
    second = eng.add_request(SYSTEM + [8, 9], SamplingParams(max_tokens=8, **GREEDY))
    eng.step()
    # Only what is past the shared whole pages was computed (the last prompt token always is).
    cached = whole_pages(len(SYSTEM))
    assert eng.stats.prefill_tokens - before == len(SYSTEM) + 2 - cached
    assert second.cached_tokens == cached
    # Both running sequences read the shared system prompt's pages through one shared run.
    assert len(eng.batch.seqs) == 2
    assert (0, cached // PAGE, 0, 2) in eng.batch.shared
    run_all(eng)
    assert first.seqs[0].generated == alone(path, SYSTEM + [5, 6, 7], 20)
    assert second.seqs[0].generated == alone(path, SYSTEM + [8, 9], 8)


def test_generated_tokens_are_cached_for_the_next_turn(path):
    llm = LLM(path, kv_cache_tokens=8192)
    out = llm.generate([SYSTEM[:50]], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    follow_up = SYSTEM[:50] + out.outputs[0].token_ids + [3, 4]
    before = llm.engine.stats.prefill_tokens
    out2 = llm.generate([follow_up], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)[0]
    # The whole pages of the first turn's computed context (its prompt and 11 of its 12 tokens: the last
    # one was never fed back) came from the cache; the rest of the new prompt was computed.
    cached = whole_pages(50 + 11)
    assert out2.cached_prompt_tokens == cached
    assert llm.engine.stats.prefill_tokens - before == len(follow_up) - cached
    assert out2.outputs[0].token_ids == alone(path, follow_up, 5)


def test_hit_rate_accounting(path):
    llm = LLM(path, kv_cache_tokens=8192)
    llm.generate([SYSTEM + [1]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    llm.generate([SYSTEM + [2]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    st = llm.engine.stats
    assert st.prompt_tokens == 2 * (len(SYSTEM) + 1)
    assert st.cache_hit_tokens == whole_pages(len(SYSTEM))
    assert st.hit_rate == pytest.approx(whole_pages(len(SYSTEM)) / (2 * (len(SYSTEM) + 1)))


def test_chunked_prefill_does_not_stall_running_sequences(path):
    llm = LLM(path, kv_cache_tokens=8192)
    eng = llm.engine
    eng.scheduler.prefill_budget = eng.scheduler.prefill_chunk = 64
    running = eng.add_request([7, 8, 9], SamplingParams(max_tokens=40, **GREEDY))
    eng.step()
    long_prompt = [30 + (11 * i) % 220 for i in range(400)]
    late = eng.add_request(long_prompt, SamplingParams(max_tokens=4, **GREEDY))
    for _ in range(5):  # the long prompt needs 7 chunks; the running sequence gets a token every step
        n = len(running.seqs[0].generated)
        eng.step()
        assert len(running.seqs[0].generated) == n + 1
        assert not late.seqs[0].generated
    run_all(eng)
    assert late.seqs[0].generated == alone(path, long_prompt, 4)
    assert running.seqs[0].generated == alone(path, [7, 8, 9], 40)


def test_eviction_under_a_small_pool_keeps_every_request_correct(path):
    prompts = [[i] * 40 + [i + 1, i + 2] for i in range(10, 30)]
    llm = LLM(path, kv_cache_tokens=600)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    big = LLM(path, kv_cache_tokens=8192).generate(
        prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in big]
    usage = llm.engine.kv_usage()
    assert usage["used"] == usage["cached"]  # nothing leaked: every page in use belongs to the cache


def test_preemption_completes_every_request(path):
    # 16 running sequences need up to 3 pages each (4 prompt + 40 tokens): 43 pages force preemption.
    # (Distinct prompts: the greedy samples of one prompt would be identical, and share their pages.)
    llm = LLM(path, kv_cache_tokens=700, max_num_seqs=16)
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(40, 64)]
    params = SamplingParams(n=1, max_tokens=40, **GREEDY)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats.preemptions > 0
    ref = LLM(path, kv_cache_tokens=16384).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)


def test_seeded_sampling_survives_preemption(path):
    params = SamplingParams(n=2, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    prompts = [[i, i + 1, i + 2] for i in range(60, 70)]
    # 12 running sequences need up to 3 pages each (3 prompt + 40 tokens): 25 pages force preemption.
    small = LLM(path, kv_cache_tokens=400, max_num_seqs=12)
    outs = small.generate(prompts, params, use_tqdm=False)
    ref = LLM(path, kv_cache_tokens=16384).generate(prompts, params, use_tqdm=False)
    assert small.engine.stats.preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]


def test_aging_bounds_how_long_a_cold_request_waits(path):
    llm = LLM(path, kv_cache_tokens=16384, max_num_seqs=4)
    eng = llm.engine
    eng.scheduler.max_wait_steps = 8
    hot = SYSTEM[:100]
    eng.add_request(hot + [1], SamplingParams(max_tokens=2, **GREEDY))
    run_all(eng)  # the hot prefix is cached now
    cold = eng.add_request([250, 251, 252, 253], SamplingParams(max_tokens=2, **GREEDY))
    arrived = eng.step_count
    admitted_at = None
    for k in range(200):  # a steady flood of hot requests that always look better to the scheduler
        eng.add_request(hot + [2 + k % 50], SamplingParams(max_tokens=3, **GREEDY))
        eng.step()
        if admitted_at is None and cold.seqs[0].sched.status is not Status.WAITING:
            admitted_at = eng.step_count
        if cold.finished:
            break
    assert cold.finished
    # Aged after max_wait_steps; then it takes the next free slot, which opens within max_tokens (3)
    # steps because every running request is that short.
    assert admitted_at is not None and admitted_at - arrived <= eng.scheduler.max_wait_steps + 4


def test_abort_frees_pages(path):
    llm = LLM(path, kv_cache_tokens=4096)
    eng = llm.engine
    req = eng.add_request(SYSTEM[:60], SamplingParams(n=3, max_tokens=50, **GREEDY))
    for _ in range(5):
        eng.step()
    assert eng.abort(req.request_id)
    assert not eng.has_unfinished()
    usage = eng.kv_usage()
    assert usage["used"] == usage["cached"]
    assert all(s.finish_reason == "abort" for s in req.seqs)


def test_cost_rule_shares_only_groups_that_save_enough_reads(path, share_every_common_node):
    """Pages held by h sequences are read by one batched call only when (h - 1) x (tokens - 16) reaches
    the threshold; otherwise each sequence reads them in place. Either way the tokens are the same."""
    real_default = share_every_common_node
    params = SamplingParams(n=4, max_tokens=6, **GREEDY)
    prompt = SYSTEM + [5, 6]  # 18 whole pages (288 tokens) held by the 4 samples: 3 x (288 - 16) = 816
    assert real_default > 816  # the default reads this prompt per sequence
    ref = LLM(path, kv_cache_tokens=8192, min_shared_reads=0)
    expected = ref.generate([prompt], params, use_tqdm=False)[0]
    for threshold, shared in [(0, True), (816, True), (817, False), (real_default, False)]:
        llm = LLM(path, kv_cache_tokens=8192, min_shared_reads=threshold)
        eng = llm.engine
        req = eng.add_request(prompt, params)
        wait_for_decode(eng, 4)
        assert bool(eng.batch.shared) == shared, threshold
        assert eng.last_plan.cuts == ((18 if shared else 0),) * 4
        run_all(eng)
        assert [s.generated for s in req.seqs] == [c.token_ids for c in expected.outputs]

    # Nested: a page held by each request's 2 samples (1 x (16 - 16) = 0 < 150) under 6 pages held by all
    # 4 (3 x (96 - 16) = 240 >= 150). The 6 pages are shared; each sample reads its request's page itself.
    llm = LLM(path, kv_cache_tokens=8192, min_shared_reads=150)
    eng = llm.engine
    two = SamplingParams(n=2, max_tokens=4, **GREEDY)
    prompts = [SYSTEM[:96] + list(range(30, 50)), SYSTEM[:96] + list(range(60, 80))]
    reqs = [eng.add_request(p, two) for p in prompts]
    wait_for_decode(eng, 4)
    assert eng.last_plan.cuts == (6, 6, 6, 6)
    assert [(r.page_lo, r.page_hi, r.lo, r.hi) for r in eng.last_plan.shared] == [(0, 6, 0, 4)]
    run_all(eng)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert [s.generated for s in req.seqs] == [alone(path, prompt, 4)] * 2


def test_min_shared_reads_is_validated(path):
    with pytest.raises(ValueError, match="min_shared_reads"):
        LLM(path, kv_cache_tokens=1024, min_shared_reads=-1)


def test_cost_rule_never_costs_memory(path, share_every_common_node):
    """Groups the rule does not share are read per sequence in place, not copied: a pool that holds the
    prompt once plus the generated tokens runs the request whatever the threshold, in the same pages."""
    params = SamplingParams(n=4, max_tokens=6, **GREEDY)
    prompt = SYSTEM + [5, 6]  # copies would need 4 x 307 slots > 480; shared: ~330
    peaks = []
    for threshold in (0, share_every_common_node):
        llm = LLM(path, kv_cache_tokens=480, min_shared_reads=threshold)
        eng = llm.engine
        req = eng.add_request(prompt, params)
        wait_for_decode(eng, 4)
        assert bool(eng.batch.shared) == (threshold == 0)
        run_all(eng)
        assert req.error is None and eng.stats.preemptions == 0
        assert [s.generated for s in req.seqs] == [alone(path, prompt, 6)] * 4
        peaks.append(eng.stats.peak_kv_tokens)
    assert peaks[0] == peaks[1] < 4 * len(prompt)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trees_and_arrivals_match_isolated_runs(path, seed):
    """Random prompt trees arriving at random steps, under several cost-rule thresholds and pool sizes
    (so some groups are shared, some copied, and small pools force sharing for memory and make requests
    wait): every request's greedy tokens equal an isolated run with sharing off."""
    import random

    rng = random.Random(seed)
    isolated = LLM(path, prefix_sharing=False, kv_cache_tokens=16384)
    stem = [rng.randrange(256) for _ in range(rng.choice([40, 120, 300]))]
    reqs = []
    for _ in range(6):
        prompt = stem[: rng.randint(1, len(stem))] + [rng.randrange(256) for _ in range(rng.randint(1, 8))]
        params = SamplingParams(n=rng.choice([1, 3, 6]), max_tokens=rng.randint(2, 12), **GREEDY)
        reqs.append((rng.randint(0, 12), prompt, params))
    reqs.sort(key=lambda r: r[0])
    expected = [isolated.generate([p], sp, use_tqdm=False)[0] for _, p, sp in reqs]
    for threshold, slots in [(0, 450), (100, 16384), (2048, 450), (2048, 16384)]:
        eng = LLM(path, kv_cache_tokens=slots, min_shared_reads=threshold, max_num_seqs=8).engine
        pending, live, step = list(reqs), [], 0
        while pending or eng.has_unfinished():
            while pending and pending[0][0] <= step:
                _, prompt, params = pending.pop(0)
                live.append(eng.add_request(prompt, params))
            eng.step()
            step += 1
            assert step < 5000, "engine did not finish"
        for req, exp in zip(live, expected, strict=True):
            assert req.error is None
            assert [s.generated for s in req.seqs] == [c.token_ids for c in exp.outputs], (threshold, slots)
