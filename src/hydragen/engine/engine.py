"""The engine: a persistent prefix cache, and a step that plans, runs one packed forward, and commits.

``add_request`` queues a request's n sequences. Every ``step``:

1. the scheduler builds a frozen plan (admission, prefill chunks, decode tokens, extends, forks,
   preemption) and nothing touches pages or the prefix tree until 3;
2. the model runner runs the plan as one packed forward; if it raises, each request's work runs alone to
   find the culprit, and only that request ends;
3. the scheduler commits the plan (KV computed, pages published to the prefix tree, forks copied);
4. the sampled tokens are appended by the output processor; ended sequences give their pages back, their
   computed KV staying in the prefix tree.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hydragen.engine.config import EngineConfig
from hydragen.engine.isolation import EngineBroken, failure_message, forward_each_request_alone
from hydragen.engine.model_runner import ModelRunner
from hydragen.engine.output_processor import OutputProcessor, StageError
from hydragen.engine.outputs import RequestOutput, RequestOutputKind
from hydragen.engine.request_checks import check_fits, check_request, first_bad_token
from hydragen.engine.sampler import derive_seed
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.scheduler import Scheduler, Sharing
from hydragen.engine.sequence import Request, Sequence
from hydragen.engine.sharing import DEFAULT_MIN_SHARED_READS
from hydragen.engine.stats import EngineSnapshot, EngineStats
from hydragen.engine.step_plan import StepPlan
from hydragen.kv.manager import KVManager
from hydragen.kv.pool import PagePool
from hydragen.kv.radix import PageEvent
from hydragen.model.linear import keeps_quantized_weights
from hydragen.model.loader import resolve_device, resolve_dtype, resolve_kv_dtype
from hydragen.structured.controller import StructuredOutputs
from hydragen.structured.matcher import GrammarViolation

DEFAULT_KV_CACHE_TOKENS = 65536
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
log = logging.getLogger("hydragen.engine")


@dataclass
class BatchView:
    """The last step's work as tests and benchmarks inspect it: sequences in depth-first order, shared
    runs (page_lo, page_hi, lo, hi) over them."""

    seqs: list[Sequence]
    shared: list[tuple[int, int, int, int]]


class Engine:
    def __init__(self, model, cfg, tokenizer, config: EngineConfig, *, parallel=None):
        """``cfg``: the model's configuration; ``config``: the engine's settings (``EngineConfig``; a
        ``kv_cache_tokens`` of None gets a 65,536-token cache). ``parallel``: a tensor-parallel group's rank 0
        (``hydragen.distributed.launcher.TensorParallel``), which builds the page pool and model runner that
        drive the other ranks; None runs in-process."""
        self.cfg, self.config = cfg, config
        self.device = device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype)
        quantized = model is not None and keeps_quantized_weights(model)  # (a test's fake engine has none)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, quantized)
        self.prefix_sharing = config.prefix_sharing
        page_size = config.page_size
        num_pages = max(1, (config.kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS) // page_size)
        make_pool = PagePool if parallel is None else parallel.make_pool
        self.pool = make_pool(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device
        )
        self.kv = KVManager(self.pool)
        min_shared_reads = config.min_shared_reads
        self.scheduler = Scheduler(
            self.kv,
            Sharing(enabled=config.prefix_sharing, limit=config.share_limit),
            max_num_seqs=config.max_num_seqs,
            prefill_chunk=config.prefill_chunk,
            prefill_budget=config.prefill_budget,
            max_wait_steps=config.max_wait_steps,
            min_shared_reads=DEFAULT_MIN_SHARED_READS if min_shared_reads is None else min_shared_reads,
        )
        make_runner = ModelRunner if parallel is None else parallel.make_runner
        self.runner = make_runner(model, cfg, self.pool, device, config.attention)
        eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set(cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, eos, cfg.max_position_embeddings)
        self.structured = StructuredOutputs(
            tokenizer, cfg.vocab_size, eos, config.jump_forward, config.literal_json_schema
        )
        self.requests: dict[str, Request] = {}
        self.failed: list[Request] = []  # requests ended by an error, reported by the next step()
        self.ended: list[Sequence] = []  # sequences ended between steps (a stop inside extended text)
        self.stats = EngineStats()
        self.last_plan = StepPlan()
        self.snapshot = EngineSnapshot.of(self)
        self.threads = None  # a cpu_threads.ThreadGovernor, when the caller wants the thread count managed
        self._ids = itertools.count()

    # ---- views ----------------------------------------------------------------------------------
    tree = property(lambda self: self.kv.tree)
    step_count = property(lambda self: self.scheduler.step_count)
    min_shared_reads = property(lambda self: self.scheduler.min_shared_reads)

    @property
    def batch(self) -> BatchView:
        p = self.last_plan
        return BatchView([w.seq for w in p.work], [(r.page_lo, r.page_hi, r.lo, r.hi) for r in p.shared])

    @property
    def sampler(self):
        return self.runner.sampler

    @sampler.setter
    def sampler(self, fn) -> None:
        self.runner.sampler = fn

    @property
    def tokenizer(self):
        return self.outputs.tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:  # tests swap in a faulty one
        self.outputs.tokenizer = tok

    @property
    def eos_ids(self) -> set[int]:
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.outputs.eos_ids = set(ids)

    @property
    def model(self):
        return self.runner.model

    @model.setter
    def model(self, model) -> None:
        self.runner.model = model

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
    ) -> Request:
        """Queue a request. Raises ``ParamError`` (a ValueError naming the parameter) for a request the
        engine could never finish: bad token ids, too long for the context, or too big for the KV cache."""
        check_request(prompt_ids, params, vocab=self.cfg.vocab_size, context=self.cfg.max_position_embeddings)
        check_fits(
            self.sequence_kv_need(len(prompt_ids), params.max_tokens),
            self.pool.num_slots,
            self.pool.page_size,
        )
        rid = str(next(self._ids)) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, list(prompt_ids), params, arrival_time=time.perf_counter())
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        req.seqs = [Sequence(req, i, derive_seed(base_seed, i)) for i in range(params.n)]
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

    def fail(self, req: Request, message: str) -> None:
        """End a request with an error instead of crashing the engine for everyone."""
        if req.error is not None:
            return
        req.error = message
        for s in req.seqs:
            self.outputs.end(s, "error")
        self.scheduler.remove(req.seqs)
        self.failed.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.failed or self.ended)

    def extend(self, request_id: str, index: int, token_ids: list[int]) -> None:
        """Append tokens to an unfinished sequence without sampling them (jump-forward's forced text).

        The next step computes their KV in one forward, as a multi-token extend, and samples the next
        token after the last of them. They count as generated tokens (``Sequence.forced`` of them); a stop
        string or stop token inside them ends the sequence there, tokens and text alike.
        """
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs) or req.seqs[index].finished:
            raise ValueError(f"no unfinished sequence {index} of request {request_id!r}")
        s = req.seqs[index]
        token_ids = list(token_ids)
        if first_bad_token(token_ids, self.cfg.vocab_size) is not None:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if len(s.generated) + len(token_ids) >= s.params.max_tokens:
            raise ValueError("extend would reach max_tokens: no room left to sample after it")
        if s.context_len + len(token_ids) >= self.cfg.max_position_embeddings:
            raise ValueError(
                f"extend would reach the model's context of {self.cfg.max_position_embeddings} tokens: "
                "no room left to sample after it"
            )
        if s.grammar is not None:
            if not s.grammar.fits(token_ids):
                raise ValueError("the tokens do not fit the request's structured-output constraint")
            s.grammar.accept_all(token_ids)
        self._append_forced(s, token_ids)
        if s.finished:
            self.ended.append(s)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run one packed forward, commit, sample; returns the reports of the requests this step
        changed, as each one's ``output_kind`` asks (by default: the requests finished in this step).

        A failure that belongs to one request (its prefill, sampling, logprobs, stop check,
        detokenization or output) ends that request with ``RequestOutput.error`` set; the others go on
        untouched. Anything else raises (the caller fails everything in flight).
        """
        if self.threads is not None:
            self.threads.check()  # cheap: measures the other load every few seconds at most
        t0 = time.perf_counter()
        changed: dict[str, Request] = {}
        if self.ended:
            changed.update(self._release_ended(self.ended))
            self.ended = []
        try:
            plan = self.scheduler.schedule()
            self.last_plan = plan
            self._count_admissions()
            for s, e in self.scheduler.failures:
                self.fail(s.request, failure_message("scheduling", e))
            logits = None
            if not plan.empty:
                logits = self._forward(plan)
                plan = self.last_plan  # without the requests the forward failed
                self.scheduler.commit(plan)
        except BaseException:  # Ctrl-C, or every request failing alone: the plan is never committed, so
            self.scheduler.abandon()  # the pages reserved for its forks go back (its tables stay consistent)
            self.kv.flush_events()  # admission may have published pages: a router hears of them now
            self.snapshot = EngineSnapshot.of(self)
            raise
        if not plan.empty:
            for s, e in self.scheduler.failures:  # a fork that could not copy its leader's KV
                self.fail(s.request, failure_message("fork", e))
            if plan.samplers and logits is not None:
                changed.update(self._sample(plan, logits))
            self.stats.count_step(plan, time.perf_counter() - t0)
        self.stats.preemptions = self.scheduler.preemptions
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.pool.used_pages * self.pool.page_size)
        failed, self.failed = self.failed, []
        outputs = self._report([*failed, *changed.values()])
        self.kv.flush_events()
        self.snapshot = EngineSnapshot.of(self)
        return outputs

    def _forward(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's packed forward; the logits of its sampling items. If it raises, each request's work
        runs alone to find the ones that fail: only those requests end (logged), the rest of the plan goes
        on with their logits. If every request of several fails alone, or the engine itself broke, it
        raises (the caller fails everything in flight)."""
        try:
            batch = self.runner.pack(plan)
            return self.runner.forward(batch)
        except EngineBroken:
            raise
        except Exception as e:
            log.warning("a step failed (%s); running each request alone to find the culprit", e)
            alone = forward_each_request_alone(self.runner, plan, e)
            for req, message in alone.failures.items():
                self.fail(req, message)
            self.scheduler.abandon(alone.dropped)
            self.last_plan = alone.plan
            return alone.logits

    def _count_admissions(self) -> None:
        for s, hit in self.scheduler.admitted:
            if hit is None:
                hit = s.request.cached_tokens  # a fork: its leader's hit (admitted before it)
            if not s.sched.counted:
                s.sched.counted = True
                self.stats.cache_hit_tokens += hit
                self.stats.prompt_tokens += len(s.prompt_ids)
                s.request.cached_tokens = max(s.request.cached_tokens, hit)

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> dict[str, Request]:
        """Sample, append, check stops; per-request work is guarded so a failure ends its request alone.
        Returns the requests it changed."""
        rows = {}  # work index -> its row of ``logits`` (one per sampling work item, in plan order)
        for i, w in enumerate(plan.work):
            if w.sample:
                rows[i] = len(rows)
        # Forks sample from their leader's row; a request failed after the forward (a fork) samples nothing.
        samplers = [(s, i) for s, i in plan.samplers if s.request.error is None]
        if not samplers:
            return {}
        index = [rows[i] for _, i in samplers]
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
        seqs = [s for s, _ in samplers]
        top = max((p.logprobs for s in seqs if (p := s.params).logprobs is not None), default=None)
        self.structured.mask(logits, seqs)
        tokens, lps, row_errors = self.runner.sample(logits, seqs, top)
        token_list = tokens.tolist()
        errors: dict[int, tuple[Request, str]] = {}
        for i, message in row_errors.items():
            errors.setdefault(id(seqs[i].request), (seqs[i].request, message))
        finished: list[Sequence] = []
        for i, (s, t) in enumerate(zip(seqs, token_list, strict=True)):
            if id(s.request) in errors:
                continue
            try:
                want = lps[i] if lps is not None and s.params.logprobs is not None else None
                self.stats.generated_tokens += 1
                if s.grammar is not None:
                    done = self._append_structured(s, t, want)
                else:
                    done = self.outputs.append(s, t, want)
                if done:
                    finished.append(s)
            except StageError as e:
                errors.setdefault(id(s.request), (s.request, failure_message(e.stage, e.cause)))
            except Exception as e:
                errors.setdefault(id(s.request), (s.request, failure_message("stop check", e)))
        for req, message in errors.values():
            self.fail(req, message)
        self._release_ended([s for s in finished if id(s.request) not in errors])
        return {s.request.request_id: s.request for s in seqs if s.request.error is None}

    def _release_ended(self, seqs: list[Sequence]) -> dict[str, Request]:
        """Flush the ended sequences' text and give their pages back; returns their requests."""
        ok = []
        for s in seqs:
            if s.request.error is not None:
                continue
            try:
                self.outputs.finish(s)
                self.stats.per_sequence_kv_tokens += s.context_len - 1
                ok.append(s)
            except StageError as e:
                self.fail(s.request, failure_message(e.stage, e.cause))
            except Exception as e:
                self.fail(s.request, failure_message("detokenization", e))
        self.scheduler.remove(ok)
        return {s.request.request_id: s.request for s in ok}

    def _append_structured(self, s: Sequence, token: int, logprobs: dict | None) -> bool:
        """Append a constrained sequence's sampled token and what jump-forward adds after it; returns
        True when the sequence is finished. A token that is not the one sampled (a boundary re-split,
        forced text) gets the logprobs entry ``{token: None}``: no distribution was sampled for it."""
        try:
            tokens = self.structured.after_sample(s, token)
        except GrammarViolation as e:
            raise StageError("structured outputs", e) from e
        first, forced = tokens[0], tokens[1:]
        if logprobs is not None:  # alternatives the constraint excluded have probability 0: not listed
            logprobs = {t: lp for t, lp in logprobs.items() if lp != float("-inf")}
        if first != token:
            self._append_forced(s, [first])
        else:
            self.outputs.append(s, first, logprobs)
        if s.finished:
            return True
        room = s.params.max_tokens - len(s.generated)
        forced = forced[: max(0, min(room, self.cfg.max_position_embeddings - s.context_len))]
        if forced and self._append_forced(s, forced):
            return True
        if s.grammar.done:  # the output is complete: end here instead of sampling an EOS next
            self.outputs.end(s, "stop")
        return s.finished

    def _append_forced(self, s: Sequence, tokens: list[int]) -> bool:
        kept = self.outputs.append_forced(s, tokens)
        self.stats.forced_tokens += kept
        return s.finished

    def _report(self, reqs: list[Request]) -> list[RequestOutput]:
        """The reports of requests this step changed, each as its ``output_kind`` asks; a finished request
        leaves the engine with its last report (reported once, even if it changed twice)."""
        reports = []
        for req in dict.fromkeys(reqs):
            if req.finished:
                if self.requests.pop(req.request_id, None) is None:
                    continue  # reported already, or aborted
                self.stats.requests_finished += 1
            elif req.params.output_kind is FINAL_ONLY or req.request_id not in self.requests:
                continue
            try:
                reports.append(self.outputs.output(req))
            except Exception as e:
                self.fail(req, failure_message("output building", e))
                self.failed.remove(req)  # reported here, now
                self.requests.pop(req.request_id, None)
                reports.append(self.outputs.failed_output(req))
        return reports
