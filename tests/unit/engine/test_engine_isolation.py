"""One request's failure ends that request alone; admission is a promise.

Faults are injected through surfaces that outlive engine rewrites: ``engine.sampler`` (a callable with the
Sampler's signature), ``engine.tokenizer``, and (for prefill) ``engine.model``'s call. Every other
request must finish with exactly the tokens of an undisturbed run, and no KV page may leak.
"""

from __future__ import annotations

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.engine.sampler import derive_seed
from hydragen.engine.sampling_params import INT64_MAX, INT64_MIN, MIN_TOP_P
from hydragen.errors import ParamError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44], [100, 90, 80]]
SAMPLED = dict(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
VICTIM_SEED = 777


def run_all(engine, max_steps: int = 5000) -> dict:
    """Step until idle; the outputs by request id (asserts the engine never stalls)."""
    outs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return outs


def assert_no_leak(engine) -> None:
    usage = engine.kv_usage()
    assert usage["used"] == usage["cached"] <= usage["total"], usage


def workload(engine) -> list:
    """Four innocent requests (two with n=2) and one victim, all sampled with fixed seeds."""
    reqs = [
        engine.add_request(p, SamplingParams(n=1 + i % 2, seed=i, **SAMPLED), request_id=f"ok{i}")
        for i, p in enumerate(PROMPTS)
    ]
    reqs.append(
        engine.add_request([5, 6, 7, 60], SamplingParams(seed=VICTIM_SEED, **SAMPLED), request_id="victim")
    )
    return reqs


def tokens(outs: dict, rid: str) -> list[list[int]]:
    return [c.token_ids for c in outs[rid].outputs]


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def undisturbed(path):
    engine = LLM(path, kv_cache_tokens=4096).engine
    workload(engine)
    return run_all(engine)


class FaultySampler:
    """Wraps the real sampler; misbehaves from the victim's 4th decode step on (mid-decode)."""

    def __init__(self, real, mode: str):
        self.real, self.mode, self.victim_calls = real, mode, 0
        self.victim = derive_seed(VICTIM_SEED, 0)

    def __call__(self, logits, temperature, top_k, top_p, seeds, steps, *flags):
        out = self.real(logits, temperature, top_k, top_p, seeds, steps, *flags)
        rows = (seeds == self.victim).nonzero().flatten().tolist()
        if rows:
            self.victim_calls += 1
            if self.victim_calls > 3:
                if self.mode == "raise":
                    raise RuntimeError("injected sampler fault")
                out = out.clone()
                out[rows[0]] = logits.shape[1] + 5  # an impossible token, as NaN logits would give
        return out


@pytest.mark.parametrize("mode", ["raise", "bad token"])
def test_sampler_fault_mid_decode_fails_only_its_request(path, undisturbed, mode):
    engine = LLM(path, kv_cache_tokens=4096).engine
    engine.sampler = FaultySampler(engine.sampler, mode)
    workload(engine)
    outs = run_all(engine)
    assert engine.sampler.victim_calls > 3
    victim = outs["victim"]
    assert victim.error and victim.error.startswith("sampling failed")
    if mode == "raise":
        assert "injected sampler fault" in victim.error
    for i in range(len(PROMPTS)):
        assert outs[f"ok{i}"].error is None
        assert tokens(outs, f"ok{i}") == tokens(undisturbed, f"ok{i}")
    assert_no_leak(engine)
    # The engine goes on serving: a new request completes normally.
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0), request_id="after")
    assert run_all(engine)["after"].error is None


class FaultyTokenizer:
    """Decodes ids as text; raises on the victim's tokens, recognised by its first two generated ids
    appearing one after the other (an incremental detokenizer decodes short windows, never the whole
    generation, so a window holding that pair is what identifies the victim)."""

    eos_token_ids = frozenset()

    def __init__(self, victim_pair: list[int]):
        self.victim_pair = victim_pair

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if any(ids[i : i + 2] == self.victim_pair for i in range(len(ids) - 1)):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return " ".join(map(str, ids))


def _has_pair(ids: list[int], pair: list[int]) -> bool:
    return any(ids[i : i + 2] == pair for i in range(len(ids) - 1))


