"""A randomized stateful test of the scheduler and KV manager, through the real engine with a fake model
(``fake_engine.py``): hypothesis drives arrivals (n > 1, shared and unaligned prefixes), speculative decoding
(drafts right up to a varying position, verified in the step, the rest cut back), forced appends to
one sample or to every sample of a request alike (the text may hold EOS), aborts, and injected faults: a
request whose forward fails, a fork whose KV copy fails, a step that raises before its commit (Ctrl-C, or
every request failing alone; then everything is aborted, as ``LLM.generate`` and the server do, or the
engine goes on), on page sizes 1, 4 and 16, pools from a few pages up and seat limits from 1.

After every step: every page is free, cached or held, and its refcount equals the page tables holding it;
every page in flight has exactly one live writer; every cached page continues a context some sequence
really had (no rejected or unverified draft is ever published); with sliding-window KV groups, each table
holds exactly its windows' pages of them, idle ones only beside cached pages, and no idle leaf is a dead
end; every plan's context was really in the pages it named,
its shared runs and cuts agree with the page tables, and the packed step's attention reads exactly each
token's context (checked by the fake runner at forward time); every running request makes progress within
a bounded number of steps. At the end: every request finished with exactly the tokens the fake model gives,
or with the error of a fault injected into it, and nothing leaked.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hydragen import SamplingParams
from hydragen.attention.layer_spec import AttentionSpec
from hydragen.dp.kv_events import to_wire
from hydragen.dp.router import ReplicaState
from hydragen.engine.sequence import Status
from hydragen.engine.step_plan import SharedRun, StepPlan, Work
from hydragen.kv.page_hash import page_hash
from tests.helpers.fake_engine import (
    EOS,
    VOCAB,
    PlanViolation,
    ScriptedProposer,
    all_tables,
    check_reads,
    expected_output,
    fake_engine,
)

BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [30, 31, 32, 33, 34, 35, 36],
]
STALL_LIMIT = 64  # steps a running request may go without computing anything
RUN = dict.fromkeys(
    [
        "examples", "steps", "preemptions", "forks", "forks of siblings forced alike", "failed fork copies",
        "raised steps", "forced appends", "forced appends to every sample", "aborts", "failed",
        "drafts verified", "drafts accepted", "drafts rejected",
    ],
    0,
)  # fmt: skip
INJECTED = ("injected forward failure", "injected copy failure", "injected step failure")


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4, 16, 1, 4]),  # small pages: more page boundaries per token
        pages=st.integers(3, 48),
        sharing=st.sampled_from([True, True, True, False]),
        min_shared_reads=st.sampled_from([0, 2048]),
        chunk=st.sampled_from([2, 4, 16, 512]),
        seats=st.sampled_from([1, 2, 3, 256]),
        kv_groups=st.sampled_from([(), (), (0, 1), (0, 1, 1), (0, 1, 2)]),  # a table page per KV group
        window=st.sampled_from([None, None, 1, 3, 6, 17]),  # groups 1..: sliding (their pages released)
        speculate=st.sampled_from([0, 0, 1, 3, 6]),  # drafts verified per decode (0: off)
    )
    def setup(
        self,
        page_size,
        pages,
        sharing,
        min_shared_reads,
        chunk,
        seats,
        kv_groups=(),
        window=None,
        speculate=0,
    ):
        specs = ()
        if kv_groups and window is not None:  # group 0 full; group g >= 1 slides over window * g tokens
            specs = [AttentionSpec(1.0, window=None if g == 0 else window * g) for g in kv_groups]
        self.window = window if specs else None
        self.engine = fake_engine(
            pages,
            page_size,
            sharing=sharing,
            min_shared_reads=min_shared_reads,
            prefill_chunk=chunk,
            prefill_budget=max(chunk, 8),
            max_wait_steps=8,
            max_num_seqs=seats,
            kv_groups=kv_groups,
            layer_specs=specs,
            speculative_config=(
                {"method": "ngram", "num_speculative_tokens": speculate, "cost_rule": False}
                if speculate
                else None
            ),
        )
        if speculate:  # drafts right up to a position that depends on the sequence and its length
            self.engine.scheduler.speculator.proposer = ScriptedProposer(
                lambda seq, k: (seq.seq_id * 7 + seq.context_len * 3) % (k + 2)
            )
        self.contexts: set[tuple[int, ...]] = set()  # every verified context seen (prefixes at page ends)
        self.mirror = ReplicaState(approx_capacity=1)  # a router's view, built from KV events alone
        self.engine.publish_kv_events(
            lambda events: [self.mirror.apply(e) for e in to_wire(events, page_size)]
        )
        self.requests = {}  # id -> (prompt, params, {seq index: {after: forced tokens}})
        self.outputs = {}
        self.stalled = {}
        self.steps = 0
        self.abort_after_raise = False

    # ---- rules -------------------------------------------------------------------------------------
    @rule(
        base=st.sampled_from(range(len(BASES))),
        cut=st.integers(0, 20),
        suffix=st.lists(st.integers(1, VOCAB - 1), max_size=12),
        n=st.integers(1, 4),
        max_tokens=st.integers(1, 24),
        ignore_eos=st.booleans(),
        settle=st.booleans(),
    )
    def add(self, base, cut, suffix, n, max_tokens, ignore_eos, settle):
        """A request; ``settle`` steps until each of its samples has a token (or a bound of steps), so that
        later rules find its samples decoding side by side."""
        prompt = BASES[base][:cut] + suffix
        if not prompt:
            prompt = [5]
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
        try:
            req = self.engine.add_request(prompt, params)
        except ValueError:
            return  # too big for this pool: refused up front, as it must be
        self.requests[req.request_id] = (prompt, params, [{} for _ in range(n)], req)
        for _ in range(32 if settle else 0):
            if all(s.generated or s.finished for s in req.seqs) or not self.engine.has_unfinished():
                break
            self.step(1)

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        """A few engine steps, every invariant checked after each."""
        for _ in range(steps):
            if not self.engine.has_unfinished():
                break
            self._step()
            self.pages_are_accounted_for()

    def _step(self):
        running = self.engine.scheduler.running
        before = {id(s): (s.kv.computed, len(s.generated)) for s in running}
        runner, injected = self.engine.runner, self.engine.runner.raise_next
        try:
            outs = self.engine.step()
        except (KeyboardInterrupt, RuntimeError) as e:
            if injected is None or (isinstance(e, RuntimeError) and "injected step failure" not in str(e)):
                raise
            runner.raise_next = None
            RUN["raised steps"] += 1
            self.stalled.clear()
            if self.abort_after_raise:  # what LLM.generate's loop and the server do with a raised step
                for rid in [r for r in self.requests if r in self.engine.requests]:
                    self.engine.abort(rid)
                    self.outputs[rid] = None
            return
        runner.raise_next = None  # "every request" with one request in the step: it failed alone
        for out in outs:
            self.outputs[out.request_id] = out
        self.steps += 1
        RUN["steps"] += 1
        plan = self.engine.last_plan
        RUN["forks"] += len(plan.forks)
        RUN["forks of siblings forced alike"] += sum(1 for f in plan.forks if id(f.seq) in before)
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

    def _forceable(self) -> list[tuple[str, list]]:
        """(request id, its samples that can take forced text now), for live requests that have some."""
        out = []
        for rid, (_, _, _, req) in self.requests.items():
            if rid in self.engine.requests:
                seqs = [s for s in req.seqs if not s.finished and s.generated]
                if seqs:
                    out.append((rid, seqs))
        return out

    @precondition(lambda self: self._forceable())
    @rule(
        data=st.data(),
        every_sample=st.booleans(),
        tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        then_preempt=st.booleans(),
    )
    def append_forced(self, data, every_sample, tokens, then_preempt):
        """Forced text (jump-forward, ``EngineCore.append_forced``; it may hold EOS) for one sample, or the
        same text for every sample of a request, as jump-forward through a grammar's fixed text does: the
        samples that share a context then follow the oldest one and fork from it. ``then_preempt``: pages
        run short right then, and the newest of those samples goes back to the queue (re-admitted with the
        text pending, it publishes the text's pages in flight)."""
        rid, seqs = data.draw(st.sampled_from(self._forceable()))
        _, params, forced, _ = self.requests[rid]
        if not every_sample:
            seqs = [data.draw(st.sampled_from(seqs))]
        for s in seqs:
            if len(s.generated) + len(tokens) < params.max_tokens:
                forced[s.index][len(s.generated)] = list(tokens)
                self.engine.append_forced(rid, s.index, tokens)
                RUN["forced appends"] += 1
        RUN["forced appends to every sample"] += every_sample and len(seqs) > 1
        running = [s for s in seqs if s.sched.status is Status.RUNNING]
        if then_preempt and running:
            self._preempt(max(running, key=lambda s: s.sched.admitted))

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        """Pages run short before the next step: the scheduler sends a running sequence back to the queue
        (its policy picks the newest; the mechanism must hold for any)."""
        self._preempt(data.draw(st.sampled_from(self.engine.scheduler.running)))

    def _preempt(self, s) -> None:
        self.engine.scheduler.preempt(s)
        self.engine.kv.flush_events()  # as the step that preempts it does at its end

    @rule(
        data=st.data(),
        fault=st.sampled_from(["forward", "fork copy", "interrupt", "every request"]),
        abort_after=st.booleans(),
    )
    def inject(self, data, fault, abort_after):
        """A fault: every forward that includes a running request raises from now on (one such request at a
        time); the next copy of a leader's partial page into a fork's page raises; the next step raises
        between its plan and its commit (Ctrl-C in the forward, or every request of the step failing
        alone: one request alone just fails), after which everything is aborted or the engine goes on."""
        runner = self.engine.runner
        if fault == "fork copy":
            runner.pool.fail_copies = 1
        elif fault == "forward":
            runner.fail_requests &= set(self.engine.requests)
            running = sorted({s.request.request_id for s in self.engine.scheduler.running})
            if running and not runner.fail_requests:
                runner.fail_requests.add(data.draw(st.sampled_from(running)))
        else:
            runner.raise_next, self.abort_after_raise = fault, abort_after

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def pages_are_accounted_for(self):
        if hasattr(self, "engine"):
            assert not self.engine.runner.violations, self.engine.runner.violations[0]
            self.engine.kv.check(all_tables(self.engine))
            tree = self.engine.tree
            for node in tree.nodes.values():
                parent = node.parent.hash if node.parent is not tree.root else None
                assert node.hash == page_hash(parent, node.tokens)
            assert self.mirror.cached == {node.hash for node in tree.nodes.values()}, (
                "KV events lost a change"
            )
            self.nothing_unverified_is_published()

    def nothing_unverified_is_published(self):
        """Every cached page continues a prefix some sequence really had (prompt and appended tokens): a
        draft that verification rejected, or one not verified yet, never reaches the prefix tree."""
        ps = self.engine.kv.page_size
        for _, _, _, req in self.requests.values():
            for s in req.seqs:
                context = s.context
                self.contexts.update(tuple(context[:end]) for end in range(ps, len(context) + 1, ps))
        tree = self.engine.tree
        for node in tree.nodes.values():
            chain, n = [], node
            while n is not tree.root:
                chain[:0] = n.tokens
                n = n.parent
            assert tuple(chain) in self.contexts, "a page the prefix tree holds is not a verified context"

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        eng = self.engine
        eng.runner.fail_requests.clear()
        eng.runner.raise_next = None
        eng.runner.pool.fail_copies = 0
        # Enough steps for every sequence to run alone (a seat limit of 1 runs them one at a time), with
        # every token a step of its own: more means a request never finished.
        bound = 100 + sum(p.n * (len(prompt) + p.max_tokens) for prompt, p, _, _ in self.requests.values())
        for _ in range(bound):
            if not eng.has_unfinished():
                break
            for out in eng.step():
                self.outputs[out.request_id] = out
            RUN["steps"] += 1
            assert not eng.runner.violations, eng.runner.violations[0]
        assert not eng.has_unfinished(), "requests never finished"
        RUN["examples"] += 1
        RUN["preemptions"] += eng.stats.preemptions
        RUN["failed fork copies"] += eng.runner.pool.failed_copies
        if eng.scheduler.speculator is not None:
            m = eng.scheduler.speculator.metrics
            RUN["drafts verified"] += m.drafts
            RUN["drafts accepted"] += m.accepted_tokens
            RUN["drafts rejected"] += m.draft_tokens - m.accepted_tokens
        eng.kv.check([])
        usage = eng.kv_usage()
        assert usage["used"] == usage["cached"], usage
        for rid, (prompt, params, forced, _) in self.requests.items():
            out = self.outputs.get(rid)
            if out is None:
                continue  # aborted, or refused
            if out.error:
                assert any(why in out.error for why in INJECTED), out.error
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
    decode = Work(s, tuple(s.kv.pages), s.kv.computed, (s.generated[-1],), 1)
    eng.runner.forward(StepPlan((decode,)))  # intact: fine
    eng.runner.pool.content[s.kv.pages[0] * 4] = None  # the KV of position 0 is gone
    with pytest.raises(PlanViolation, match="reads position 0"):
        eng.runner.forward(StepPlan((decode,)))


def test_shared_runs_and_reads_that_disagree_with_the_tables_are_caught():
    """The fake runner's checks of what a step reads: a shared run over pages one of its items does not hold,
    a cut its runs do not cover, and a packing that reads a slot twice are each a violation."""
    eng = fake_engine(16, 4)
    eng.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(n=2, max_tokens=4, temperature=0))
    eng.step()
    eng.step()
    a, b = eng.scheduler.running
    work = tuple(Work(s, tuple(s.kv.pages), s.kv.computed, (s.generated[-1],), 1) for s in (a, b))
    assert a.kv.pages[:2] == b.kv.pages[:2] and a.kv.pages[2] != b.kv.pages[2]
    eng.runner.forward(StepPlan(work, (), (SharedRun(0, 2, 0, 2),), (2, 2)))  # what they share: fine
    for shared, cuts, why in [
        ((SharedRun(0, 3, 0, 2),), (3, 3), "does not hold"),  # page 2 differs
        ((SharedRun(0, 2, 0, 2),), (2, 1), "cut 1"),
        ((SharedRun(0, 2, 0, 2), SharedRun(1, 2, 0, 2)), (2, 2), "gap or overlap"),
    ]:
        with pytest.raises(PlanViolation, match=why):
            eng.runner.forward(StepPlan(work, (), shared, cuts))
    with pytest.raises(PlanViolation, match="instead of its context"):  # the packed step's own check
        check_reads(StepPlan(work, (), (), (2, 2)), 4)  # cuts without runs: pages 0-1 are never read


