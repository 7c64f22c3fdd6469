"""Speculative decoding through the engine: the fake model (outputs known, drafts scripted) for the
mechanics, and the embedded model for the numbers: verified drafts give exactly the tokens and
log-probabilities of decoding without them."""

from __future__ import annotations

import pytest

from hydragen import LLM, SamplingParams
from tests.helpers.fake_engine import EOS, ScriptedProposer, expected_output, fake_engine, run

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "cost_rule": False}
PROMPTS = [[3, 4, 5, 6, 7], [9, 9, 1], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40]]


def spec_engine(wrong_from, pages=64, page_size=4, **options):
    eng = fake_engine(pages, page_size, speculative_config=SPEC, **options)
    eng.scheduler.speculator.proposer = ScriptedProposer(wrong_from)
    return eng


def outputs(eng, params):
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    run(eng)
    return [[s.generated for s in r.seqs] for r in reqs], [[s.finish_reason for s in r.seqs] for r in reqs]


@pytest.mark.parametrize("wrong_from", [lambda s, k: k, lambda s, k: 0, lambda s, k: s.context_len % (k + 1)])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_tokens_and_endings_are_those_of_decoding_alone(wrong_from, ignore_eos):
    """All drafts right, all wrong, or right up to a varying place: every output is the fake model's, ends
    where it must (an EOS inside an accepted run ends it there; max_tokens cuts a run), and nothing leaks."""
    params = SamplingParams(max_tokens=13, temperature=0, ignore_eos=ignore_eos)
    eng = spec_engine(wrong_from)
    got, reasons = outputs(eng, params)
    for prompt, (tokens,), (reason,) in zip(PROMPTS, got, reasons, strict=True):
        want = expected_output(prompt, {}, 13, ignore_eos)
        assert tokens == want
        assert reason == ("stop" if want[-1] == EOS and not ignore_eos else "length")
    eng.kv.check([])
    usage = eng.kv_usage()
    assert usage["used"] == usage["cached"]
    m = eng.scheduler.speculator.metrics
    assert m.drafts > 0 and m.draft_tokens >= m.accepted_tokens


def test_accepted_runs_save_steps_and_are_counted():
    """With every draft right, a sequence takes up to k + 1 tokens a step: fewer steps, and the counters
    say so (every position accepted as often as it was verified)."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    off = fake_engine(64, 4)
    outputs(off, params)
    on = spec_engine(lambda s, k: k)
    outputs(on, params)
    assert on.step_count < off.step_count / 2
    m = on.scheduler.speculator.metrics
    assert m.accepted_tokens == m.draft_tokens and m.accepted_per_position[0] == m.drafts
    assert m.mean_accepted_length > 3


def test_stop_token_in_an_accepted_run_and_sampled_sequences():
    """A stop token id met inside a run ends the sequence at it (the rest of the run is dropped); n > 1."""
    ref = expected_output(PROMPTS[0], {}, 20, True)
    stop = ref[6]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop], n=2)
    eng = spec_engine(lambda s, k: k)
    req = eng.add_request(PROMPTS[0], params)
    run(eng)
    for s in req.seqs:
        assert s.generated == ref[: ref.index(stop) + 1] and s.finish_reason == "stop"


def test_a_steep_step_cost_turns_speculation_off():
    """The cost rule measured on the (fake) runner: when every extra row costs as much as a whole step,
    nothing is verified, and outputs are unchanged."""
    eng = fake_engine(64, 4, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec = eng.scheduler.speculator
    spec.proposer = ScriptedProposer(lambda s, k: k)
    assert spec.cost is not None and spec.cost.at(8) == pytest.approx(1.08)  # the fake runner's 1 + 0.01 R
    from hydragen.spec.cost import StepCost

    spec.cost = StepCost([1, 512], [1.0, 512.0])
    got, _ = outputs(eng, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert got == [[expected_output(p, {}, 10, True)] for p in PROMPTS]
    assert spec.metrics.drafts == 0 and spec.metrics.steps > 0
    assert spec.proposer.proposed == 0  # nothing could pay: the lookup itself was skipped


@pytest.fixture(scope="module")
def embedded_pair():
    """The embedded model with speculation off and with every n-gram draft verified (no cost rule)."""
    off = LLM(kv_cache_tokens=8192)
    on = LLM(kv_cache_tokens=8192, speculative_config=SPEC)
    return off, on


REPEATS = [
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "The capital of France is Paris. The capital of France is Paris. The capital of France is",
]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0, logprobs=2),
        dict(temperature=0.8, top_p=0.95, seed=11, logprobs=1, stop=["\n\n\n"]),
        dict(temperature=0, stop=["banana, cherry, apple", "b + b", "France is Paris. The"]),
    ],
)
def test_the_embedded_model_gives_the_same_tokens_and_logprobs(embedded_pair, params):
    """One request at a time (nothing shared with another sequence): each verified row is computed by the
    same kernels in the same order as a decode row, so tokens, log-probabilities, finish reasons and text
    are identical, bit for bit, while drafts were accepted."""
    off, on = embedded_pair
    p = SamplingParams(max_tokens=40, **params)
    for prompt in REPEATS:
        (a,) = off.generate([prompt], p, use_tqdm=False)[0].outputs
        (b,) = on.generate([prompt], p, use_tqdm=False)[0].outputs
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert b.logprobs == a.logprobs  # dicts of floats: equal bit for bit
    assert on.engine.scheduler.speculator.metrics.accepted_tokens > 5
