"""Engine core: paged KV that cannot fragment, whole-page caching, forced appends, mixed steps, no leaks.

Tiny random models keep these exact and fast; outputs are compared with isolated runs.
"""

from __future__ import annotations

import random

import pytest

from hydragen import LLM, SamplingParams
from hydragen.kv.pool import OutOfPages, PageAllocator

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


def run_all(engine, max_steps: int = 20_000) -> None:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, "engine did not finish"


def assert_no_leak(engine) -> None:
    engine.kv.check([])  # no page held by anyone: every page free or cached, counts consistent
    usage = engine.kv_usage()
    assert usage["used"] == usage["cached"], usage


def test_allocation_succeeds_whenever_enough_pages_are_free():
    """The old slot allocator failed here: 501 free, largest run 450, 500 needed."""
    alloc = PageAllocator(1000)
    runs = [alloc.alloc(1)[0] for _ in range(1000)]
    for i, (a, _) in enumerate(runs):
        if i < 450 or i % 10 == 0:
            alloc.release(a)
    assert alloc.free == 450 + 55 and alloc.largest_run() == 451
    got = alloc.alloc(500)
    pages = [p for a, b in got for p in range(a, b)]
    assert len(pages) == len(set(pages)) == 500 and alloc.free == 5
    assert got[0] == (0, 451)  # the largest free extent first: runs stay long
    with pytest.raises(OutOfPages):
        alloc.alloc(6)