def test_the_random_run_was_long():
    """Runs after the state machine (file order): it covered thousands of engine steps, with preemptions
    and forks among them."""
    print(f"\nstateful run: {RUN}")
    assert RUN["examples"] >= 100 and RUN["steps"] >= 2000, RUN
    assert all(RUN.values()), RUN


class _Draws:
    """Stands for hypothesis' ``data()`` when a found case is replayed: each draw is the next value."""

    def __init__(self, machine: EngineMachine, *values):
        self.machine, self.values = machine, list(values)

    def draw(self, _strategy):
        value = self.values.pop(0)
        if isinstance(value, tuple):  # (request id, sample index): that request's live samples, then that one
            rid, index = value
            self.values.insert(0, self.machine.requests[rid][3].seqs[index])
            return rid, [s for s in self.machine.requests[rid][3].seqs if not s.finished and s.generated]
        return value


def test_found_a_failed_request_whose_sample_was_sent_back_to_the_queue():
    """A case a random run found (shrunk by hypothesis): request 6 (n = 2) fails while one sample waits on
    pages the other is computing. Releasing the leader preempted the follower into the queue, where it was
    admitted again and ran forever for a request that had ended."""
    m = EngineMachine()
    m.setup(sharing=True, pages=36, page_size=1, min_shared_reads=2048, chunk=4, seats=256)
    m.add(settle=False, base=1, cut=19, ignore_eos=False, max_tokens=1, n=1, suffix=[1, 1])
    m.step(steps=3)
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.add(settle=False, base=0, cut=13, ignore_eos=False, max_tokens=2, n=1, suffix=[1, 1, 1, 1, 1, 1, 1, 4])
    m.step(steps=4)
    m.add(settle=False, base=0, cut=15, ignore_eos=True, max_tokens=13, n=3, suffix=[1, 1, 1, 1, 2])
    m.step(steps=2)
    m.inject(_Draws(m, "2"), fault="forward", abort_after=False)
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=3, n=1, suffix=[2, 6, 1, 1, 1])
    m.step(steps=3)
    m.inject(_Draws(m, "4"), fault="forward", abort_after=False)
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.append_forced(_Draws(m, ("3", 0)), every_sample=False, then_preempt=False, tokens=[1, 1, 1, 1, 1, 1])
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=3, n=2, suffix=[1, 1, 1, 6])
    m.step(steps=2)
    m.inject(_Draws(m, "6"), fault="forward", abort_after=False)
    m.append_forced(_Draws(m, ("3", 0)), every_sample=False, then_preempt=False, tokens=[1])
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.add(settle=False, base=0, cut=0, ignore_eos=False, max_tokens=1, n=1, suffix=[])
    m.step(steps=2)
    m.teardown()  # every request finished, with the fake model's tokens, and no page leaked
    assert m.outputs["6"].error and all(s.sched.status.value == "done" for s in m.requests["6"][3].seqs)