@pytest.mark.parametrize("stop", [None, ["never matches"]])
def test_detokenizer_fault_fails_only_its_request(path, undisturbed, stop):
    """The incremental detokenizer decodes every step, with or without stop strings."""
    victim_pair = tokens(undisturbed, "victim")[0][:2]
    others = [t for i in range(len(PROMPTS)) for t in tokens(undisturbed, f"ok{i}")]
    assert not any(_has_pair(t, victim_pair) for t in others)
    engine = LLM(path, kv_cache_tokens=4096).engine
    engine.tokenizer = FaultyTokenizer(victim_pair)
    reqs = [
        engine.add_request(p, SamplingParams(n=1 + i % 2, seed=i, stop=stop, **SAMPLED), request_id=f"ok{i}")
        for i, p in enumerate(PROMPTS)
    ]
    engine.add_request(
        [5, 6, 7, 60], SamplingParams(seed=VICTIM_SEED, stop=stop, **SAMPLED), request_id="victim"
    )
    outs = run_all(engine)
    assert outs["victim"].error is not None
    assert "injected detokenizer fault" in outs["victim"].error
    assert outs["victim"].error.startswith("detokenization failed")
    for r in reqs:
        out = outs[r.request_id]
        assert out.error is None
        assert tokens(outs, r.request_id) == tokens(undisturbed, r.request_id)
        assert [c.text for c in out.outputs] == [" ".join(map(str, c.token_ids)) for c in out.outputs]
    assert_no_leak(engine)


def test_prefill_fault_fails_only_the_requests_on_that_prompt(path):
    """Relies on the model being called as model(ids, positions, attend) for prefill chunks."""
    poison = 250
    engine = LLM(path, kv_cache_tokens=4096).engine
    real = engine.model

    class PoisonedModel:
        def __call__(self, ids, pos, attend, **options):
            if ids.numel() > 1 and bool((ids == poison).any()):
                raise RuntimeError("injected prefill fault")
            return real(ids, pos, attend, **options)

        def __getattr__(self, name):
            return getattr(real, name)

    engine.model = PoisonedModel()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    good = [engine.add_request(p, greedy) for p in PROMPTS]
    bad = engine.add_request([1, 2, poison, 3, 4], SamplingParams(n=3, temperature=0, max_tokens=8))
    outs = run_all(engine)
    assert outs[bad.request_id].error.startswith("prefill failed")
    ref = LLM(path, kv_cache_tokens=4096).generate(PROMPTS, greedy, use_tqdm=False)
    assert [tokens(outs, r.request_id) for r in good] == [[c.token_ids for c in o.outputs] for o in ref]
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "name, value",
    [
        ("n", 0),
        ("n", 1025),
        ("n", 2**64),
        ("n", True),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 1e-300),  # 1/T overflows float32
        ("temperature", 1e-7),
        ("temperature", 3.5e38),  # inf in float32
        ("temperature", 10**400),  # too large for a float at all
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1e-46),  # rounds to 0 in float32
        ("top_p", 1e-40),  # a float32 denormal
        ("top_p", float("nan")),
        ("top_p", 1.0000001),
        ("top_k", -1),
        ("top_k", 2**63),  # beyond int64
        ("top_k", 2.0),
        ("max_tokens", 0),
        ("max_tokens", 2**63),
        ("max_tokens", None),
        ("seed", 2**63),
        ("seed", INT64_MIN - 1),
        ("seed", 1.5),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop", ["x"] * 65),
        ("stop", ["x" * 1025]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**63]),
        ("stop_token_ids", list(range(1025))),
        ("stop_token_ids", ["a"]),
        ("ignore_eos", "yes"),
    ],
)
def test_unrepresentable_sampling_params_are_refused_by_name(name, value):
    with pytest.raises(ParamError, match=name) as info:
        SamplingParams(**{name: value})
    assert info.value.param == name
    assert len(str(info.value)) < 300  # a huge value is not echoed back whole


