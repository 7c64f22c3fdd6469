"""The engine loop: scheduler -> model runner -> output processor, over a persistent prefix cache.

``add_request`` queues a request's n sequences; every ``step`` the scheduler plans (admission, prefill
chunks, joins, growth, preemption), the runner runs the plan as one packed forward and samples, and the
output processor appends tokens and ends sequences, whose KV the KV manager hands to the prefix tree.
"""

from __future__ import annotations

import importlib.util
import itertools
import secrets
import time
from dataclasses import dataclass

import torch

from hydragen.engine.isolation import failure_message
from hydragen.engine.model_runner import ModelRunner
from hydragen.engine.output_processor import OutputProcessor, StageError
from hydragen.engine.outputs import RequestOutput
from hydragen.engine.request_checks import check_fits, check_request, first_bad_token
from hydragen.engine.sampler import derive_seed
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.scheduler import Scheduler, StepPlan
from hydragen.engine.sequence import Request, Sequence
from hydragen.engine.stats import EngineStats
from hydragen.kv.manager import (  # noqa: F401  (re-exported for the benchmarks)
    DEFAULT_MIN_SHARED_READS,
    MERGE_ROW_TOKENS,
    Item,
    KVManager,
    sharing_pays,
)
from hydragen.kv.pool import PagePool
from hydragen.structured.controller import StructuredOutputs
from hydragen.structured.matcher import GrammarViolation

DEFAULT_PAGE_SIZE = 16


