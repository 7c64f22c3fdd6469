"""A discrete-event simulation of N replicas behind ``hydragen.dp.router.Router``, for 8-64 replicas.

The router is the real one: every request is routed by ``Router.choose`` on its real token ids and text,
and each simulated replica feeds its cache changes back through ``Router.apply`` as the KV events a replica
publishes. A replica's prefix cache is the real one too: a ``KVManager`` over a page pool of one float per
slot (no KV is ever written), driven through the calls of its contract exactly as ``engine.scheduler``
makes them: ``admit`` (the whole context's pages, its prompt published at once), ``ready`` and ``allocate``
for a step's work, ``computed_to`` and ``publish`` after it, ``dependents`` and ``release`` when a request
is preempted or ends. So pages are shared, waited for while in flight, swapped for identical cached ones,
evicted least recently used and named by the same chained hashes as in the engine, and the events are the
tree's ``PageEvent``s converted by ``dp.kv_events.to_wire`` as a replica's publisher converts them.

The scheduling around it is a model of hydragen's engine: continuous batching, running requests oldest
first, prompt chunks of at most 512 tokens within 2048 per step, one token per decoding request, the newest
request preempted when pages run out (and whoever waits on pages it was computing), admission in arrival
order. A step takes the time the service model says: seconds per uncached prompt token plus a decode
step's time for its batch, measured on the real replica (``bench dp`` calibrates it at 1 thread).

Turns of one chat follow each other as in ``bench dp``: the next question leaves a think time after the
answer ended, with the answer in its history. Answers are synthetic tokens of the length the real runs
produced for that ``max_tokens`` (or ``max_tokens``).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from hydragen.bench.core.stats import percentile
from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.workload import Session, Workload
from hydragen.dp.kv_events import KVCacheEvent, KVEventBatch, to_wire
from hydragen.dp.router import Route, Router, RouteRequest
from hydragen.kv.manager import KVManager, PageTable
from hydragen.kv.pool import OutOfPages, PagePool
from hydragen.kv.radix import PageEvent

PREFILL_CHUNK, PREFILL_BUDGET = 512, 2048  # the scheduler's defaults


@dataclass(frozen=True)
class ServiceModel:
    """Seconds one engine step takes: ``prefill_token_s`` per prompt token computed, plus, when it
    decodes, ``decode_step_s`` + ``decode_seq_s`` per decoding request."""

    prefill_token_s: float
    decode_step_s: float
    decode_seq_s: float

    def step_s(self, prefill_tokens: int, decoding: int) -> float:
        decode = self.decode_step_s + self.decode_seq_s * decoding if decoding else 0.0
        return self.prefill_token_s * prefill_tokens + decode


@dataclass(eq=False, repr=False)
class SimRequest:
    session: Session
    turn: int
    prompt: list[int]
    answer: list[int]  # the tokens it will generate
    text: str
    arrival: float
    route: Route | None = None
    replica: int = -1
    table: PageTable = field(default_factory=PageTable)  # its pages in the replica's KV manager
    generated: int = 0
    counted: bool = False
    cached_tokens: int = 0
    first_token: float | None = None
    done: float | None = None
    admitted_order: int = 0
    failed: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.answer[: self.generated]

    @property
    def context_len(self) -> int:
        return len(self.prompt) + self.generated


@dataclass(frozen=True)
class SimWork:
    """What one running request computes in a step: context positions [start, start + tokens)."""

    request: SimRequest
    start: int
    tokens: int
    decodes: bool  # one token of a request that is generating (charged as part of a decode step)


def kv_manager(pages: int, page_size: int) -> KVManager:
    """The engine's KV manager over a pool of ``pages`` whose slots hold one float each, never written: the
    simulation keeps track of pages, not of KV."""
    return KVManager(PagePool(1, pages, page_size, 1, 1, torch.float32, "cpu"))


class SimReplica:
    def __init__(self, index: int, kv_tokens: int, page_size: int, max_num_seqs: int, service: ServiceModel):
        self.index, self.page_size, self.max_num_seqs, self.service = index, page_size, max_num_seqs, service
        self.kv = kv_manager(kv_tokens // page_size, page_size)
        self._events: list[PageEvent] = []
        self.kv.publish_events(lambda events: self._events.extend(events))
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.busy_s = 0.0
        self.stepping = False
        self.prompt_tokens = self.hit_tokens = self.prefilled = 0
        self.requests = 0
        self.failed: list[SimRequest] = []  # requests the replica could not fit, since the last look
        self._order = itertools.count()
        self._budget = PREFILL_BUDGET

    def take_events(self) -> list[KVCacheEvent]:
        """The tree's changes since the last call, as the replica's publisher puts them on the wire."""
        self.kv.flush_events()
        events, self._events = self._events, []
        return to_wire(events, self.page_size)

    # ---- admission --------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Waiting requests in arrival order while seats and pages last (``Scheduler._admit_one``)."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            context = r.context
            shared = self.kv.admit(r.table, context, None, len(context))
            if shared is None:
                if not self.running:  # larger than the whole cache: the engine fails it
                    self.failed.append(self.waiting.pop(0))
                    continue
                return  # waits for pages (requests ending free them)
            self.waiting.pop(0)
            r.admitted_order = next(self._order)
            if not r.counted:
                r.counted = True
                self.prompt_tokens += len(r.prompt)
                r.cached_tokens = min(shared * self.page_size, len(r.prompt))
                self.hit_tokens += r.cached_tokens
            self.running.append(r)

    # ---- one step -----------------------------------------------------------------------------------------
    def plan(self) -> list[SimWork]:
        """The work of a step, running requests oldest first; may preempt the newest requests when pages
        run out."""
        work, self._budget = [], PREFILL_BUDGET
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted by an older request this step
            w = self._secure(r)
            if w is not None:
                work.append(w)
        return [w for w in work if w.request in self.running]  # a preemption may have taken planned ones

    def _work(self, r: SimRequest) -> SimWork | None:
        """What ``r`` computes this step and the pages for it, as ``Scheduler._work`` (raises OutOfPages)."""
        t, kv = r.table, self.kv
        if not kv.ready(t):
            return None  # its next page is being computed by another request
        start = t.computed
        pending = r.context_len - start
        if pending <= 0:
            return None
        decoding = r.generated > 0 and start >= len(r.prompt)
        if pending == 1 or (decoding and pending <= PREFILL_CHUNK):
            k = pending
        else:
            k = min(pending, PREFILL_CHUNK, self._budget)
            if k <= 0:
                return None
        if not kv.allocate(t, start + k):
            raise OutOfPages(f"no KV pages for the next {k} tokens")
        if k != pending or not decoding:
            self._budget -= k
        return SimWork(r, start, k, decoding and pending == 1)

    def _secure(self, r: SimRequest) -> SimWork | None:
        """``r``'s work, preempting the newest running requests (possibly ``r``) until its pages fit."""
        while True:
            try:
                return self._work(r)
            except OutOfPages:
                victim = max(self.running, key=lambda x: x.admitted_order)
                if victim is r and len(self.running) == 1:  # it alone outgrows the cache: the engine fails it
                    self._release(r)
                    self.running.remove(r)
                    self.failed.append(r)
                    return None
                self.preempt(victim)
                if victim is r:
                    return None

    def preempt(self, r: SimRequest) -> None:
        """Back to the head of the queue; its computed pages stay cached, it resumes from them."""
        self._release(r)
        self.running.remove(r)
        self.waiting.insert(0, r)

    def _release(self, r: SimRequest) -> None:
        """Let go of ``r``'s pages, its computed full pages cached; whoever waits on pages it was still to
        compute is preempted first (nobody else would write them), as ``Scheduler._release``."""
        others = [x for x in self.running if x is not r]
        for j in self.kv.dependents(r.table, [x.table for x in others]):
            if others[j] in self.running:
                self.preempt(others[j])
        self.kv.release(r.table, r.context)

    def finish_step(self, work: list[SimWork], now: float) -> list[SimRequest]:
        """Apply a step's work at its end as ``Scheduler.update`` does (KV computed, full pages published),
        then sample; returns the requests that ended (their pages released)."""
        work = [w for w in work if w.request in self.running]
        for w in work:
            self.kv.computed_to(w.request.table, w.start + w.tokens)
        ps = self.page_size
        for w in work:
            t = w.request.table
            if t.computed // ps > t.published:
                self.kv.publish(t, w.request.context, t.computed)
        ended = []
        for w in work:
            r = w.request
            self.prefilled += max(0, min(len(r.prompt), w.start + w.tokens) - w.start)
            if r.table.computed >= r.context_len:  # reached the end of its context: samples
                r.generated += 1
                if r.first_token is None:
                    r.first_token = now
                if r.generated >= len(r.answer):
                    ended.append(r)
        for r in sorted(ended, key=lambda x: -x.admitted_order):  # newest first, as Scheduler.remove
            self.running.remove(r)
            self._release(r)
            r.done = now
        return ended


