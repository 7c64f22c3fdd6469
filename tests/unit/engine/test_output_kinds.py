"""What ``EngineCore.step`` reports per request (``SamplingParams.output_kind``, vLLM's RequestOutputKind).

The server streams DELTA reports as they come and the CLI prints CUMULATIVE ones, so the pieces must add up to
exactly the final output: tokens, text (stop strings held back until they cannot start a stop), logprobs,
finish reasons, for every sample.
"""

from __future__ import annotations

import dataclasses

import pytest

from hydragen import SamplingParams
from hydragen.engine.outputs import RequestOutputKind
from hydragen.errors import ParamError
from tests.helpers.fake_engine import fake_engine

PROMPT = "Write a short list of fruits:"


def reports(engine, params: SamplingParams, prompt_ids: list[int]) -> list:
    req = engine.add_request(prompt_ids, params)
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.request_id == req.request_id]
    return out


@pytest.mark.parametrize("stop", [None, ["\n\n", "an"]])
def test_delta_reports_add_up_to_the_final_output(embedded_llm, stop):
    llm = embedded_llm
    ids = llm.tokenizer.encode(PROMPT)
    base = SamplingParams(n=3, temperature=0.9, max_tokens=24, seed=5, logprobs=2, stop=stop)
    (final,) = reports(llm.engine, base, ids)
    assert final.finished
    deltas = reports(llm.engine, dataclasses.replace(base, output_kind=RequestOutputKind.DELTA), ids)
    assert len(deltas) > 3 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for want in final.outputs:
        pieces = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert all(p.token_ids or p.text or p.finish_reason for p in pieces)  # only samples that changed
        assert [t for p in pieces for t in p.token_ids] == want.token_ids
        assert "".join(p.text for p in pieces) == want.text
        assert [lp for p in pieces for lp in p.logprobs] == want.logprobs
        assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + [want.finish_reason]
        assert pieces[-1].stop_reason == want.stop_reason


def test_cumulative_reports_grow_to_the_final_output(embedded_llm):
    llm = embedded_llm
    ids = llm.tokenizer.encode(PROMPT)
    base = SamplingParams(n=2, temperature=0, max_tokens=16, stop=["qq"], ignore_eos=True)
    (final,) = reports(llm.engine, base, ids)
    grown = reports(llm.engine, dataclasses.replace(base, output_kind=RequestOutputKind.CUMULATIVE), ids)
    assert len(grown) > 2 and grown[-1].outputs == final.outputs
    for before, after in zip(grown, grown[1:], strict=False):
        for b, a in zip(before.outputs, after.outputs, strict=True):
            assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)


def test_final_only_reports_once_and_a_failed_request_reports_its_error():
    engine = fake_engine(16, 4)
    assert len(reports(engine, SamplingParams(n=2, max_tokens=5, temperature=0), [1, 2, 3])) == 1
    engine.runner.fail_requests.add("1")  # the next request's forward fails
    delta = SamplingParams(max_tokens=5, temperature=0, output_kind=RequestOutputKind.DELTA)
    (failed,) = reports(engine, delta, [1, 2, 3, 4])
    assert failed.finished and "injected forward failure" in failed.error


def test_output_kind_must_be_a_kind():
    with pytest.raises(ParamError, match="output_kind"):
        SamplingParams(output_kind="delta")