def test_only_whole_pages_are_cached_and_shared(path):
    """A prompt sharing 21 tokens with a cached one (page size 16) reuses the one whole page they share,
    and computes the rest; nothing is split inside a page, and the two page tables meet in the tree."""
    llm = LLM(path, kv_cache_tokens=4096, page_size=16)
    eng = llm.engine
    a = list(range(20, 60))  # 40 tokens: 2 whole pages cached after it ran
    llm.generate([a], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    assert len(eng.tree) == 2
    b = a[:21] + [7] * 10
    before = eng.stats.prefill_tokens
    out = llm.generate([b], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert out.cached_prompt_tokens == 16 and eng.stats.prefill_tokens - before == len(b) - 16
    assert len(eng.tree) == 3  # b's own second page joined the tree beside a's
    want = LLM(path, kv_cache_tokens=4096).generate(
        [b], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False
    )
    assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_no_leak(eng)


def test_the_last_prompt_token_is_always_computed(path):
    """A prompt cached whole still runs its last token (its logits choose the first output token)."""
    llm = LLM(path, kv_cache_tokens=4096, page_size=4)
    p = list(range(30, 46))  # 16 tokens: 4 whole pages
    first = llm.generate([p], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    again = llm.generate([p], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    assert again.cached_prompt_tokens == 12 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_forced_append_equals_decoding_one_by_one(path):
    prompt = [5, 17, 29, 41, 53, 65, 77]
    params = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    ref = LLM(path, kv_cache_tokens=2048).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(path, kv_cache_tokens=2048)
    eng = llm.engine
    req = eng.add_request(prompt, params)
    while len(req.seqs[0].generated) < 2:
        eng.step()
    eng.append_forced(req.request_id, 0, ref.token_ids[2:7])  # 5 forced tokens, then sample the 8th
    seen = []
    inner = eng.runner.pack
    eng.runner.pack = lambda plan: seen.append([len(w.tokens) for w in plan.work]) or inner(plan)
    eng.step()
    assert seen[0] == [6]  # one forward: the last sampled token and the 5 forced ones
    run_all(eng)
    s = req.seqs[0]
    assert s.generated == ref.token_ids and s.forced == 5
    # One logprobs entry per token: a forced one is marked {token: None} (nothing was sampled for it).
    assert len(s.logprobs) == len(s.generated)
    assert all(s.logprobs[i] == {s.generated[i]: None} for i in range(2, 7))
    # The token sampled right after the forced ones, and every later one: logits match up to fp32 rounding.
    for i in [0, 1, 7, 8, 9, 10, 11]:
        (t, lp), (t2, lp2) = next(iter(s.logprobs[i].items())), next(iter(ref.logprobs[i].items()))
        assert t == t2 and abs(lp - lp2) < 1e-5


def test_append_forced_is_validated(path):
    eng = LLM(path, kv_cache_tokens=2048).engine
    req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.append_forced(req.request_id, 0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="token ids"):
        eng.append_forced(req.request_id, 0, [10**6])
    with pytest.raises(ValueError, match="no unfinished sequence"):
        eng.append_forced("nope", 0, [1])


def test_n1_stores_its_prompt_once(path):
    prompt = [(7 * i) % 200 + 20 for i in range(300)]
    llm = LLM(path, kv_cache_tokens=4096)
    llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    ps = llm.engine.pool.page_size
    once = -(-(len(prompt) + 8 - 1) // ps) * ps  # the pages of prompt + output (the last token needs none)
    assert llm.engine.stats.peak_kv_tokens == once < 2 * len(prompt)


def test_mixed_prefill_and_decode_steps_match_isolated_runs(path):
    llm = LLM(path, kv_cache_tokens=8192)
    eng = llm.engine
    eng.scheduler.prefill_budget = eng.scheduler.prefill_chunk = 48
    mixed = []
    inner = eng.runner.pack

    def spy(plan):
        mixed.append((sum(len(w.tokens) > 1 for w in plan.work), sum(len(w.tokens) == 1 for w in plan.work)))
        return inner(plan)

    eng.runner.pack = spy
    prompts = [[3, 4, 5], [9] * 150 + [1, 2], [9] * 150 + [7], list(range(30, 130))]
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(eng.add_request(p, SamplingParams(n=1 + i % 2, max_tokens=10, **GREEDY)))
        eng.step()
    run_all(eng)
    assert any(p > 1 and d > 0 for p, d in mixed), mixed  # several chunks and decodes in one forward
    for p, r in zip(prompts, reqs, strict=True):
        alone = LLM(path, kv_cache_tokens=4096, prefix_sharing=False)
        want = alone.generate([p], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
        assert all(s.generated == want.outputs[0].token_ids for s in r.seqs)
    assert_no_leak(eng)


@pytest.mark.parametrize("seed", [0, 1])
def test_adversarial_arrivals_on_a_small_pool(path, seed):
    """Shared and distinct prompts of mixed lengths, n up to 4, arriving at random steps into a pool that
    forces eviction, waves and preemption: every request finishes with its isolated greedy output."""
    rng = random.Random(seed)
    stems = [[rng.randrange(20, 250) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    jobs = []
    for _ in range(14):
        prompt = rng.choice(stems)[: rng.randrange(1, 60)] + [
            rng.randrange(20, 250) for _ in range(rng.randrange(1, 25))
        ]
        jobs.append((rng.randrange(0, 30), prompt, rng.randrange(1, 5), rng.randrange(1, 30)))
    llm = LLM(path, kv_cache_tokens=24 * 8, page_size=8, max_num_seqs=8)
    eng = llm.engine
    reqs, step = {}, 0
    while len(reqs) < len(jobs) or eng.has_unfinished():
        for k, (at, prompt, n, mt) in enumerate(jobs):
            if at == step and k not in reqs:
                reqs[k] = eng.add_request(prompt, SamplingParams(n=n, max_tokens=mt, **GREEDY))
        eng.step()
        step += 1
        assert step < 5000
    assert eng.stats.preemptions > 0
    ref = LLM(path, kv_cache_tokens=8192, prefix_sharing=False)
    for k, (_, prompt, n, mt) in enumerate(jobs):
        want = ref.generate([prompt], SamplingParams(max_tokens=mt, **GREEDY), use_tqdm=False)[0]
        assert reqs[k].error is None
        assert [s.generated for s in reqs[k].seqs] == [want.outputs[0].token_ids] * n
    assert_no_leak(eng)
