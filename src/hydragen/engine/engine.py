"""``EngineCore``, the step core: a persistent prefix cache, and a step that passes data from part to part.

``add_request`` queues a request's n sequences. Every ``step`` is three calls, each taking the last one's
output as data:

1. ``scheduler.schedule() -> StepPlan``: admission, prefill chunks, decode tokens, forced appends, forks,
   preemption, shared runs, and who was admitted, preempted or failed; nothing touches pages or the prefix
   tree until 3;
2. ``run_plan(runner, structured, plan) -> StepResult``: one packed forward (a request whose work fails
   alone ends alone) and one sampling call;
3. the update: ``scheduler.update(result)`` commits the KV (computed, published, forks copied), the output
   processor appends the tokens (``append_step``), ended sequences give their pages back (their computed
   KV staying cached), and each changed request gets its report (``RequestOutput``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from hydragen.engine.config import EngineConfig
from hydragen.engine.execution import run_plan
from hydragen.engine.isolation import failure_message
from hydragen.engine.output_processor import StageError
from hydragen.engine.outputs import RequestOutput, RequestOutputKind
from hydragen.engine.parts import build_parts
from hydragen.engine.request_checks import check_fits, check_forced, check_request
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.sequence import Request, SequenceState, new_request
from hydragen.engine.sharing import DEFAULT_MIN_SHARED_READS
from hydragen.engine.stats import EngineSnapshot, EngineStats
from hydragen.engine.step_plan import StepPlan, StepResult
from hydragen.kv.radix import PageEvent

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _view(part: str, name: str) -> property:
    """A read-write view of one of the engine's parts' attributes."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
    )