def test_values_at_the_limits_run(path):
    """The extreme values that are accepted are representable: they run, in one batch, to the expected
    tokens (a top_k beyond the vocabulary is clamped: the same as no top_k)."""
    llm = LLM(path, kv_cache_tokens=4096)
    base = dict(max_tokens=6, ignore_eos=True)
    cases = [
        (
            SamplingParams(top_k=INT64_MAX, seed=INT64_MIN, **base),
            SamplingParams(top_k=0, seed=INT64_MIN, **base),
        ),
        (SamplingParams(top_p=MIN_TOP_P, seed=INT64_MAX, **base), SamplingParams(temperature=0, **base)),
        (SamplingParams(temperature=1e-6, seed=1, **base), SamplingParams(temperature=0, **base)),
        (SamplingParams(temperature=3.4e38, seed=2, stop_token_ids=[255], **base), None),
    ]
    prompts = [[3, 4, 5]] * len(cases)
    outs = llm.generate(prompts, [c for c, _ in cases], use_tqdm=False)
    for out, (_, same_as) in zip(outs, cases, strict=True):
        assert out.error is None and all(0 <= t < 256 for t in out.outputs[0].token_ids)
        if same_as is not None:
            assert [c.token_ids for c in out.outputs] == refs(path, [[3, 4, 5]], same_as)[0]
    # max_tokens at int64's limit stops at the model's context, as "length".
    long = llm.generate(
        [[3] * 500], SamplingParams(temperature=0, max_tokens=INT64_MAX, ignore_eos=True), use_tqdm=False
    )
    assert len(long[0].outputs[0].token_ids) == 512 - 500 and long[0].outputs[0].finish_reason == "length"
    assert_no_leak(llm.engine)


def test_engine_refuses_what_it_could_never_run(path):
    engine = LLM(path, kv_cache_tokens=100).engine
    cases = [
        ([], {}, "prompt"),
        ([1, 2, 256], {}, "prompt"),
        ([1] * 512, {}, "prompt"),
        ([1, 2], dict(stop_token_ids=[256]), "stop_token_ids"),
        ([1] * 50, dict(max_tokens=51), "max_tokens"),  # 50 + 51 slots > 100: can never fit
    ]
    for prompt, kw, param in cases:
        with pytest.raises(ParamError) as info:
            engine.add_request(prompt, SamplingParams(**kw))
        assert info.value.param == param, (prompt, kw)
    assert "KV" in str(info.value)
    assert not engine.has_unfinished()


_REFERENCE: dict[str, LLM] = {}


