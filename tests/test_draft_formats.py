"""The formats speculative decoding builds on (docs/design.md, "The formats the next issues extend"): work
items asking for several logits rows, and what a step hands back for them.

Through the fake engine (``tests/fake_engine.py``): its model's next token is a known function of the
context, so each row's argmax says which context that row was computed on, and its runner checks that
every item's context is in the pages the plan names.
"""

from __future__ import annotations

import pytest
from fake_engine import VOCAB, all_tables, expected_output, fake_engine, next_token, run

from hydragen import SamplingParams
from hydragen.engine.execution import run_plan
from hydragen.engine.step_plan import StepPlan, Work

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [list(range(1, 12)), [5, 9, 2, 7, 7, 3, 8]]


def decoding(engine, prompts, max_tokens: int = 12, steps: int = 3):
    """An engine whose requests (one sequence each) have decoded a few tokens."""
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    for _ in range(steps):
        engine.step()
    return reqs


def drafts(context: list[int], n: int, wrong_from: int | None = None) -> list[int]:
    """n drafted tokens after ``context``: the fake model's greedy ones, off by one from ``wrong_from`` on."""
    out: list[int] = []
    for i in range(n):
        t = next_token(context + out)
        out.append((t + 1) % VOCAB if wrong_from is not None and i >= wrong_from else t)
    return out


def verify_work(engine, seq, draft: list[int], rows: int, parents=None) -> Work:
    """Seq's next token plus ``draft`` as one item (pages allocated for them), asking for ``rows`` rows."""
    t = seq.kv
    start = t.computed
    tokens = (seq.context[-1], *draft)
    assert start == seq.context_len - 1 and engine.kv.allocate(t, start + len(tokens))
    pages = tuple(t.pages[: engine.kv.pages_for(start + len(tokens))])
    return Work(seq, pages, start, tokens, rows, parents)


def test_sample_is_one_logits_row():
    """``sample`` is the count read as a flag: 0 rows computes only, any count samples its last row."""
    assert [Work(None, (), 0, (1, 2, 3), n).sample for n in (0, 1, 3)] == [False, True, True]


def test_an_item_with_several_rows_gets_them_all():
    """A sequence verifying three drafts (the last one wrong) next to an ordinary decode: the first gets
    four rows, each computed on its own context (the argmax is the fake model's next token after that
    prefix), and samples its last as any item does; the decode samples as ever and gets no rows."""
    eng = fake_engine(32, 4)
    decoding(eng, PROMPTS)
    a, b = eng.scheduler.running
    context = list(a.context)
    draft = drafts(context, 3, wrong_from=2)
    wide = verify_work(eng, a, draft, 4)
    plain = verify_work(eng, b, [], 1)
    result = run_plan(eng.runner, eng.structured, StepPlan((wide, plain)))
    ((seq, rows),) = result.row_logits
    assert seq is a and rows.shape == (4, VOCAB)
    assert rows.argmax(-1).tolist() == [next_token(context + draft[:j]) for j in range(4)]
    assert rows.argmax(-1).tolist()[:2] == draft[:2] and rows[2].argmax() != draft[2]
    assert result.samplers == (a, b)
    assert result.tokens == (next_token(context + draft), next_token(list(b.context)))


def test_rows_not_at_the_end_of_the_item_and_items_without_rows():
    """Two rows of a four-token item are its last two; an item asking for none computes only."""
    eng = fake_engine(32, 4)
    decoding(eng, PROMPTS)
    a, b = eng.scheduler.running
    draft = drafts(list(a.context), 3)
    result = run_plan(
        eng.runner, eng.structured, StepPlan((verify_work(eng, a, draft, 2), verify_work(eng, b, [], 0)))
    )
    ((_, rows),) = result.row_logits
    assert rows.argmax(-1).tolist() == [next_token(list(a.context) + draft[:j]) for j in (2, 3)]
    assert result.samplers == (a,)


def test_one_row_a_step_hands_the_forward_logits_to_the_sampler_uncopied():
    """Nothing asks for more than one row today: then the forward's logits go to the sampler as they are
    (no index, no copy) and the result carries no rows."""
    eng = fake_engine(32, 4)
    decoding(eng, PROMPTS)
    forwarded, sampled = [], []
    forward, sample = eng.runner.forward, eng.runner.sample
    eng.runner.forward = lambda batch: forwarded.append(forward(batch)) or forwarded[-1]
    eng.runner.sample = lambda logits, *a: sampled.append(logits) or sample(logits, *a)
    result = run_plan(
        eng.runner,
        eng.structured,
        StepPlan(tuple(verify_work(eng, s, [], 1) for s in eng.scheduler.running)),
    )
    assert sampled[0] is forwarded[0] and result.row_logits == ()


def test_a_failing_request_next_to_an_item_with_several_rows():
    """The forward raises for one request: each request runs alone, and the survivor's rows are still its
    own (the isolation path hands every item's rows back, in plan order)."""
    eng = fake_engine(32, 4)
    decoding(eng, PROMPTS)
    a, b = eng.scheduler.running
    draft = drafts(list(a.context), 2)
    eng.runner.fail_requests = {b.request.request_id}
    plan = StepPlan((verify_work(eng, a, draft, 3), verify_work(eng, b, [], 1)))
    result = run_plan(eng.runner, eng.structured, plan)
    assert [r.request_id for r, _ in result.failed] == [b.request.request_id]
    ((seq, rows),) = result.row_logits
    assert seq is a
    assert rows.argmax(-1).tolist() == [next_token(list(a.context) + draft[:j]) for j in range(3)]
    assert result.samplers == (a,) and result.tokens == (next_token(list(a.context) + draft),)


def test_too_many_rows_for_an_item_is_refused():
    eng = fake_engine(32, 4)
    decoding(eng, PROMPTS[:1])
    (a,) = eng.scheduler.running
    from hydragen.engine.packing import pack

    with pytest.raises(ValueError, match="asks for 3 logits rows"):
        pack(StepPlan((verify_work(eng, a, [4], 3),)), 4, "cpu")


def test_rows_then_truncate_leave_the_run_unchanged():
    """A verifying forward with several rows, then the drafts cut off (``KVManager.truncate``): the cache
    checks out and the outputs are exactly the undisturbed run's."""
    eng = fake_engine(32, 4)
    reqs = decoding(eng, PROMPTS)
    for s in eng.scheduler.running:
        start, pages = s.kv.computed, list(s.kv.pages)
        w = verify_work(eng, s, drafts(list(s.context), 6, wrong_from=3), 7)
        run_plan(eng.runner, eng.structured, StepPlan((w,)))
        eng.kv.computed_to(s.kv, w.end)
        eng.kv.truncate(s.kv, start)
        assert s.kv.computed == start and s.kv.pages == pages
    eng.kv.check(all_tables(eng))
    run(eng)
    for r, p in zip(reqs, PROMPTS, strict=True):
        assert r.seqs[0].generated == expected_output(p, {}, 12, True)
    eng.kv.check([])
