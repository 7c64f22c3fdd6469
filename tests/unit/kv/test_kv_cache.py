"""The KV manager's contract: the scheduler uses only its calls, the prefix tree is keyed by chained page
hashes and checked against its tokens, hashes are computed once per sequence, salts keep tenants apart,
nodes have a location, and a table can be truncated back to a computed length.

All through the fake engine (``tests/helpers/fake_engine.py``): its model's output is known in advance,
and its runner checks that every work item's context is really in the pages the plan names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import hydragen.kv.manager as manager_module
from hydragen import SamplingParams
from hydragen.kv.manager import PageTable
from hydragen.kv.page_hash import chain_root, page_hash, page_hashes
from hydragen.kv.radix import Location
from tests.helpers.fake_engine import all_tables, expected_output, fake_engine, run

GREEDY = dict(temperature=0, ignore_eos=True)

# What the scheduler may call on its KV manager (the contract in kv/manager.py's docstring).
CONTRACT = {
    "page_size", "capacity", "pages_for", "cached_pages", "admit", "allocate", "ready", "computed_to",
    "publish", "truncate", "reserve", "give_back", "fork", "in_flight", "dependents", "release",
}  # fmt: skip


class ContractOnly:
    """The KV manager as the scheduler may see it: any other attribute (the pool, the tree) raises."""

    def __init__(self, kv):
        self._kv = kv

    def __getattr__(self, name):
        if name not in CONTRACT:
            raise AssertionError(f"the scheduler reached past the KV manager's contract: kv.{name}")
        return getattr(self._kv, name)


def check_outputs(reqs, max_tokens: int) -> None:
    for r in reqs:
        for s in r.seqs:
            assert s.generated == expected_output(r.prompt_ids, {}, max_tokens, True), r.request_id


def test_the_scheduler_uses_only_the_contract():
    """A workload with sharing, sibling forks, preemption and eviction (a small cache) runs with the
    scheduler seeing nothing of the KV manager but its contract."""
    eng = fake_engine(pages=24, page_size=4)
    eng.scheduler.kv = ContractOnly(eng.kv)
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    reqs = [
        eng.add_request(base + [20 + i] * (i % 3), SamplingParams(n=3, max_tokens=9, **GREEDY))
        for i in range(6)
    ]
    run(eng)
    check_outputs(reqs, 9)
    assert eng.scheduler.preemptions > 0  # the small cache made it preempt
    eng.kv.check([])


def test_the_tree_is_keyed_by_the_chained_page_hash():
    """Every node's key is the hash of its tokens chained with its parent's: the identity KV events and the
    router use."""
    eng = fake_engine(pages=64, page_size=4)
    prompt = list(range(1, 19))
    run_one(eng, prompt, 3)
    nodes = sorted(eng.kv.tree.nodes.values(), key=lambda n: n.depth)
    assert [n.hash for n in nodes] == page_hashes(prompt + nodes_tail(eng, prompt), 4)[: len(nodes)]
    for n in nodes:
        assert n.parent.children[n.hash] is n and n.location is Location.POOL
        assert n.hash == page_hash(n.parent.hash if n.depth else None, n.tokens)


def run_one(eng, prompt, max_tokens):
    req = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    run(eng)
    return req


def nodes_tail(eng, prompt) -> list[int]:
    """The generated tokens of the one request that ran (its computed ones are cached too)."""
    return expected_output(prompt, {}, 3, True)


def test_a_hash_collision_never_shares_another_prompts_kv(monkeypatch):
    """With a hash so weak that every page at one depth collides, different prompts must not meet: each
    computes its own KV (the fake runner checks every slot it reads), outputs stay exact, and equal
    prompts still share."""
    ps = 4

    def weak_hashes(tokens, page_size, *, salt=None, parent=None, start=0):
        return list(range(start, len(tokens) // page_size))  # the page's depth: collides across prompts

    monkeypatch.setattr(manager_module, "page_hashes", weak_hashes)
    eng = fake_engine(pages=64, page_size=ps)
    a = run_one(eng, list(range(1, 14)), 4)
    b = run_one(eng, list(range(21, 34)), 4)  # same hashes as a's pages, other tokens
    assert b.cached_tokens == 0
    c = run_one(eng, list(range(1, 14)), 4)  # a's prompt again: a real hit
    assert c.cached_tokens == 12
    check_outputs([a, b, c], 4)
    assert not eng.runner.violations
    eng.kv.check([])


def test_hashes_are_computed_once_per_sequence(monkeypatch):
    """A request that waits many steps for pages is matched every step, from its cached hashes: each of
    its pages is hashed once."""
    calls, matches = [], []
    real = manager_module.page_hashes

    def counting(tokens, page_size, **kw):
        out = real(tokens, page_size, **kw)
        calls.append(len(out))
        return out

    monkeypatch.setattr(manager_module, "page_hashes", counting)
    eng = fake_engine(pages=12, page_size=4)
    real_match = eng.kv.tree.match
    eng.kv.tree.match = lambda tokens, hashes: matches.append(len(tokens)) or real_match(tokens, hashes)
    first = eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=20, **GREEDY))
    eng.step()
    waiting = eng.add_request(
        list(range(10, 44)) + list(range(10, 20)), SamplingParams(max_tokens=2, **GREEDY)
    )
    # 11 pages of its own: it waits until first is done
    run(eng)
    check_outputs([first], 20)
    check_outputs([waiting], 2)
    assert sum(1 for n in matches if n == 44) > 20  # matched at every step it waited
    # first: 6 full pages of its 28-token context (27 computed); waiting: 11 of its 46 (45 computed).
    assert sum(calls) == 6 + 11, calls


def test_a_cache_salt_keeps_tenants_apart():
    """Requests share cached pages only with requests of the same salt; the salt seeds the hash chain, so
    a router that knows a tenant's salt computes the same hashes as the cache."""
    eng = fake_engine(pages=64, page_size=4)
    prompt = list(range(1, 18))
    eng.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-a")
    run(eng)
    other = eng.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-b")
    unsalted = eng.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY))
    run(eng)
    assert other.cached_tokens == 0 and unsalted.cached_tokens == 0
    same = eng.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-a")
    run(eng)
    assert same.cached_tokens == 16
    firsts = {n.hash for n in eng.kv.tree.root.children.values()}
    assert firsts == {page_hashes(prompt, 4, salt=s)[0] for s in ("tenant-a", "tenant-b", None)}
    assert chain_root(None) is None and chain_root("tenant-a") != chain_root("tenant-b")
    check_outputs([other, unsalted, same], 2)


