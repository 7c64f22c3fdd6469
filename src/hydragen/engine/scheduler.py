"""The scheduler: who waits, who runs, what each running sequence computes this step, who is preempted.

Every step it builds one frozen :class:`StepPlan`:

1. **running sequences, oldest first**, each get their next tokens: a prefill chunk (at most
   ``prefill_chunk``, within the step's ``prefill_budget``), one decode token, or a decode token and the
   forced tokens appended after it (jump-forward), with the pages those positions need. When pages run
   short, idle cached pages are evicted, then the newest running sequence is preempted (its computed pages
   stay cached; it resumes from them), so the oldest one always makes progress;
2. **siblings with one context**: the other samples of a request whose prompt ends this step, and samples
   forced through the same text, do not compute it again: they sample from the leader's logits and take
   its KV after the forward (``Fork``);
3. **waiting sequences are admitted** (aged ones first, then the longest cached prefix first) while seats
   and pages last: the pages of their whole context are taken at admission, exactly as they will be laid
   out (cached full pages shared, the rest their own), so admission never over-promises;
4. with speculative decoding on, decoding sequences take the drafts the speculator proposes and its cost
   rule keeps (``spec/``), verified in this step's forward;
5. the work is put in depth-first order and the cost rule picks the shared runs (``sharing.py``).

After the forward, ``update`` records what was computed (the KV of rejected drafts is cut back), publishes
full pages to the prefix tree and carries out the forks.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from hydragen.engine.isolation import failure_message
from hydragen.engine.sequence import Request, SequenceState, Status
from hydragen.engine.sharing import DEFAULT_MIN_SHARED_READS, order, plan_sharing
from hydragen.engine.step_plan import Admission, Fork, StepPlan, StepResult, Work
from hydragen.errors import CannotFit
from hydragen.kv.manager import KVManager
from hydragen.kv.pool import OutOfPages
from hydragen.spec.speculator import Speculator

LPM_WINDOW = 128  # waiting sequences ranked by cached prefix per step (beyond it, arrival order)


@dataclass(frozen=True)
class Sharing:
    """What sequences may share. ``enabled=False`` is the no-sharing baseline (every sequence its own pages,
    nothing cached between requests); ``limit`` shares only pages below that many tokens (the benchmarks'
    one-level ablation)."""

    enabled: bool = True
    limit: int | None = None

    def max_pages(self, page_size: int) -> int | None:
        if not self.enabled:
            return 0
        return None if self.limit is None else self.limit // page_size


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        sharing: Sharing = Sharing(),
        *,
        max_num_seqs: int = 256,
        prefill_chunk: int = 512,
        prefill_budget: int = 2048,
        max_wait_steps: int = 64,
        min_shared_reads: int = DEFAULT_MIN_SHARED_READS,
        speculator: Speculator | None = None,
        max_context: int | None = None,
    ):
        """``speculator``: drafts for decoding sequences, verified in the step (None: off); ``max_context``:
        the model's context length (drafts never reach past it)."""
        self.kv, self.sharing = kv, sharing
        self.speculator, self.max_context = speculator, max_context
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.max_wait_steps = max_wait_steps
        self.min_shared_reads = min_shared_reads
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # admission order
        self.step_count = 0
        self.preemptions = 0
        self._admissions = itertools.count()
        # What the step being planned admitted, preempted and failed (handed out in its plan).
        self._admitted: list[Admission] = []
        self._preempted: list[SequenceState] = []
        self._failed: list[tuple[Request, str]] = []
        # Forks planned and not carried out yet: their reserved pages belong to the scheduler until commit
        # hands them to the fork's table, or ``abandon`` gives them back (a step that raised before commit).
        self._open_forks: dict[Fork, None] = {}

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    # ---- queues -------------------------------------------------------------------------------------
    def add(self, seqs: list[SequenceState]) -> None:
        for s in seqs:
            s.sched.arrival_step = self.step_count
        self.waiting.extend(seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seqs: list[SequenceState]) -> None:
        """Take sequences out for good (finished, failed or aborted); their pages are released, computed
        full pages kept in the prefix cache."""
        gone = {s.seq_id for s in seqs}
        held = [s for s in seqs if s.sched.status is Status.RUNNING]
        for s in seqs:  # done before any release: a release preempts the running sequences that wait on it,
            s.sched.status = Status.DONE  # and must not send one of these back to the queue
        self.running = [s for s in self.running if s.seq_id not in gone]
        if any(s.seq_id in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s.seq_id not in gone)
        for s in sorted(held, key=lambda s: -s.sched.admitted):  # newest first: one that waits on pages
            self._release(s)  # another of them computes is admitted after it and lets go of them first
        if self.speculator is not None:
            self.speculator.forget(list(gone))

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's frozen plan: its work, forks and shared runs, and who was admitted, preempted
        or failed while it was made (a failed request's sequences are out of the queues already)."""
        self.step_count += 1
        self._admitted, self._preempted, self._failed = [], [], []
        self._budget = self.prefill_budget
        work: list[Work] = []
        forks: list[Fork] = []
        followers = self._sibling_forced_appends()
        for s in list(self.running):  # oldest first; the loop may preempt newer ones
            if s.sched.status is not Status.RUNNING or s.seq_id in followers:
                continue
            w = self._secure(s, lambda s=s: self._work(s))
            if w is not None:
                work.append(w)
        for leader, group in self._group_followers(followers, work):
            forks += self._forks(leader, group)
        self._admit(work, forks)
        live = lambda s: s.sched.status is Status.RUNNING  # noqa: E731  (a failure may have ended some)
        work = [w for w in work if live(w.seq)]
        if self.speculator is not None:
            work = self._speculate(work, {f.leader.seq_id for f in forks})
        self.abandon([f for f in forks if not (live(f.seq) and live(f.leader))])
        forks = [f for f in forks if live(f.seq) and live(f.leader)]
        ordered = order(work, self.page_size)
        shared, cuts = (
            plan_sharing(ordered, self.page_size, self.min_shared_reads) if self.sharing.enabled else ([], [])
        )
        return StepPlan(
            tuple(ordered), tuple(forks), tuple(shared), tuple(cuts or [0] * len(ordered)),
            tuple(self._admitted), tuple(self._preempted), tuple(self._failed),
        )  # fmt: skip

    def update(self, result: StepResult) -> list[tuple[Request, str]]:
        """After the forward: the plan that ran is computed; forks take their leader's KV; full pages are
        published; the forks of requests that failed running give back their pages. Returns the requests
        whose fork could not copy its leader's KV (they fail alone)."""
        self.abandon(list(result.dropped_forks))
        plan, kv = result.plan, self.kv
        for w in plan.work:
            if not w.verifies:
                kv.computed_to(w.seq.kv, w.end)
        if any(w.verifies for w in plan.work):
            self._settle_drafts(result)
        failed = []
        for f in plan.forks:
            self._open_forks.pop(f, None)
            try:
                kv.fork(f.seq.kv, f.leader.kv, f.leader.kv.computed, f.shared_pages, list(f.reserved))
            except Exception as e:  # noqa: BLE001  the forked sequence's request fails alone
                kv.give_back([p for p in f.reserved if p not in f.seq.kv.pages])
                failed.append((f.seq.request, failure_message("fork", e)))
                self.remove(f.seq.request.seqs)
        if self.sharing.enabled:
            limit = self.sharing.max_pages(self.page_size)
            for w in plan.work:
                self._publish(w.seq, limit)
            for f in plan.forks:
                if f.seq.sched.status is Status.RUNNING:
                    self._publish(f.seq, limit)
        return failed

    # ---- work for running sequences ------------------------------------------------------------------
    def _work(self, s: SequenceState) -> Work | None:
        """The tokens ``s`` computes this step and the pages for them (raises OutOfPages)."""
        t, kv = s.kv, self.kv
        if not kv.ready(t):
            return None  # its next page is being computed by another sequence
        start, context_len = t.computed, s.context_len
        pending = context_len - start
        if pending <= 0:
            return None
        decoding = bool(s.generated) and start >= len(s.prompt_ids)
        if pending == 1 or (decoding and pending <= self.prefill_chunk):
            k = pending  # a decode token, and any forced tokens appended after it
        else:
            k = min(pending, self.prefill_chunk, self._budget)
            if k <= 0:
                return None
        if not kv.allocate(t, start + k):
            raise OutOfPages(f"no KV pages for {s.request.request_id}'s next {k} tokens")
        if k != pending or not decoding:
            self._budget -= k
        return Work(
            s, tuple(t.pages[: kv.pages_for(start + k)]), start, tuple(s.tokens(start, start + k)),
            1 if start + k == context_len else 0,
        )  # fmt: skip

    # ---- speculative decoding ------------------------------------------------------------------------
    def _speculate(self, work: list[Work], leaders: set[int]) -> list[Work]:
        """Decode items grow by the drafts the speculator proposes and its cost rule keeps, each with its
        logits row, on pages taken now; a sequence whose draft pages are not free decodes as ever (drafts
        never preempt anyone). A fork's leader (``leaders``) does not speculate: its followers take exactly
        the KV it has now."""
        picks = [
            i for i, w in enumerate(work)
            if w.logit_rows == 1 and len(w.tokens) == 1 and w.seq.generated and w.seq.grammar is None
            and w.end == w.seq.context_len and w.start >= len(w.seq.prompt_ids)
            and w.seq.seq_id not in leaders
        ]  # fmt: skip
        if not picks:
            return work
        seqs = [work[i].seq for i in picks]
        context = self.max_context or 1 << 62
        room = [min(s.params.max_tokens - len(s.generated), context - s.context_len) - 1 for s in seqs]
        rows = sum(len(w.tokens) for w in work)
        drafts = self.speculator.propose(seqs, room, rows)
        kv = self.kv
        for i, d in zip(picks, drafts, strict=True):
            if not d:
                continue
            w = work[i]
            t = w.seq.kv
            end = w.end + len(d)
            if kv.allocate(t, end):
                work[i] = Work(
                    w.seq, tuple(t.pages[: kv.pages_for(end)]), w.start, (*w.tokens, *d), 1 + len(d)
                )
        return work

    def _settle_drafts(self, result: StepResult) -> None:
        """After a verification: the KV of the accepted drafts stays, the rest is cut back (its pages go
        back); the speculator learns what each verification accepted."""
        kv = self.kv
        taken = {s.seq_id: len(run) for s, run in zip(result.samplers, result.tokens, strict=True)}
        outcomes = []
        for w in result.plan.work:
            if not w.verifies:
                continue
            s, verified = w.seq, w.start + 1
            kv.computed_to(s.kv, w.end, verified)
            run = taken.get(s.seq_id)
            if s.sched.status is not Status.RUNNING:
                continue
            accepted = run - 1 if run else 0
            kv.truncate(s.kv, verified + accepted)
            if run:
                outcomes.append((s.seq_id, len(w.tokens) - 1, accepted))
        self.speculator.observe(outcomes)

    def _secure(self, s: SequenceState, attempt):
        """Run ``attempt`` (which may raise OutOfPages), preempting the newest running sequence (possibly
        ``s`` itself) until it fits. Returns its result, or None when ``s`` was preempted or failed."""
        while True:
            try:
                return attempt()
            except OutOfPages:
                victim = max(self.running, key=lambda x: x.sched.admitted)
                if victim is s and len(self.running) == 1:
                    self._fail(s, CannotFit(
                        f"needs more KV pages than the cache holds ({self.kv.capacity} pages of "
                        f"{self.page_size} tokens); lower max_tokens or raise kv_cache_tokens"
                    ))  # fmt: skip
                    return None
                self.preempt(victim)
                if victim is s:
                    return None
            except Exception as e:  # noqa: BLE001  this sequence's request fails alone, its pages freed
                self._fail(s, e)
                return None

    def _fail(self, s: SequenceState, error: Exception) -> None:
        """End ``s``'s request now (the plan reports it failed); its pages are released at once."""
        self._failed.append((s.request, failure_message("scheduling", error)))
        self.remove([x for x in s.request.seqs if x.sched.status is not Status.DONE])

    def abandon(self, forks: list[Fork] | None = None) -> None:
        """Forks that will not be carried out (their request failed, or the step raised before its commit;
        None: every fork not carried out yet): their reserved pages go back, and a sample that was to start
        by its fork goes back to the front of the queue."""
        for f in list(self._open_forks) if forks is None else forks:
            if self._open_forks.pop(f, False) is False:
                continue  # carried out or given back already
            self.kv.give_back(list(f.reserved))
            s = f.seq
            if s.sched.status is Status.RUNNING and not s.kv.pages:  # started by this fork: holds nothing
                self.running.remove(s)
                s.sched.status = Status.WAITING
                s.sched.arrival_step = self.step_count - self.max_wait_steps
                self.waiting.appendleft(s)

    # ---- siblings that share one context --------------------------------------------------------------
    def _sibling_forced_appends(self) -> dict[int, SequenceState]:
        """Running samples of one request forced through the same text from the same context: all but the
        oldest follow it ({follower's seq_id: leader}). Only forced appends (several tokens pending): there it
        saves work."""
        if not self.sharing.enabled:
            return {}
        groups: dict[tuple, list[SequenceState]] = {}
        for s in self.running:
            if s.pending > 1 and s.generated and s.computed >= len(s.prompt_ids):
                key = (s.request.request_id, s.computed, tuple(s.generated))
                groups.setdefault(key, []).append(s)
        # A sample still writing pages it published in flight (re-admitted amid its forced text) computes its
        # own text:
        # a fork would drop those pages, and whoever waits on them would wait for good.
        return {f.seq_id: g[0] for g in groups.values() for f in g[1:] if not self.kv.in_flight(f.kv)}

    def _group_followers(self, followers: dict[int, SequenceState], work: list[Work]):
        """(leader, followers) for the leaders whose work this step reaches the end of their context; the
        other followers simply wait a step."""
        sampling = {w.seq.seq_id for w in work if w.logit_rows}
        groups: dict[int, tuple[SequenceState, list[SequenceState]]] = {}
        for s in self.running:
            leader = followers.get(s.seq_id)
            if leader is not None and leader.seq_id in sampling:
                groups.setdefault(leader.seq_id, (leader, []))[1].append(s)
        return list(groups.values())

    def _forks(self, leader: SequenceState, group: list[SequenceState]) -> list[Fork]:
        """Reserve each follower's own pages for what it will copy from the leader (its full pages are
        shared); a follower that does not fit waits a step (running followers) or in the queue."""
        out = []
        upto = leader.context_len
        ps = self.page_size
        limit = self.sharing.max_pages(ps)
        shared = upto // ps if limit is None else min(limit, upto // ps)
        need = self.kv.pages_for(upto) - shared
        for s in group:
            reserved = self.kv.reserve(need)
            if reserved is None:
                break
            if s.sched.status is not Status.RUNNING:
                self._start(s)
            fork = Fork(s, leader, shared, reserved)
            self._open_forks[fork] = None
            out.append(fork)
        return out

    # ---- admission ------------------------------------------------------------------------------------
    def _admit(self, work: list[Work], forks: list[Fork]) -> None:
        """Waiting -> running: aged sequences first, then the longest cached prefix, while seats and pages
        last. A sample whose sibling is still computing their prompt is not admitted: it forks from the
        sibling in the step that finishes the prompt."""
        seats = self.max_num_seqs - len(self.running)
        if seats <= 0 or not self.waiting:
            return
        limit = self.sharing.max_pages(self.page_size)
        leaders = {s.request.request_id: s for s in self.running if not s.generated and s.pending > 0}
        sampling = {w.seq.seq_id for w in work if w.logit_rows}
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        key = lambda s: s.request.request_id if not s.generated else s.seq_id  # noqa: E731  (one match per prompt)
        matches = {}
        for s in window:
            if key(s) not in matches:
                # Never the last token: its forward gives the logits to sample from.
                matches[key(s)] = self.kv.cached_pages(s.kv, s.context, limit) if limit != 0 else 0
        aged = [s for s in window if self.step_count - s.sched.arrival_step >= self.max_wait_steps]
        rest = [s for s in window if self.step_count - s.sched.arrival_step < self.max_wait_steps]
        rest.sort(key=lambda s: -matches[key(s)])
        fork_groups: dict[int, list[SequenceState]] = {}
        for s in aged + rest:
            if seats <= 0:
                break
            leader = leaders.get(s.request.request_id) if not s.generated else None
            if leader is not None:
                if leader.seq_id in sampling:
                    fork_groups.setdefault(leader.seq_id, [leader]).append(s)
                    seats -= 1
                continue
            try:
                w = self._admit_one(s, limit)
            except Exception as e:  # noqa: BLE001  its request fails alone, its pages freed
                seats -= 1
                self._fail(s, e)
                continue
            if w is False:
                break  # keep the order: a later, smaller sequence does not overtake this one
            seats -= 1
            if not s.generated:
                leaders[s.request.request_id] = s
            if w is not None:
                work.append(w)
                if w.logit_rows:
                    sampling.add(s.seq_id)
        for leader, *group in fork_groups.values():
            for f in self._forks(leader, group):
                forks.append(f)
                self._admit_record(f.seq, leader.request.cached_tokens)  # found what its leader found
        started = {s.seq_id for s in self.running}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in started)

    def _admit_one(self, s: SequenceState, limit: int | None) -> Work | None | bool:
        """Start ``s`` on its cached prefix (matched now: an earlier admission may have published pages in
        flight it can wait for, or evicted pages) plus its own pages for the rest of its context, all taken
        now; returns its first work, or False when it does not fit."""
        context = s.context
        publish = None
        if self.sharing.enabled:
            publish = len(context) if limit is None else min(len(context), limit * self.page_size)
        try:
            shared = self.kv.admit(s.kv, context, limit, publish)
        except Exception:
            self.kv.release(s.kv, None)  # whatever it took before failing
            raise
        if shared is None:
            return False
        self._start(s)
        # Its hit: the prompt tokens on pages it shares, cached or still being computed by another request
        # (it waits for those instead of computing them).
        self._admit_record(s, min(shared * self.page_size, len(s.prompt_ids)))
        return self._work(s)

    def _admit_record(self, s: SequenceState, hit: int) -> None:
        """Note an admission for the plan; the request's hit is the best of its samples' first admissions."""
        first = not s.sched.counted
        s.sched.counted = True
        if first:
            s.request.cached_tokens = max(s.request.cached_tokens, hit)
        self._admitted.append(Admission(s, hit, first))

    def _start(self, s: SequenceState) -> None:
        """A place among the running (the newest). Its page table is set up by the caller, or by the fork
        in ``commit``."""
        s.sched.status = Status.RUNNING
        s.sched.admitted = next(self._admissions)
        self.running.append(s)
        if s.request.first_scheduled is None:
            s.request.first_scheduled = time.monotonic()

    def _publish(self, s: SequenceState, limit: int | None) -> None:
        """Cache ``s``'s computed full pages (below the sharing limit)."""
        t = s.kv
        end = t.computed
        if limit is not None:
            end = min(end, limit * self.page_size)
        if end // self.page_size > t.published:
            self.kv.publish(t, s.context, end)

    # ---- preemption ------------------------------------------------------------------------------------
    def preempt(self, s: SequenceState) -> None:
        """Send a running sequence back to wait (first in line): its computed full pages stay cached, so it
        resumes by recomputing only what was evicted meanwhile."""
        self.preemptions += 1
        s.sched.preemptions += 1
        self._preempted.append(s)
        self._release(s)
        self.running.remove(s)
        s.sched.status = Status.WAITING
        s.sched.arrival_step = self.step_count - self.max_wait_steps
        self.waiting.appendleft(s)

    def _release(self, s: SequenceState) -> None:
        """Release ``s``'s pages; a sequence waiting on pages ``s`` was to compute is preempted first
        (nobody else would write them)."""
        others = [x for x in self.running if x is not s and x.sched.status is Status.RUNNING]
        for j in self.kv.dependents(s.kv, [x.kv for x in others]):
            if others[j].sched.status is Status.RUNNING:
                self.preempt(others[j])
        self.kv.release(s.kv, s.context if self.sharing.enabled else None)
