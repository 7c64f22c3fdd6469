"""The scheduler: who waits, who prefills what, who decodes, who is preempted. It decides; the KV
manager moves pages; it never touches tensors.

Every step:
1. **admit** waiting sequences, longest cached prefix first (the seeds' longest-shared-prefix-first,
   which approximates depth-first order of the prefix tree), except that any sequence that has waited
   ``max_wait_steps`` goes first; only what memory can hold is admitted, so admission is a promise;
2. **prefill** at most ``prefill_budget`` uncached tokens, in chunks of at most ``prefill_chunk``, for
   any number of nodes and requests: they all run in the step's one packed forward;
3. **join**: sequences whose whole path is computed by the end of this step decode in this same step;
   Running sequences about to extend the same tokens from the same context (the n samples of a request
   forced through the same text by jump-forward) first move those tokens into the tree, so they are
   prefilled once as a shared node (``share_extends``);
4. **grow**: every decoding sequence gets pages for its next token(s); when memory runs out, the newest
   sequence is **preempted** (its KV goes into the prefix tree; it resumes from there, recomputing only
   what was evicted meanwhile).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from hydragen.engine.sequence import Sequence
from hydragen.kv.manager import Item, KVManager
from hydragen.kv.pool import OutOfPages
from hydragen.kv.radix import Node


@dataclass
class PrefillChunk:
    node: Node
    start: int  # token offsets inside the node
    end: int


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # DFS order; each feeds its `pending` tokens
    items: list[Item] = field(default_factory=list)  # shared runs read by ranges of `decode`

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        *,
        max_num_seqs: int = 256,
        prefill_chunk: int = 512,
        prefill_budget: int = 2048,
        max_wait_steps: int = 64,
    ):
        self.kv = kv
        self.max_num_seqs, self.prefill_chunk, self.prefill_budget = (
            max_num_seqs,
            prefill_chunk,
            prefill_budget,
        )
        self.max_wait_steps = max_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []  # DFS order
        self.step_count = 0
        self.preemptions = 0
        self._joins = itertools.count()
        self._order_dirty = False
        self._plan_items: list[Item] = []
        self.admitted: list[tuple[Sequence, int]] = []  # (sequence, cached tokens) admitted this step
        self.failures: list[tuple[Sequence, Exception]] = []  # errors the engine attributes to requests

    # ---- queues -------------------------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.arrival_step = self.step_count
        self.waiting.extend(seqs)

    def remove(self, seqs: list[Sequence]) -> None:
        """Take sequences out of every queue (finished, failed or aborted); the caller frees their KV."""
        gone = {id(s) for s in seqs}
        if any(id(s) in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        self.prefilling = [s for s in self.prefilling if id(s) not in gone]
        before = len(self.running)
        self.running = [s for s in self.running if id(s) not in gone]
        if len(self.running) != before:
            self._order_dirty = True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step_count += 1
        self.admitted = []
        self.failures = []
        self._share_extends()
        self._admit()
        plan = StepPlan()
        for s in self._plan_prefill(plan):
            try:
                self.kv.join(s)
            except OutOfPages:  # its private copy does not fit yet: it stays prefilled and pinned
                self.prefilling.append(s)
                continue
            except Exception as e:  # noqa: BLE001  the engine fails this sequence's request alone
                self.failures.append((s, e))
                continue
            s.join_order = next(self._joins)
            self.running.append(s)
            self._order_dirty = True
        self._grow()
        decode = self.replan()
        plan.decode, plan.items = decode.decode, decode.items
        return plan

    def replan(self) -> StepPlan:
        """The decode part of a plan for the current running set (after some of it was failed)."""
        if self._order_dirty:
            self.running.sort(key=lambda s: s.order_key)
            self._order_dirty = False
            self._plan_items = self.kv.plan(self.running, all_nodes=self.kv.reserve_whole)
        return StepPlan(decode=list(self.running), items=self._plan_items)

    def _share_extends(self) -> None:
        """Groups of running sequences whose contexts agree up to their last token, with several tokens
        pending (forced text), have those tokens prefilled once as a tree node they all hold: each goes
        through the prefill path again (its computed KV handed to the tree, nothing recomputed), with
        only its last token left to decode."""
        kv = self.kv
        if not kv.prefix_sharing or kv.share_limit is not None or kv.reserve_whole:
            return
        groups: dict[tuple, list[Sequence]] = {}
        for s in self.running:
            if s.pending > 1:
                groups.setdefault(tuple(s.context[:-1]), []).append(s)
        moving = [s for g in groups.values() if len(g) > 1 for s in g]
        if not moving:
            return
        gone = {id(s) for s in moving}
        self.running = [s for s in self.running if id(s) not in gone]
        self._order_dirty = True
        for s in moving:
            kv.leave(s)
            s.pending = 1
            kv.admit(s)
            self.prefilling.append(s)

    def _admit(self) -> None:
        """Waiting -> prefilling: aged sequences first, then the longest cached prefix, while memory lasts."""
        room = self.max_num_seqs - len(self.running) - len(self.prefilling)
        if room <= 0 or not self.waiting:
            return
        aged = [s for s in self.waiting if self.step_count - s.arrival_step >= self.max_wait_steps]
        rest = [s for s in self.waiting if self.step_count - s.arrival_step < self.max_wait_steps]
        if self.kv.prefix_sharing and rest:
            hits: dict[int, int] = {}
            for s in rest:  # sequences of one request share a context: match it once
                key = id(s.request) if not s.generated else id(s)
                if key not in hits:
                    hits[key] = self.kv.tree.match_len(s.context[: s.computed])
            rest.sort(key=lambda s: -hits[id(s.request) if not s.generated else id(s)])
        admitted: set[int] = set()
        pages_promised = 0
        # Samples of one request share their prompt: its uncached part is promised once.
        started = {id(s.request) for s in self.prefilling + self.running if not s.generated}
        for s in (aged + rest)[:room]:
            shares_prompt = not s.generated and id(s.request) in started
            need = self.kv.pool.pages_for(s.pending) if shares_prompt else self.kv.admission_pages(s)
            if not self.kv.can_fit(pages_promised + need):
                break  # keep the order: a later, smaller sequence does not overtake this one
            pages_promised += need
            self.admitted.append((s, self.kv.admit(s)))
            if not s.generated:
                started.add(id(s.request))
            admitted.add(id(s))
            self.prefilling.append(s)
        if admitted:
            self.waiting = deque(s for s in self.waiting if id(s) not in admitted)

    def _plan_prefill(self, plan: StepPlan) -> list[Sequence]:
        """Chunks of uncached nodes within the budget; returns the sequences ready to decode this step."""
        budget, ready, still = self.prefill_budget, [], []
        planned: dict[int, int] = {}  # id(node) -> tokens computed by the end of this step
        out_of_memory = False
        for s in self.prefilling:
            tree = self.kv.tree_for(s)
            path = s.node.path() if s.node is not None else []
            for node in path:
                done = planned.get(id(node), node.filled)
                while done < len(node.tokens) and budget > 0 and not out_of_memory:
                    try:
                        self.kv.allocate_node(tree, node)
                    except OutOfPages:
                        out_of_memory = True
                        break
                    end = min(len(node.tokens), done + self.prefill_chunk, done + budget)
                    plan.prefill.append(PrefillChunk(node, done, end))
                    budget -= end - done
                    done = end
                planned[id(node)] = done
            # A sequence decodes in the step that completes its path (each layer writes the step's K/V
            # before attending), unless its join copies the path (sharing off, one-level ablation).
            if not self.kv.join_copies:
                complete = all(planned.get(id(n), n.filled) == len(n.tokens) for n in path)
            else:
                complete = all(n.has_kv for n in path)
            (ready if complete else still).append(s)
        self.prefilling = still
        if out_of_memory and len(still) > 1 and not ready and not self.running and not plan.prefill:
            # Out of memory with nothing running to free any: partial prefills would deadlock each
            # other, so all but the oldest go back to wait (their partial KV becomes evictable).
            self.requeue(still[1:])
            self.prefilling = still[:1]
        return ready

    def _grow(self) -> None:
        """Own pages for every decoding sequence's next tokens; preempt the newest when memory is short."""
        i = 0
        while i < len(self.running):
            try:
                self.kv.reserve(self.running[i])
                i += 1
            except OutOfPages:
                if self.prefilling:
                    self.requeue(self.prefilling)  # their pinned partial KV may be what is in the way
                    self.prefilling = []
                else:
                    self.preempt(max(self.running, key=lambda x: x.join_order))
                i = 0  # reserve() is a no-op for sequences that already have their pages

    def preempt(self, s: Sequence) -> None:
        """Give a running sequence's KV to the tree and send it back to wait (first in line)."""
        self.preemptions += 1
        s.preemptions += 1
        self.running.remove(s)
        self._order_dirty = True
        self.kv.leave(s)
        s.arrival_step = self.step_count - self.max_wait_steps
        self.waiting.appendleft(s)

    def requeue(self, seqs: list[Sequence]) -> None:
        """Send prefilling sequences back to the front of the queue, unpinning their (partial) KV."""
        for s in reversed(seqs):
            self.kv.unpin(s)
            self.waiting.appendleft(s)
