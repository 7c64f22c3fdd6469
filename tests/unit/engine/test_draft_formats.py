"""The formats speculative decoding builds on (docs/design.md, "The formats the next issues extend"): work
items asking for several logits rows, draft trees (tokens that share positions, each in its own KV slot,
seeing the context and their ancestors only), and truncating the drafts away afterwards.

Mostly through the fake engine (``tests/helpers/fake_engine.py``): its model's next token is a known
function of the context, so each row's argmax says which context that row was computed on, and its runner
checks that every item's context is in the pages the plan names and that each token reads exactly its
context (a tree token: the context and its ancestors) at its own position. A tiny real model then checks a
tree's rows against each path run as an ordinary item (the rotary positions and the mask together).
"""

from __future__ import annotations

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.engine.execution import run_plan
from hydragen.engine.step_plan import SharedRun, StepPlan, Work
from tests.helpers.fake_engine import VOCAB, all_tables, expected_output, fake_engine, next_token, run

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
    prefix), and every row is sampled: the two right drafts are its tokens, then the draw that rejected the
    third; the decode samples as ever and gets no rows."""
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
    assert result.tokens == ((*draft[:2], next_token(context + draft[:2])), (next_token(list(b.context)),))


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
    assert result.samplers == (a,) and result.tokens == ((*draft, next_token(list(a.context) + draft)),)


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


# --------------------------------------------------------------------------------------------------
# Draft trees
# --------------------------------------------------------------------------------------------------

# The next token, then two branches: tokens 1-2 a chain under it, tokens 3-5 another child with two
# children of its own; token 6 a second root (an alternative to the next token itself).
TREE = (-1, 0, 1, 0, 3, 3, -1)


def path(parents, j: int) -> list[int]:
    """Token j's ancestors and itself, root first."""
    out = [j]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def shared_pages(a, b) -> int:
    """How many leading pages two sequences' tables hold in common."""
    same = 0
    while a.kv.pages[same] == b.kv.pages[same]:
        same += 1
    return same


def decoding_pair(engine):
    """A request of two samples (a 13-token prompt: they share its full pages) after a few decode steps."""
    reqs = [engine.add_request(list(range(1, 14)), SamplingParams(n=2, max_tokens=12, **GREEDY))]
    for _ in range(3):
        engine.step()
    return reqs


def test_a_draft_tree_inside_a_shared_run_gets_each_node_s_row():
    """Two samples of one prompt read their shared pages through one run; one of them verifies a draft
    tree. The fake runner checks that every tree token reads the context and its ancestors only, at
    position start + depth; each row's argmax is the fake model's next token after that node's path."""
    eng = fake_engine(32, 4)
    decoding_pair(eng)
    a, b = eng.scheduler.running
    same = shared_pages(a, b)
    assert same == 3
    context = list(a.context)
    draft = [9, 30, 31, 17, 5, 40]
    tree = verify_work(eng, a, draft, len(TREE), TREE)
    plan = StepPlan((tree, verify_work(eng, b, [], 1)), (), (SharedRun(0, same, 0, 2),), (same, same))
    result = run_plan(eng.runner, eng.structured, plan)
    ((seq, rows),) = result.row_logits
    tokens = tree.tokens
    want = [next_token(context[:-1] + [tokens[i] for i in path(TREE, j)]) for j in range(len(TREE))]
    assert seq is a and rows.argmax(-1).tolist() == want
    assert result.tokens == ((want[-1],), (next_token(list(b.context)),))  # a tree: its last row is sampled