def test_a_node_outside_the_pool_ends_a_match():
    """A node whose KV is not in the pool (a later tier's) is found by the tree, and the KV manager matches
    only the part of the prefix it can use from the pool."""
    eng = fake_engine(pages=64, page_size=4)
    prompt = list(range(1, 30))
    run_one(eng, prompt, 1)
    table = PageTable()
    assert eng.kv.cached_pages(table, prompt) == 7
    third = next(n for n in eng.kv.tree.nodes.values() if n.depth == 2)
    elsewhere = SimpleNamespace(name="elsewhere")  # a location a later tier adds
    eng.kv.tree.relocate(third, elsewhere)
    assert eng.kv.cached_pages(table, prompt) == 2
    eng.kv.tree.relocate(third, Location.POOL)
    assert eng.kv.cached_pages(table, prompt) == 7 and eng.kv.tree.outside_pool == 0


def test_truncate_rolls_a_table_back_to_a_computed_length():
    """Rejected drafts: a table computed past its context goes back to its verified length, releasing the
    pages wholly past it; what it published (verified context) cannot be rolled back."""
    eng = fake_engine(pages=64, page_size=4)
    req = eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        eng.step()
    t = req.seqs[0].kv
    before = eng.kv.usage()["used"]
    assert eng.kv.allocate(t, t.computed + 9)  # room for 9 drafted positions
    eng.kv.computed_to(t, t.computed + 9)  # a forward wrote them (none published: they are not context)
    assert eng.kv.usage()["used"] > before
    verified = req.seqs[0].context_len - 1
    eng.kv.truncate(t, verified)
    assert t.computed == verified and len(t.pages) == eng.kv.pages_for(verified)
    assert eng.kv.usage()["used"] == before
    eng.kv.check(all_tables(eng))
    with pytest.raises(ValueError, match="cannot truncate"):
        eng.kv.truncate(t, 3)  # below its published pages
    run(eng)
    check_outputs([req], 30)
    eng.kv.check([])
