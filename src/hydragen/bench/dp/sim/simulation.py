"""A discrete-event simulation of N replicas behind ``hydragen.dp.router.Router``, for 8-64 replicas.

The router is the real one: every request is routed by ``Router.choose`` on its real token ids and text,
and each simulated replica feeds its cache changes back through ``Router.apply`` as the KV events a replica
publishes. A replica is modelled as hydragen's engine runs: continuous batching, running requests oldest
first, prompt chunks of at most 512 tokens within 2048 per step, one token per decoding request, the whole
prompt's pages taken at admission, generated pages cached when a request ends, LRU eviction of idle pages
(``page_cache``), the newest request preempted when pages run out. A step takes the time the service
model says: seconds per uncached prompt token plus a decode step's time for its batch, measured on the
real replica (``bench dp`` calibrates it at 1 thread).

Turns of one chat follow each other as in ``bench dp``: the next question leaves a think time after the
answer ended, with the answer in its history. Answers are synthetic tokens of the length the real runs
produced for that ``max_tokens`` (or ``max_tokens``).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from hydragen.bench.core.stats import percentile
from hydragen.bench.dp.chat_tokens import ChatTokens
from hydragen.bench.dp.sim.page_cache import OutOfPages, PageCache
from hydragen.bench.dp.workload import Session, Workload
from hydragen.dp.kv_events import KVEventBatch
from hydragen.dp.router import Route, Router, RouteRequest
from hydragen.kv.page_hash import page_hashes

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
    path: list[int] = field(default_factory=list)  # page hashes it holds in the cache
    path_tokens: int = 0  # tokens those pages cover
    private: int = 0  # pages it holds outside the cache
    computed: int = 0  # leading context positions computed
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


class SimReplica:
    def __init__(self, index: int, kv_tokens: int, page_size: int, max_num_seqs: int, service: ServiceModel):
        self.index, self.page_size, self.max_num_seqs, self.service = index, page_size, max_num_seqs, service
        self.cache = PageCache(kv_tokens // page_size, page_size)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.busy_s = 0.0
        self.stepping = False
        self.prompt_tokens = self.hit_tokens = self.prefilled = 0
        self.requests = 0
        self.failed: list[SimRequest] = []  # requests the replica could not fit, since the last look
        self._order = itertools.count()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ---- admission --------------------------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            context = r.context
            hashes = page_hashes(context, self.page_size)
            matched = self.cache.match(hashes)
            need = self.pages_for(len(context)) - matched
            reusable = sum(h in self.cache.idle for h in hashes[:matched])  # idle now, held once admitted
            if need > self.cache.free + len(self.cache.idle) - reusable:
                if not self.running:  # larger than the whole cache: the engine fails it
                    self.failed.append(self.waiting.pop(0))
                    continue
                return  # waits for pages (requests ending free them)
            self.cache.hold(hashes[:matched])
            self.cache.make_room(need)
            self.waiting.pop(0)
            ps = self.page_size
            own = hashes[matched:]
            tokens = [context[i * ps : (i + 1) * ps] for i in range(matched, len(hashes))]
            self.cache.store(hashes[matched - 1] if matched else None, own, tokens, r, computed=False)
            r.path, r.path_tokens = hashes, len(hashes) * ps
            r.private = self.pages_for(len(context)) - len(hashes)
            self.cache.private += r.private
            r.computed = matched * ps
            r.admitted_order = next(self._order)
            if not r.counted:
                r.counted = True
                self.prompt_tokens += len(r.prompt)
                r.cached_tokens = min(matched * ps, len(r.prompt))
                self.hit_tokens += r.cached_tokens
            self.running.append(r)

    # ---- one step -----------------------------------------------------------------------------------------
    def plan(self) -> list[tuple[SimRequest, int, bool]]:
        """(request, tokens, decodes) computed this step, running requests oldest first; may preempt the
        newest requests when pages run out."""
        work, budget = [], PREFILL_BUDGET
        for r in list(self.running):
            if r not in self.running or self._waits(r):
                continue  # preempted by an older request this step, or waiting on another's pages
            pending = len(r.prompt) + r.generated - r.computed
            decodes = pending == 1 and r.generated > 0
            k = 1 if decodes else min(pending, PREFILL_CHUNK, budget)
            if k <= 0 or not self._grow(r, r.computed + k):
                continue
            if not decodes:
                budget -= k
            work.append((r, k, decodes))
        return work

    def _waits(self, r: SimRequest) -> bool:
        """A page before its next position is another request's and not computed yet. A page whose writer
        let go of it (preempted) is computed here instead."""
        first = self.cache.first_uncomputed(r.path)
        if first is None or first * self.page_size >= r.computed:
            return False
        writer = self.cache.pages[r.path[first]].writer
        if writer is r:
            return False
        if writer is None:
            start = self.cache.adopt(r.path, r)
            r.computed = min(r.computed, start * self.page_size)
            return False
        return True

    def _grow(self, r: SimRequest, upto: int) -> bool:
        """Pages for context positions [0, upto); preempts the newest running requests if short."""
        need = self.pages_for(upto) - len(r.path) - r.private
        while need > 0:
            try:
                self.cache.make_room(need)
                r.private += need
                self.cache.private += need
                return True
            except OutOfPages:
                if self.running == [r]:  # it alone outgrows the cache: the engine fails it
                    self.preempt(r)
                    self.failed.append(self.waiting.pop(0))
                    return False
                victim = max(self.running, key=lambda x: x.admitted_order)
                self.preempt(victim)
                if victim is r:
                    return False
        return True

    def preempt(self, r: SimRequest) -> None:
        """Back to the head of the queue; its computed pages stay cached, it resumes from them."""
        self.running.remove(r)
        self.cache.release(r.path, r)
        self.cache.private -= r.private
        r.path, r.private, r.computed = [], 0, 0
        self.waiting.insert(0, r)

    def finish_step(self, work: list[tuple[SimRequest, int, bool]], now: float) -> list[SimRequest]:
        """Apply a step's work at its end; returns the requests that ended."""
        ended = []
        for r, k, _ in work:
            if r not in self.running:
                continue
            prompt_before = max(0, min(len(r.prompt), r.computed + k) - r.computed)
            self.prefilled += prompt_before
            r.computed += k
            ps = self.page_size
            self.cache.computed_upto(r.path[: r.computed // ps], r)
            if r.computed >= len(r.prompt) + r.generated:  # reached the end of its context: samples
                r.generated += 1
                if r.first_token is None:
                    r.first_token = now
                if r.generated >= len(r.answer):
                    ended.append(r)
        for r in ended:
            self.end(r, now)
        return ended

    def end(self, r: SimRequest, now: float) -> None:
        """Cache its generated pages (all but the last token have KV), let go of everything."""
        self.running.remove(r)
        ps, ctx = self.page_size, r.context
        full = page_hashes(ctx[: r.computed], ps)
        new = full[len(r.path) :]
        present = self.cache.match(new) if new and new[0] in self.cache.pages else 0
        new = new[: len(new) if not present else 0]  # an identical context cached them already: keep those
        self.cache.private -= r.private
        r.private = 0
        if new:
            stored = [ctx[i * ps : (i + 1) * ps] for i in range(len(r.path), len(r.path) + len(new))]
            self.cache.store(r.path[-1] if r.path else None, new, stored, r, computed=True)
            r.path = r.path + new
        self.cache.release(r.path, r)
        r.done = now


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
        events = rep.cache.take_events()
        if events:
            self.router.apply(rep.index, KVEventBatch(now, events, rep.index))

    def _start_step(self, rep: SimReplica, now: float) -> None:
        rep.admit()
        work = rep.plan()
        for r in rep.failed:  # as a client sees an error: the chat ends there
            r.failed = True
            self.router.finished(r.route)
        rep.failed = []
        self._publish(rep, now)
        if not work:
            rep.stepping = False
            return
        prefill = sum(k for _, k, decodes in work if not decodes)
        dt = rep.service.step_s(prefill, sum(decodes for _, _, decodes in work))
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