class EngineCore:
    """The step core (vLLM V1's ``EngineCore``): requests in, one ``step()`` at a time, reports out. It owns
    no thread and tracks no caller: ``StepLoop`` (``loop.py``) steps it for every caller, and the server
    reaches it only through an ``EngineClient``."""

    def __init__(self, model, cfg, tokenizer, config: EngineConfig, *, parallel=None):
        """``cfg``: the model's configuration; ``config``: the engine's settings (``EngineConfig``).
        ``parallel``: a tensor-parallel group's rank 0 (``hydragen.tp.launcher.TensorParallel``), which
        builds the page pool and model runner that drive the other ranks; None runs in-process. The parts
        and who owns what: ``parts.py``."""
        self.cfg, self.config = cfg, config
        parts = build_parts(model, cfg, tokenizer, config, parallel, DEFAULT_MIN_SHARED_READS)
        self.device, self.pool, self.kv, self.scheduler = parts.device, parts.pool, parts.kv, parts.scheduler
        self.runner, self.outputs, self.structured = parts.runner, parts.outputs, parts.structured
        self.prefix_sharing = config.prefix_sharing
        self.requests: dict[str, Request] = {}  # the requests not reported finished yet
        self.unreported: dict[str, Request] = {}  # changed between steps (failed, ended by forced text)
        self.stats = EngineStats()
        self.last_plan = StepPlan()  # the plan of the step running or last run (a stall's log names it)
        self.snapshot = EngineSnapshot.of(self)
        self.threads = None  # a cpu_threads.ThreadGovernor, when the caller wants the thread count managed
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()

    # ---- views ----------------------------------------------------------------------------------
    tree = property(lambda self: self.kv.tree)
    step_count = property(lambda self: self.scheduler.step_count)
    min_shared_reads = property(lambda self: self.scheduler.min_shared_reads)

    batch = property(lambda self: self.last_plan.view())  # the last step's work, as tests inspect it

    # The parts' swappable pieces, as tests inject faults through them: surfaces that outlive rewrites.
    sampler = _view("runner", "sampler")
    model = _view("runner", "model")
    tokenizer = _view("outputs", "tokenizer")
    eos_ids = _view("outputs", "eos_ids")
    # The model's reasoning format (hydragen.reasoning.ReasoningFormat), None when it does not reason.
    reasoning = property(lambda self: self.structured.reasoning)

    def sequence_kv_need(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots (whole pages) one sequence needs to be sure to finish when it runs alone: every context
        position but the last (the last sampled token is never fed back)."""
        new = min(max_tokens, self.cfg.max_position_embeddings - prompt_len)
        return self.pool.pages_for(prompt_len + new - 1) * self.pool.page_size

    def kv_usage(self) -> dict:
        """KV pages in use, held by the prefix cache, and in all: after every request ends, used == cached."""
        return self.kv.usage()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running sequence holds (as vLLM's reset_prefix_cache)."""
        self.kv.evict_idle()
        self.kv.flush_events()

    def publish_kv_events(self, sink: Callable[[list[PageEvent]], None]) -> None:
        """Report every page that enters or leaves the prefix tree to ``sink``, starting with the pages
        cached now; called after each step, abort and cache reset that changed the tree (from the thread
        that runs the engine, so ``sink`` must only hand the events off). ``serve --kv-events-endpoint``
        publishes them for a router."""
        self.kv.publish_events(sink)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. Raises ``ParamError`` (a ValueError naming the parameter) for a request the
        engine could never finish: bad token ids, too long for the context, or too big for the KV cache.
        Requests share cached pages only with requests of the same ``cache_salt`` (tenant isolation)."""
        check_request(prompt_ids, params, vocab=self.cfg.vocab_size, context=self.cfg.max_position_embeddings)
        check_fits(
            self.sequence_kv_need(len(prompt_ids), params.max_tokens),
            self.pool.num_slots,
            self.pool.page_size,
        )
        rid = str(next(self._request_ids)) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = new_request(rid, prompt, prompt_ids, params, self._seq_ids, cache_salt=cache_salt)
        self.structured.attach(params, req.seqs)  # a constraint that cannot compile raises ParamError here
        self.requests[rid] = req
        self.scheduler.add(req.seqs)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its pages are freed (its computed KV stays cached)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            self.outputs.end(s, "abort")
        self.scheduler.remove(req.seqs)
        self.kv.flush_events()
        self.snapshot = EngineSnapshot.of(self)  # no step may follow: /metrics sees the abort now
        return True

    def _fail(self, req: Request, message: str) -> None:
        """End a request with an error instead of crashing the engine for everyone: its pages go back, and
        its report (with the error) goes out with the next step's."""
        if self.outputs.fail(req, message):
            self.scheduler.remove(req.seqs)
            self.unreported[req.request_id] = req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.unreported)

    def append_forced(self, request_id: str, index: int, token_ids: list[int]) -> None:
        """Append tokens to an unfinished sequence without sampling them (jump-forward's forced text).

        The next step computes their KV in one forward, with the token sampled before them, and samples the
        next token after the last of them. They count as generated tokens (``SequenceState.forced`` of
        them); a stop string or stop token inside them ends the sequence there, tokens and text alike.
        """
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs) or req.seqs[index].finished:
            raise ValueError(f"no unfinished sequence {index} of request {request_id!r}")
        s, token_ids = req.seqs[index], list(token_ids)
        check_forced(s, token_ids, vocab=self.cfg.vocab_size, context=self.cfg.max_position_embeddings)
        if s.grammar is not None:
            s.grammar.accept_all(token_ids)
        self.stats.forced_tokens += self.outputs.append_forced(s, token_ids)
        if s.finished:  # a stop inside the text: it ends now (between steps), reported with the next step
            try:
                self.outputs.finish(s)
            except StageError as e:
                self._fail(req, failure_message(e.stage, e.cause))
                return
            self._release([s])
            self.kv.flush_events()  # its pages left the tree between steps: a router hears of it now
            self.unreported[req.request_id] = req

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run, update; returns the reports of the requests this step changed, as each one's
        ``output_kind`` asks (by default: the requests finished in this step).

        A failure that belongs to one request (its prefill, sampling, logprobs, fork, stop check,
        detokenization or output) ends that request with ``RequestOutput.error`` set; the others go on
        untouched. Anything else raises (the caller fails everything in flight).
        """
        if self.threads is not None:
            self.threads.check()  # cheap: measures the other load every few seconds at most
        t0 = time.perf_counter()
        try:
            plan = self.last_plan = self.scheduler.schedule()
            result = run_plan(self.runner, self.structured, plan)
            for req, message in (*plan.failed, *result.failed):
                self._fail(req, message)
            fork_failures = self.scheduler.update(result)
        except BaseException:  # Ctrl-C, or every request failing alone: the plan is never committed, so
            self.scheduler.abandon()  # the pages reserved for its forks go back (its tables stay consistent)
            self.kv.flush_events()  # admission may have published pages: a router hears of them now
            self.snapshot = EngineSnapshot.of(self)
            raise
        return self._update(plan, result, fork_failures, t0)

    def _update(self, plan: StepPlan, result: StepResult, fork_failures, t0: float) -> list[RequestOutput]:
        """Everything after the KV commit: fail the requests whose fork failed, append the tokens, give the
        ended sequences' pages back, count, and report every request the step changed."""
        for req, message in fork_failures:
            self._fail(req, message)
        appended = self.outputs.append_step(result, self.structured)
        for req, message in appended.failed:
            self._fail(req, message)
        self._release([s for s in appended.ended if s.request.error is None])
        self.stats.count(plan, result, appended, time.perf_counter() - t0)
        self.stats.preemptions = self.scheduler.preemptions
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.pool.used_pages * self.pool.page_size)
        changed, self.unreported = {**self.unreported, **appended.changed}, {}
        reports = self._report(changed.values())
        self.kv.flush_events()
        self.snapshot = EngineSnapshot.of(self)
        return reports

    def _release(self, ended: list[SequenceState]) -> None:
        """Sequences that ended give their pages back (their computed KV stays in the prefix cache)."""
        self.stats.per_sequence_kv_tokens += sum(s.context_len - 1 for s in ended)
        self.scheduler.remove(ended)

    def _report(self, reqs) -> list[RequestOutput]:
        """The reports of changed requests, each as its ``output_kind`` asks; a finished request leaves the
        engine with its last report (reported once, even if it changed twice)."""
        reports = []
        for req in reqs:
            if req.finished:
                if self.requests.pop(req.request_id, None) is None:
                    continue  # reported already, or aborted
                self.stats.requests_finished += 1
            elif req.params.output_kind is FINAL_ONLY or req.request_id not in self.requests:
                continue
            try:
                reports.append(self.outputs.output(req))
            except Exception as e:
                self._fail(req, failure_message("output building", e))
                self.unreported.pop(req.request_id, None)  # reported here, now
                self.requests.pop(req.request_id, None)
                reports.append(self.outputs.failed_output(req))
        return reports