def test_truncate_after_a_draft_tree_leaves_the_cache_as_if_it_never_ran():
    """Every running sequence verifies a draft tree reaching into new pages (one of them inside a shared
    run), the forward's KV is recorded, then cut back to the verified length: the tables, the page counts
    and the prefix tree are what they were (nothing drafted was ever published), the cache checks out,
    and every output is the undisturbed run's."""
    eng = fake_engine(48, 4)
    reqs = decoding_pair(eng) + decoding(eng, PROMPTS[:1])
    running = list(eng.scheduler.running)
    before = [(s.kv.computed, list(s.kv.pages)) for s in running]
    usage, nodes = eng.kv.usage(), len(eng.kv.tree.nodes)
    work = tuple(verify_work(eng, s, [3, 4, 5, 6, 7, 8], len(TREE), TREE) for s in running)
    assert all(len(w.pages) > len(pages) for w, (_, pages) in zip(work, before, strict=True))  # new pages
    run_plan(eng.runner, eng.structured, StepPlan(work, (), (SharedRun(0, 2, 0, 2),), (2, 2, 0)))
    for s, w in zip(running, work, strict=True):
        eng.kv.computed_to(s.kv, w.end)
    assert len(eng.kv.tree.nodes) == nodes  # drafts are never published
    for s, (start, pages) in zip(running, before, strict=True):
        eng.kv.truncate(s.kv, start)
        assert s.kv.computed == start and s.kv.pages == pages
    assert eng.kv.usage() == usage and len(eng.kv.tree.nodes) == nodes
    eng.kv.check(all_tables(eng))
    run(eng)
    for r in reqs:
        for s in r.seqs:
            assert s.generated == expected_output(r.prompt_ids, {}, 12, True)
    eng.kv.check([])


def check_tree_rows_against_paths(eng, prompt: list[int], atol: float) -> None:
    """Two samples of ``prompt`` decode a few steps; then one verifies a draft tree inside a shared run with
    the other: each node's row must be the logits of its path run alone as an ordinary item (the same
    context, the path's tokens at consecutive positions), and the other sample's row its own decode's."""
    req = eng.add_request(prompt, SamplingParams(n=2, max_tokens=12, **GREEDY))
    for _ in range(3):
        eng.step()
    a, b = req.seqs
    draft = [21, 22, 23, 24, 25, 26]
    tree = verify_work(eng, a, draft, len(TREE), TREE)
    same = shared_pages(a, b)
    plan = StepPlan((tree, verify_work(eng, b, [], 1)), (), (SharedRun(0, same, 0, 2),), (same, same))
    logits = eng.runner.forward(eng.runner.pack(plan))
    assert logits.shape[0] == len(TREE) + 1
    for j in range(len(TREE)):
        chain = tuple(tree.tokens[i] for i in path(TREE, j))
        alone = eng.runner.forward(eng.runner.pack(StepPlan((Work(a, tree.pages, tree.start, chain, 1),))))
        torch.testing.assert_close(logits[j], alone[0], atol=atol, rtol=atol)
    alone = eng.runner.forward(eng.runner.pack(StepPlan((verify_work(eng, b, [], 1),))))
    torch.testing.assert_close(logits[-1], alone[0], atol=atol, rtol=atol)
    for s in (a, b):
        eng.kv.truncate(s.kv, s.kv.computed)  # the pages taken for the drafts go back
    assert eng.abort(req.request_id) and not eng.has_unfinished()
    eng.reset_prefix_cache()


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_a_tree_s_rows_are_its_paths_run_one_by_one(tiny_models, attention):
    """A real (tiny) model: the rotary positions by depth and the ancestors-only mask together. "auto"
    runs the C++ step-attention op a layer at a time, "torch" its twin."""
    llm = LLM(tiny_models["llama"], kv_cache_tokens=512, page_size=4, attention=attention)
    check_tree_rows_against_paths(llm.engine, list(range(1, 14)), 1e-4)
    llm.engine.kv.check([])


def test_a_tree_through_the_one_call_layer_stack(embedded_llm):
    """The embedded GGUF model runs every layer in one C++ call (``model/layer_stack.py``: rope, KV write
    and step attention inside): a tree's rows are its paths' there too. Its logits (up to 30) move by up to
    5e-3 with the batch they run in (an ordinary decode alone or batched alike); a token seeing a sibling
    instead of only its ancestors, or at the wrong position, moves them by 4 or more."""
    from hydragen.model.layer_stack import packed_stack

    eng = embedded_llm.engine
    assert packed_stack(eng.runner.model) is not None
    check_tree_rows_against_paths(eng, list(range(100, 140)), 2e-2)