def triton_available() -> bool:
    """Whether the optional Triton kernels can be used (triton importable; imported lazily)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


@dataclass
class BatchView:
    """The running batch as tests and benchmarks inspect it: sequences in DFS order, shared items."""

    seqs: list[Sequence]
    items: list[Item]


class Engine:
    def __init__(
        self,
        model,
        cfg,
        tokenizer,
        device,
        dtype,
        *,
        prefix_sharing: bool = True,
        attention: str = "auto",
        kv_cache_tokens: int = 65536,
        max_num_seqs: int = 256,
        prefill_chunk: int = 512,
        prefill_budget: int = 2048,
        max_wait_steps: int = 64,
        share_limit: int | None = None,
        min_shared_reads: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        parallel=None,
        jump_forward: bool = True,
    ):
        """``parallel``: a tensor-parallel group's rank 0 (``hydragen.distributed.launcher.TensorParallel``),
        which builds the page pool and model runner that drive the other ranks; None runs in-process."""
        if attention not in ("auto", "fused", "torch", "triton", "none"):
            raise ValueError(
                f"attention must be 'auto', 'fused', 'torch', 'triton' or 'none', got {attention!r}"
            )
        if attention == "triton" and not triton_available():
            raise ValueError("attention='triton' needs the triton package (pip install triton)")
        if min_shared_reads is None:
            min_shared_reads = DEFAULT_MIN_SHARED_READS
        if not isinstance(min_shared_reads, int) or min_shared_reads < 0:
            raise ValueError(f"min_shared_reads must be a non-negative integer, got {min_shared_reads!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.cfg, self.device = cfg, device
        self.prefix_sharing = prefix_sharing
        num_pages = max(1, kv_cache_tokens // page_size)
        make_pool = PagePool if parallel is None else parallel.make_pool
        self.pool = make_pool(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        self.kv = KVManager(self.pool, prefix_sharing, min_shared_reads, share_limit)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            prefill_chunk=prefill_chunk,
            prefill_budget=prefill_budget,
            max_wait_steps=max_wait_steps,
        )
        make_runner = ModelRunner if parallel is None else parallel.make_runner
        self.runner = make_runner(model, cfg, self.kv, device, attention)
        eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set(cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, eos, cfg.max_position_embeddings)
        self.structured = StructuredOutputs(tokenizer, cfg.vocab_size, eos, jump_forward)
        self.requests: dict[str, Request] = {}
        self.failed: list[Request] = []  # requests ended by an error, reported by the next step()
        self.stats = EngineStats()
        self.threads = None  # a cpu_threads.ThreadGovernor, when the caller wants the thread count managed
        self._ids = itertools.count()

    # ---- views and knobs (scheduler / KV manager state under their old names) ----------------------
    tree = property(lambda self: self.kv.tree)
    waiting = property(lambda self: self.scheduler.waiting)
    prefilling = property(lambda self: self.scheduler.prefilling)
    step_count = property(lambda self: self.scheduler.step_count)
    num_running = property(lambda self: len(self.scheduler.running))
    min_shared_reads = property(lambda self: self.kv.min_shared_reads)

    @property
    def batch(self) -> BatchView | None:
        running = self.scheduler.running
        return BatchView(list(running), list(self.scheduler._plan_items)) if running else None

    @property
    def sampler(self):
        return self.runner.sampler

    @sampler.setter
    def sampler(self, fn) -> None:
        self.runner.sampler = fn

    def _knob(name: str, owner: str):  # noqa: N805  (a property factory used in the class body)
        return property(
            lambda self: getattr(getattr(self, owner), name),
            lambda self, value: setattr(getattr(self, owner), name, value),
        )

    prefill_budget = _knob("prefill_budget", "scheduler")
    prefill_chunk = _knob("prefill_chunk", "scheduler")
    max_wait_steps = _knob("max_wait_steps", "scheduler")
    max_num_seqs = _knob("max_num_seqs", "scheduler")
    share_limit = _knob("share_limit", "kv")
    eos_ids = _knob("eos_ids", "outputs")
    tokenizer = _knob("tokenizer", "outputs")
    model = _knob("model", "runner")
    del _knob

    def sequence_kv_need(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots (whole pages) one sequence needs to be sure to finish when it runs alone: its prompt
        in the tree plus its own pages (with sharing off, its own copy of the whole context instead)."""
        pool = self.pool
        new = min(max_tokens, self.cfg.max_position_embeddings - prompt_len)
        own = new if self.prefix_sharing else prompt_len - 1 + new
        return (pool.pages_for(prompt_len - 1) + pool.pages_for(own)) * pool.page_size

    def kv_usage(self) -> dict:
        """KV pages in use, held by the prefix cache, and in all: after every request ends, used == cached."""
        return self.kv.usage()

    def text_of(self, s: Sequence) -> str:
        """The sequence's final text so far: stable (no later token changes it) and stop-safe."""
        return self.outputs.text_of(s)

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
            if not s.finished:
                s.finish_reason = "abort"
        self._release([s for s in req.seqs])
        return True

    def _release(self, seqs: list[Sequence]) -> None:
        """Take sequences out of the scheduler and give their KV back (cached where sharing is on)."""
        running = {id(s) for s in self.scheduler.running}
        self.scheduler.remove(seqs)
        for s in seqs:
            if id(s) in running:
                self.kv.leave(s)
            else:
                self.kv.unpin(s)
        for req in {id(s.request): s.request for s in seqs}.values():
            if req.private_tree is not None and all(x.node is None for x in req.seqs):
                req.private_tree.clear()
                req.private_tree = None

    def fail(self, req: Request, message: str) -> None:
        """End a request with an error instead of crashing the engine for everyone."""
        req.error = message
        for s in req.seqs:
            if not s.finished:
                s.finish_reason = "error"
        self._release(list(req.seqs))
        self.failed.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def extend(self, request_id: str, index: int, token_ids: list[int]) -> None:
        """Append tokens to an unfinished sequence without sampling them (jump-forward's forced text).

        The next step computes their KV in one forward, as a multi-token extend, and samples the next
        token after the last of them. They count as generated tokens (``Sequence.forced`` of them).
        """
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs) or req.seqs[index].finished:
            raise ValueError(f"no unfinished sequence {index} of request {request_id!r}")
        s = req.seqs[index]
        if first_bad_token(token_ids, self.cfg.vocab_size) is not None:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if len(s.generated) + len(token_ids) >= s.request.params.max_tokens:
            raise ValueError("extend would reach max_tokens: no room left to sample after it")
        if s.grammar is not None:
            if not s.grammar.fits(list(token_ids)):
                raise ValueError("the tokens do not fit the request's structured-output constraint")
            s.grammar.accept_all(list(token_ids))
        s.pending += len(token_ids)
        self._append_forced(s, list(token_ids))

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run one packed forward, sample; returns the requests finished in this step.

        A failure that belongs to one request (its prefill, sampling, logprobs, stop check,
        detokenization or output) ends that request with ``RequestOutput.error`` set; the others go on
        untouched. Anything else raises (the caller fails everything in flight).
        """
        if self.threads is not None:
            self.threads.check()  # cheap: measures the other load every few seconds at most
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._count_admissions()
        for s, e in self.scheduler.failures:
            if s.request.error is None and s.request.request_id in self.requests:
                self.fail(s.request, failure_message("join", e))
        done: list[RequestOutput] = []
        if not plan.empty:
            logits, plan = self._forward(plan)
            if plan.decode:
                done += self._decode(plan, logits)
            elapsed = time.perf_counter() - t0
            if plan.prefill:
                self.stats.prefill_seconds += elapsed
            else:
                self.stats.decode_seconds += elapsed
        self.stats.preemptions = self.scheduler.preemptions
        used = self.pool.used_pages * self.pool.page_size
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, used)
        failed = [o for r in self.failed if (o := self._finish_request(r)) is not None]
        self.failed = []
        return failed + done

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, StepPlan]:
        """The step's packed forward. If it raises and the step prefills, the chunks run one at a time
        (parents first) to find the ones that fail; only requests on those prompts end, and the decode
        part then runs alone. Returns the decode logits and the plan that actually ran."""
        try:
            batch = self.runner.pack(plan)
            logits = self.runner.forward(batch)
        except Exception:
            if not plan.prefill:
                raise
            return self._forward_isolating_prefill(plan)
        self._prefilled(plan.prefill)
        self.stats.prefill_tokens += batch.num_prefill_tokens
        self.stats.forward_tokens += len(batch.input_ids)
        return logits, plan

    def _forward_isolating_prefill(self, plan: StepPlan) -> tuple[torch.Tensor | None, StepPlan]:
        broken: dict[int, str] = {}
        ran = []
        for ch in plan.prefill:
            above = next((broken[id(n)] for n in ch.node.path() if id(n) in broken), None)
            if above is not None:
                broken[id(ch.node)] = above
                continue
            try:
                self.runner.forward(self.runner.pack(StepPlan(prefill=[ch])))
            except Exception as e:
                broken[id(ch.node)] = failure_message("prefill", e)
                continue
            self._prefilled([ch])
            self.stats.prefill_tokens += ch.end - ch.start
            ran.append(ch)
        for s in list(self.scheduler.prefilling) + list(self.scheduler.running):
            path = s.node.path() if s.node is not None else []
            why = next((broken[id(n)] for n in path if id(n) in broken), None)
            if why is not None and s.request.error is None:
                self.fail(s.request, why)
        decode = self.scheduler.replan()
        decode.prefill = ran
        logits = self.runner.forward(self.runner.pack(StepPlan(decode=decode.decode, items=decode.items)))
        return (logits if decode.decode else None), decode

    @staticmethod
    def _prefilled(chunks) -> None:
        for ch in chunks:
            ch.node.filled = max(ch.node.filled, ch.end)

    def _count_admissions(self) -> None:
        now = time.monotonic()
        for s, hit in self.scheduler.admitted:
            if s.request.first_scheduled is None:
                s.request.first_scheduled = now
            if not s.counted:
                s.counted = True
                hit = hit if self.prefix_sharing else 0
                self.stats.cache_hit_tokens += hit
                self.stats.prompt_tokens += len(s.prompt_ids)
                self.stats.prefill_tokens += 1  # the last prompt token, fed by the first decode step
                s.request.cached_tokens = max(s.request.cached_tokens, hit)

    def _decode(self, plan: StepPlan, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample, append, check stops; per-request work is guarded so a failure ends its request alone."""
        seqs = plan.decode
        top = max((p.logprobs for s in seqs if (p := s.request.params).logprobs is not None), default=None)
        self.structured.mask(logits, seqs)
        tokens, lps, row_errors = self.runner.sample(logits, seqs, top)
        token_list = tokens.tolist()
        self.stats.decode_steps += 1
        errors: dict[int, tuple[Request, str]] = {}
        for i, message in row_errors.items():
            errors.setdefault(id(seqs[i].request), (seqs[i].request, message))
        finished: list[Sequence] = []
        for i, (s, t) in enumerate(zip(seqs, token_list, strict=True)):
            if id(s.request) in errors:
                continue
            s.pending = 0
            try:
                want = lps[i] if lps is not None and s.request.params.logprobs is not None else None
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
            finally:
                s.pending += 1  # the new token (after any forced ones, already counted)
        for s in finished:
            if id(s.request) not in errors:
                try:
                    self.outputs.finish(s)
                    self.stats.per_sequence_kv_tokens += s.context_len - 1
                except StageError as e:
                    errors.setdefault(id(s.request), (s.request, failure_message(e.stage, e.cause)))
                except Exception as e:
                    errors.setdefault(id(s.request), (s.request, failure_message("detokenization", e)))
        finished = [s for s in finished if id(s.request) not in errors]
        self._release(finished)
        for req, message in errors.values():
            self.fail(req, message)
        return [
            o for s in finished if s.request.finished and (o := self._finish_request(s.request)) is not None
        ]

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
            self.stats.forced_tokens += 1
            s.forced += 1
            logprobs = {first: None} if logprobs is not None else None
        if self.outputs.append(s, first, logprobs):
            return True
        room = s.request.params.max_tokens - len(s.generated)
        forced = forced[: max(0, min(room, self.cfg.max_position_embeddings - s.context_len))]
        if forced:
            s.pending += len(forced)
            self._append_forced(s, forced)
            if s.finished:
                return True
            if len(s.generated) >= s.request.params.max_tokens or s.context_len >= self.outputs.max_context:
                s.finish_reason = "length"
                return True
        if s.grammar.done:  # the output is complete: end here instead of sampling an EOS next
            s.finish_reason, s.stop_reason = "stop", None
        return s.finished

    def _append_forced(self, s: Sequence, tokens: list[int]) -> None:
        self.outputs.append_forced(s, tokens)
        self.stats.forced_tokens += len(tokens)

    def _finish_request(self, req: Request) -> RequestOutput | None:
        if self.requests.pop(req.request_id, None) is None:
            return None
        self.stats.requests_finished += 1
        try:
            return self.outputs.output(req)
        except Exception as e:
            req.error = req.error or failure_message("output building", e)
            return RequestOutput(
                req.request_id, req.prompt, req.prompt_ids, [], True, req.cached_tokens, req.error
            )