def refs(path, prompts, params) -> list[list[list[int]]]:
    """Tokens of an unconstrained run (one big-pool LLM per model, reused)."""
    big = _REFERENCE.setdefault(path, LLM(path, kv_cache_tokens=16384))
    return [[c.token_ids for c in o.outputs] for o in big.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("sharing", [True, False])
def test_a_lone_request_at_the_admission_limit_finishes(path, sharing):
    """prompt + max_tokens exactly at the admission limit (in whole pages; with sharing off the sequence
    holds its own copy): the request runs alone to the last page and finishes with the tokens of an
    unconstrained run; one more token (one more page) is refused."""
    prompt, max_tokens = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], 128  # own pages end on a page boundary
    probe = LLM(path, kv_cache_tokens=4096, prefix_sharing=sharing).engine
    slots = probe.sequence_kv_need(len(prompt), max_tokens)  # whole pages: the engine's own admission limit
    llm = LLM(path, kv_cache_tokens=slots, prefix_sharing=sharing)
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.error is None
    assert [c.token_ids for c in out.outputs] == refs(path, [prompt], params)[0]
    more = max_tokens + 1  # the first max_tokens that needs one more page than the pool has
    while llm.engine.sequence_kv_need(len(prompt), more) <= slots:
        more += 1
    with pytest.raises(ParamError, match="KV"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=more))
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("sharing", [True, False])
def test_n_larger_than_the_pool_runs_in_waves(path, sharing):
    """n = 8 sequences of 40 tokens each in a pool that holds about two at a time (and n larger than
    max_num_seqs): admitted per sequence, they run in waves, each with its own seeded tokens."""
    prompt = list(range(20, 30))
    params = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    llm = LLM(path, kv_cache_tokens=90 if sharing else 160, max_num_seqs=6, prefix_sharing=sharing)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == refs(path, [prompt], params)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 8  # the samples differ
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("seed, sharing", [(0, True), (1, True), (2, False)])
def test_every_admitted_request_finishes_on_a_small_pool(path, seed, sharing):
    """Random requests arriving at random steps on a pool far too small for all of them, two of them at
    the admission limit (their prompt + max_tokens fill the whole pool): every request is admitted, none
    fails, and each one's tokens equal an unconstrained run; nothing leaks."""
    import random

    rng = random.Random(seed)
    slots = 64
    arrivals = []
    for i in range(6):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 20))]
        big = i in (1, 4)
        max_tokens = slots - len(prompt) if big else rng.randint(1, 10)
        params = SamplingParams(
            n=1 if big else rng.choice([1, 2, 3]),
            temperature=1.0,
            seed=rng.randrange(100),
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        arrivals.append((rng.randint(0, 30), prompt, params))
    arrivals.sort(key=lambda a: a[0])
    expected = [refs(path, [p], sp)[0] for _, p, sp in arrivals]
    # Sharing off, a sequence holds a private copy of its context: admission asks for twice the room.
    # One-token pages: the pool limit is exact in tokens, and fragmentation is at its finest.
    engine = LLM(
        path,
        kv_cache_tokens=slots * (1 if sharing else 2),
        max_num_seqs=6,
        prefix_sharing=sharing,
        page_size=1,
    ).engine
    pending, live, outs, step = list(arrivals), [], {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            live.append(engine.add_request(prompt, params))
        for out in engine.step():
            outs[out.request_id] = out
        step += 1
        assert step < 5000, "engine did not finish"
    assert engine.stats.preemptions > 0
    for req, exp in zip(live, expected, strict=True):
        assert outs[req.request_id].error is None
        assert tokens(outs, req.request_id) == exp
    assert_no_leak(engine)


def test_a_lone_prompt_is_prefilled_around_cached_prefixes(path):
    """The cache holds two earlier prompts; a new, long prompt shares the second one's prefix (pinned where
    the earlier request left it) and needs more KV than any free run beside it (the first verified on the
    contiguous-run pool of today's engine: the new part is split around the pinned prefix). It must still
    be admitted and finish with the unconstrained tokens, not stall."""
    engine = LLM(path, kv_cache_tokens=100, page_size=1).engine  # the limit exact in tokens
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    shared = [10 + i for i in range(20)]
    for prompt in ([200 + i % 50 for i in range(30)], shared):
        engine.add_request(prompt, one)
        run_all(engine, max_steps=100)
    long = shared + [100 + (7 * i) % 90 for i in range(59)]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)  # 79 + 21: the whole pool
    req = engine.add_request(long, params)
    other = engine.add_request([90, 91, 92], one)  # scheduled beside it at first, then made to wait
    outs = run_all(engine, max_steps=500)
    assert outs[req.request_id].error is None and outs[other.request_id].error is None
    assert tokens(outs, req.request_id) == refs(path, [long], params)[0]
    assert tokens(outs, other.request_id) == refs(path, [[90, 91, 92]], one)[0]
    assert_no_leak(engine)


def test_llm_batch_with_one_bad_prompt_leaves_nothing_behind(path):
    llm = LLM(path, kv_cache_tokens=4096)
    with pytest.raises(ValueError, match="prompt 2: prompt token id 999"):
        llm.generate([[1, 2], [3, 4], [5, 999]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 3
    assert_no_leak(llm.engine)


def test_sampler_rows_are_independent_of_the_batch():
    """What makes per-row retries exact: each row sampled alone gives the batched call's token."""
    from hydragen.engine.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    args = (
        torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0]),
        torch.tensor([0, 5, 0, 20, 0, 3]),
        torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 1.0]),
        torch.arange(6) * 1000 + 17,
        torch.full((6,), 4),
    )
    sampler, flags = Sampler(), (True, True, True)
    batched = sampler(logits, *args, *flags)
    rows = [int(sampler(logits[i : i + 1], *(a[i : i + 1] for a in args), *flags)) for i in range(6)]
    assert batched.tolist() == rows


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_of_nan_logits_fails_alone_and_says_why(temperature):
    """A model that computes NaN logits (or +inf ones, sampled at a temperature) for one request: that row's
    error says so; a row with tokens masked to -inf (structured outputs) and a plain row sample as they
    would alone."""
    from hydragen.engine.isolation import sample_rows
    from hydragen.engine.sampler import Sampler

    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2, :40] = float("-inf")
    logits[3, 3] = float("inf")
    rows = 4
    args = (
        torch.full((rows,), temperature),
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows),
        torch.arange(rows, dtype=torch.long),
        torch.zeros(rows, dtype=torch.long),
    )
    flags = (temperature > 0, False, False)
    sampler = Sampler()
    tokens, errors = sample_rows(sampler, logits, args, flags, vocab)
    broken = {1, 3} if temperature > 0 else {1}  # greedy takes the +inf token: an argmax is defined
    assert set(errors) == broken
    assert all("NaN or infinite logits" in errors[i] for i in broken), errors
    if temperature == 0:
        assert tokens[3] == 3
    for i in (0, 2):
        alone = sampler(logits[i : i + 1], *(a[i : i + 1] for a in args), *flags)
        assert tokens[i] == alone[0]
    assert tokens[2] >= 40