def test_found_a_fork_that_dropped_pages_in_flight():
    """A case a seeded random walk of these rules found: both samples of a request are forced through the
    same text and the newer one goes back to the queue. Re-admitted, it publishes the text's pages in flight
    and computes them a chunk at a time beside its sibling; once both stand at the same position, it used to
    follow the sibling and fork from it, which dropped its pages in flight with no writer left. Another
    request through that text then held them and waited for good. Now a sample writing pages in flight
    computes its own text, and every page in flight keeps exactly one writer."""
    m = EngineMachine()
    m.setup(sharing=True, pages=64, page_size=1, min_shared_reads=2048, chunk=4, seats=256)
    m.add(settle=True, base=0, cut=3, ignore_eos=True, max_tokens=20, n=2, suffix=[])
    m.append_forced(_Draws(m, ("0", 0)), every_sample=True, then_preempt=True, tokens=[5, 6, 7, 8, 9, 10])
    m.step(steps=2)
    through_the_text = m.requests["0"][3].seqs[0].context[:10] + [11]
    m.add(settle=False, base=0, cut=0, ignore_eos=True, max_tokens=3, n=1, suffix=through_the_text)
    m.step(steps=6)
    m.teardown()  # the later request finished, with the fake model's tokens
    assert m.outputs["1"].outputs[0].finish_reason == "length"
