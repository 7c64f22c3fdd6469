"""A randomized stateful test of the scheduler and KV manager, through the real engine with a fake model
(``fake_engine.py``): hypothesis drives arrivals (n > 1, shared and unaligned prefixes), forced extends,
aborts and injected forward failures, on page sizes 1, 4 and 16 and pools from a few pages up.

After every step: every page is free, cached or held, and its refcount equals the page tables holding it;
every plan's context was really in the pages it named (checked by the fake runner at forward time); every
running request makes progress within a bounded number of steps. At the end: every request finished with
exactly the tokens the fake model gives, and nothing leaked.
"""

from __future__ import annotations

import os

import pytest
from fake_engine import EOS, VOCAB, PlanViolation, all_tables, expected_output, fake_engine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hydragen import SamplingParams
from hydragen.dp.kv_events import to_wire
from hydragen.dp.router import ReplicaState
from hydragen.engine.step_plan import StepPlan, Work
from hydragen.kv.page_hash import page_hash

BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [30, 31, 32, 33, 34, 35, 36],
]
STALL_LIMIT = 64  # steps a running request may go without computing anything
RUN = dict.fromkeys(["examples", "steps", "preemptions", "forks", "extends", "aborts", "failed"], 0)


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        pages=st.integers(3, 48),
        sharing=st.booleans(),
        min_shared_reads=st.sampled_from([0, 2048]),
        chunk=st.sampled_from([4, 16, 512]),
    )
    def setup(self, page_size, pages, sharing, min_shared_reads, chunk):
        self.engine = fake_engine(
            pages,
            page_size,
            sharing=sharing,
            min_shared_reads=min_shared_reads,
            prefill_chunk=chunk,
            prefill_budget=max(chunk, 8),
            max_wait_steps=8,
        )
        self.mirror = ReplicaState(approx_capacity=1)  # a router's view, built from KV events alone
        self.engine.publish_kv_events(
            lambda events: [self.mirror.apply(e) for e in to_wire(events, page_size)]
        )
        self.requests = {}  # id -> (prompt, params, {seq index: {after: forced tokens}})
        self.outputs = {}
        self.stalled = {}
        self.steps = 0

    # ---- rules -------------------------------------------------------------------------------------
    @rule(
        base=st.sampled_from(range(len(BASES))),
        cut=st.integers(0, 20),
        suffix=st.lists(st.integers(1, VOCAB - 1), max_size=12),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 24),
        ignore_eos=st.booleans(),
    )
    def add(self, base, cut, suffix, n, max_tokens, ignore_eos):
        prompt = BASES[base][:cut] + suffix
        if not prompt:
            prompt = [5]
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
        try:
            req = self.engine.add_request(prompt, params)
        except ValueError:
            return  # too big for this pool: refused up front, as it must be
        self.requests[req.request_id] = (prompt, params, [{} for _ in range(n)], req)

    @precondition(lambda self: self.engine.has_unfinished())
    @rule()
    def step(self):
        before = {id(s): (s.kv.computed, len(s.generated)) for s in self.engine.scheduler.running}
        for out in self.engine.step():
            self.outputs[out.request_id] = out
        self.steps += 1
        RUN["steps"] += 1
        plan = self.engine.last_plan
        RUN["forks"] += len(plan.forks)
        moved = {id(w.seq) for w in plan.work} | {id(f.seq) for f in plan.forks}
        for s in self.engine.scheduler.running:
            if id(s) in moved or before.get(id(s)) != (s.kv.computed, len(s.generated)):
                self.stalled.pop(id(s), None)
            else:
                self.stalled[id(s)] = self.stalled.get(id(s), 0) + 1
                assert self.stalled[id(s)] < STALL_LIMIT, "a running sequence stopped making progress"

    @rule(data=st.data())
    def abort(self, data):
        live = [rid for rid in self.requests if rid not in self.outputs and rid in self.engine.requests]
        if live:
            rid = data.draw(st.sampled_from(live))
            self.engine.abort(rid)
            self.outputs[rid] = None
            RUN["aborts"] += 1

    @rule(data=st.data(), tokens=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20))
    def extend(self, data, tokens):
        cands = [
            (rid, s)
            for rid, (_, params, _, req) in self.requests.items()
            if rid in self.engine.requests
            for s in req.seqs
            if not s.finished and s.generated and len(s.generated) + len(tokens) < params.max_tokens
        ]
        if not cands:
            return
        rid, s = data.draw(st.sampled_from(cands))
        forced = self.requests[rid][2][s.index]
        forced[len(s.generated)] = list(tokens)
        self.engine.extend(rid, s.index, tokens)
        RUN["extends"] += 1

    @rule(data=st.data())
    def fail_a_forward(self, data):
        """Every forward that includes this request raises from now on (one such request at a time)."""
        injected = self.engine.runner.fail_requests
        injected &= set(self.engine.requests)
        running = sorted({s.request.request_id for s in self.engine.scheduler.running})
        if running and not injected:
            injected.add(data.draw(st.sampled_from(running)))

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def pages_are_accounted_for(self):
        if hasattr(self, "engine"):
            assert not self.engine.runner.violations, self.engine.runner.violations[0]
            self.engine.kv.check(all_tables(self.engine))
            tree = self.engine.tree
            for node in tree.nodes.values():
                parent = node.parent.hash if node.parent is not tree.root else None
                assert node.hash == page_hash(parent, node.key)
            assert self.mirror.cached == {node.hash for node in tree.nodes.values()}, (
                "KV events lost a change"
            )

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        eng = self.engine
        eng.runner.fail_requests.clear()
        for _ in range(2000):
            if not eng.has_unfinished():
                break
            for out in eng.step():
                self.outputs[out.request_id] = out
            RUN["steps"] += 1
            assert not eng.runner.violations, eng.runner.violations[0]
        assert not eng.has_unfinished(), "requests never finished"
        RUN["examples"] += 1
        RUN["preemptions"] += eng.stats.preemptions
        eng.kv.check([])
        usage = eng.kv_usage()
        assert usage["used"] == usage["cached"], usage
        for rid, (prompt, params, forced, _) in self.requests.items():
            out = self.outputs.get(rid)
            if out is None:
                continue  # aborted, or refused
            if out.error:
                assert "injected forward failure" in out.error, out.error
                RUN["failed"] += 1
                continue
            for c in out.outputs:
                want = expected_output(prompt, forced[c.index], params.max_tokens, params.ignore_eos)
                assert c.token_ids == want, (rid, c.index, c.token_ids, want)
                assert c.finish_reason == ("stop" if want[-1] == EOS and not params.ignore_eos else "length")


EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HYDRAGEN_STATEFUL_EXAMPLES", "400")),  # a soak run raises it
    # The same examples every run (CI stays reproducible); a soak run sets HYDRAGEN_STATEFUL_RANDOM=1 to
    # explore new ones. Each failure found that way is kept below as a fixed case.
    derandomize=not os.environ.get("HYDRAGEN_STATEFUL_RANDOM"),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_and_kv_manager = EngineMachine.TestCase


def test_plan_violations_are_caught():
    """The fake runner checks for real: a plan reading a slot whose KV is gone fails at forward time."""
    eng = fake_engine(8, 4)
    eng.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0))
    eng.step()
    (s,) = eng.scheduler.running
    decode = Work(s, tuple(s.kv.pages), s.kv.computed, (s.generated[-1],), True)
    eng.runner.forward(StepPlan((decode,)))  # intact: fine
    eng.runner.pool.content[s.kv.pages[0] * 4] = None  # the KV of position 0 is gone
    with pytest.raises(PlanViolation, match="reads position 0"):
        eng.runner.forward(StepPlan((decode,)))


def test_the_random_run_was_long():
    """Runs after the state machine (file order): it covered thousands of engine steps, with preemptions
    and forks among them."""
    print(f"\nstateful run: {RUN}")
    assert RUN["examples"] >= 100 and RUN["steps"] >= 2000, RUN
    assert all(RUN[k] > 0 for k in ("preemptions", "forks", "extends", "aborts", "failed")), RUN


class _Draws:
    """Stands for hypothesis' ``data()`` when a found case is replayed: each draw is the next value."""

    def __init__(self, machine: EngineMachine, *values):
        self.machine, self.values = machine, list(values)

    def draw(self, _strategy):
        value = self.values.pop(0)
        if isinstance(value, tuple):  # (request id, sample index): that sequence
            return value[0], self.machine.requests[value[0]][3].seqs[value[1]]
        return value


def test_found_a_failed_request_whose_sample_was_sent_back_to_the_queue():
    """A case a random run found (shrunk by hypothesis): request 6 (n = 2) fails while one sample waits on
    pages the other is computing. Releasing the leader preempted the follower into the queue, where it was
    admitted again and ran forever for a request that had ended."""
    m = EngineMachine()
    m.setup(sharing=True, pages=36, page_size=1, min_shared_reads=2048, chunk=4)
    m.add(base=1, cut=19, ignore_eos=False, max_tokens=1, n=1, suffix=[1, 1])
    for _ in range(3):
        m.step()
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.add(base=0, cut=13, ignore_eos=False, max_tokens=2, n=1, suffix=[1, 1, 1, 1, 1, 1, 1, 4])
    for _ in range(4):
        m.step()
    m.add(base=0, cut=15, ignore_eos=True, max_tokens=13, n=3, suffix=[1, 1, 1, 1, 2])
    m.step()
    m.step()
    m.fail_a_forward(_Draws(m, "2"))
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=3, n=1, suffix=[2, 6, 1, 1, 1])
    for _ in range(3):
        m.step()
    m.fail_a_forward(_Draws(m, "4"))
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.extend(_Draws(m, ("3", 0)), tokens=[1, 1, 1, 1, 1, 1])
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=3, n=2, suffix=[1, 1, 1, 6])
    m.step()
    m.step()
    m.fail_a_forward(_Draws(m, "6"))
    m.extend(_Draws(m, ("3", 0)), tokens=[1])
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.add(base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.step()
    m.step()
    m.teardown()  # every request finished, with the fake model's tokens, and no page leaked
    assert m.outputs["6"].error and all(s.sched.status.value == "done" for s in m.requests["6"][3].seqs)