def test_a_sample_readmitted_mid_forced_append_leaves_no_page_that_nobody_writes(path):
    """Both samples of a request are forced through the same text; pages run short and the newer sample goes
    back to the queue. Re-admitted, it publishes the text's pages to the prefix cache before computing them
    (in flight: others wait for them) and computes them a chunk at a time beside its sibling. Once both
    stood at the same position it followed its sibling and forked from it, dropping its pages in flight:
    a later request through that text then held them and waited forever, holding its pages."""
    llm = LLM(path, kv_cache_tokens=4096, page_size=1)
    engine = llm.engine
    engine.scheduler.prefill_chunk, engine.scheduler.prefill_budget = 4, 8  # the text takes two chunks
    a = engine.add_request([5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    for s in a.seqs:
        engine.append_forced(a.request_id, s.index, [40, 41, 42, 43, 44, 45])
    engine.scheduler.preempt(a.seqs[1])  # what the scheduler does when a running sequence cannot grow
    engine.step()
    engine.step()
    engine.kv.check([s.kv for s in engine.scheduler.running])  # every page in flight has one writer
    later = a.seqs[0].context[:10] + [60]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    b = engine.add_request(later, greedy)
    outs = run_all(engine, max_steps=200)
    ref = LLM(path, kv_cache_tokens=4096, prefix_sharing=False).generate([later], greedy, use_tqdm=False)
    assert tokens(outs, b.request_id) == [ref[0].outputs[0].token_ids]
    assert_no_leak(engine)


class InterruptedModel:
    """The model, raising ``error`` from its forward while ``armed`` (Ctrl-C in a notebook, a fault)."""

    def __init__(self, real, error: BaseException, when=lambda ids: True):
        self.real, self.error, self.when, self.armed = real, error, when, True

    def __call__(self, ids, pos, attend, **options):
        if self.armed and self.when(ids):
            raise self.error
        return self.real(ids, pos, attend, **options)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("injected fault of every request")])
def test_a_step_that_raises_before_its_commit_gives_every_page_back(path, error):
    """Ctrl-C inside ``LLM.generate`` (a notebook), or every request of a step failing alone (then the engine
    itself is taken to be broken and the step raises): the step that prefills the prompts and forks their
    samples raises before its commit. The pages it reserved for the forks belonged to no page table and
    leaked for good (``reset_prefix_cache`` could not get them back). Now they go back, the interrupted
    requests are aborted, and the next call runs as on a fresh engine."""
    llm = LLM(path, kv_cache_tokens=4096)
    engine = llm.engine
    faulty = InterruptedModel(engine.model, error)
    engine.model = faulty
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]]  # two requests: each fails alone, too
    with pytest.raises(type(error)):
        llm.generate(prompts, params, use_tqdm=False)
    engine.kv.check([s.kv for s in engine.scheduler.running])
    assert not engine.has_unfinished()
    engine.reset_prefix_cache()
    assert engine.pool.free_pages == engine.pool.num_pages  # nothing held by a table that is gone
    faulty.armed = False
    again = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(path, kv_cache_tokens=4096).generate(prompts, params, use_tqdm=False)
    as_tokens = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    assert as_tokens(again) == as_tokens(ref)
    assert_no_leak(engine)