class Simulation:
    """Replays ``workload`` through ``Router(policy)`` and simulated replicas; ``run`` returns the figures."""

    def __init__(
        self,
        workload: Workload,
        tokens: ChatTokens,
        replicas: int,
        policy: str,
        service: ServiceModel,
        kv_tokens: int,
        page_size: int = 16,
        max_num_seqs: int = 256,
        balance_bound: int = 4,
    ):
        self.w, self.tokens, self.policy = workload, tokens, policy
        self.router = Router(replicas, policy, balance_bound)
        self.replicas = [SimReplica(i, kv_tokens, page_size, max_num_seqs, service) for i in range(replicas)]
        self.events: list = []
        self._tie = itertools.count()
        self.requests: list[SimRequest] = []

    def _at(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, next(self._tie), kind, payload))

    def run(self) -> dict:
        for s in self.w.sessions:
            self._at(s.start_s + s.turns[0].delay_s, "arrive", (s, 0))
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(*payload, now)
            else:
                self._step_end(payload, now)
        return self.figures(now)

    def _arrive(self, session: Session, turn: int, now: float) -> None:
        ids, text = self.tokens.turn(session, turn)
        answer, _ = self.tokens.answer(session, turn)
        r = SimRequest(session, turn, ids, answer, text, now)
        request = RouteRequest(ids, text)
        r.route = self.router.choose(request)
        self.router.started(r.route)
        r.replica = r.route.replica
        rep = self.replicas[r.replica]
        rep.requests += 1
        rep.waiting.append(r)
        self.requests.append(r)
        if not rep.stepping:
            self._start_step(rep, now)

    def _publish(self, rep: SimReplica, now: float) -> None:
        """Hand the router what the replica's tree changed: once per step, at its end (its admissions, the
        pages it computed, the requests it ended), as the engine flushes its events after each step."""
        events = rep.take_events()
        if events:
            self.router.apply(rep.index, KVEventBatch(now, events, rep.index))

    def _start_step(self, rep: SimReplica, now: float) -> None:
        rep.admit()
        work = rep.plan()
        for r in rep.failed:  # as a client sees an error: the chat ends there
            r.failed = True
            self.router.finished(r.route)
        rep.failed = []
        if not work:  # an empty step: the engine flushes what admission changed at once
            self._publish(rep, now)
            rep.stepping = False
            return
        prefill = sum(w.tokens for w in work if not w.decodes)
        dt = rep.service.step_s(prefill, sum(w.decodes for w in work))
        rep.busy_s += dt
        rep.stepping = True
        self._at(now + dt, "step", (rep, work))

    def _step_end(self, payload, now: float) -> None:
        rep, work = payload
        for r in rep.finish_step(work, now):
            self.router.finished(r.route)
            s = r.session
            if r.turn + 1 < len(s.turns):
                self._at(now + s.turns[r.turn + 1].delay_s, "arrive", (s, r.turn + 1))
        self._publish(rep, now)
        self._start_step(rep, now)

    def figures(self, end: float) -> dict:
        done = [r for r in self.requests if r.done is not None]
        ttft = [r.first_token - r.arrival for r in done]
        prompt = sum(x.prompt_tokens for x in self.replicas)
        busy = [x.busy_s for x in self.replicas]
        counts = [x.requests for x in self.replicas]
        start = min((r.arrival for r in self.requests), default=0.0)
        return {
            "policy": self.policy,
            "replicas": len(self.replicas),
            "requests": len(done),
            "failed": sum(r.failed for r in self.requests),
            "hit_rate": sum(x.hit_tokens for x in self.replicas) / max(prompt, 1),
            "output_tok_s": sum(r.generated for r in done) / max(end - start, 1e-9),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "busy_max_over_mean": max(busy) / max(sum(busy) / len(busy), 1e-9),
            "requests_max_over_mean": max(counts) / max(sum(counts) / len(counts), 1e-9),
            "prefill_tokens": sum(x.prefilled for x in self.replicas),
            "wall_s": end - start,
            "requests_per_replica": counts,
            "routed": [r["routed"] for r in self.router.snapshot()],
        }
