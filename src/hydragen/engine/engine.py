"""The step-driven engine: admit requests (prefill each new tree node once), then decode step by step.

``add_request`` queues; each ``step`` admits what fits (prefix-tree insert, prefill of uncached nodes,
rebuild of the decode batch) and runs one decode step for every running sequence. The offline
``LLM`` drives it to completion; a server can drive it the same way.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from dataclasses import dataclass

import torch

from hydragen.attention.shared_prefix import shared_prefix_attention
from hydragen.engine.batch import DecodeBatch
from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sampler import Sampler, derive_seed
from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.sequence import Request, Sequence
from hydragen.kv.pool import KVPool, OutOfSlots
from hydragen.kv.radix import Node, RadixTree


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # sum over sequences of prompt length
    prefill_tokens: int = 0  # prompt tokens actually run through the model
    cache_hit_tokens: int = 0  # prompt tokens found already cached when a request arrived
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    per_sequence_kv_tokens: int = 0  # KV tokens the finished sequences would hold as private copies
    peak_kv_tokens: int = 0  # most KV tokens stored at once (tree nodes + private tails)

    @property
    def shared_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens


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
        prefill_chunk: int = 2048,
    ):
        if attention not in ("auto", "fused", "torch", "none"):
            raise ValueError(f"attention must be 'auto', 'fused', 'torch' or 'none', got {attention!r}")
        self.model, self.cfg, self.tokenizer, self.device = model, cfg, tokenizer, device
        self.prefix_sharing, self.attention_impl = prefix_sharing, attention
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.scale = cfg.head_dim**-0.5
        self.pool = KVPool(cfg.num_layers, kv_cache_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.tree = RadixTree(self.pool)
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self.batch: DecodeBatch | None = None
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer is not None else set(cfg.eos_token_ids)
        self.vocab_limit = max(cfg.vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [
            t
            for t in prompt_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size
        ]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {self.cfg.vocab_size})")
        ctx = self.cfg.max_position_embeddings
        if len(prompt_ids) >= ctx:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {ctx} tokens")
        need = len(prompt_ids) + params.n * (len(prompt_ids) + params.max_tokens + 1)
        if need > self.pool.num_slots:
            raise ValueError(
                f"request needs up to {need} KV slots but the cache has {self.pool.num_slots}; "
                "raise kv_cache_tokens or lower n/max_tokens"
            )
        req = Request(
            str(next(self._ids)) if request_id is None else request_id, prompt, list(prompt_ids), params
        )
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        req.seqs = [Sequence(req, i, derive_seed(base_seed, i)) for i in range(params.n)]
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or (self.batch is not None and bool(self.batch.seqs))

    # ---- admission and prefill ----------------------------------------------------------------
    def _alloc(self, n: int) -> int:
        """Allocate n contiguous slots, evicting least-recently-used cached prefixes as needed."""
        while True:
            try:
                return self.pool.alloc(n)
            except OutOfSlots:
                if self.tree.evict(n) == 0:
                    raise

    def _prefill_node(self, node: Node) -> None:
        """Compute and store node's KV once; its queries attend to the ancestors' KV in place."""
        slot = self._alloc(len(node.tokens))
        ancestors = _coalesce([(n.slot, n.slot + len(n.tokens)) for n in node.path()[:-1]])
        k_pool, v_pool = self.pool.k, self.pool.v
        for c0 in range(0, len(node.tokens), self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, len(node.tokens))
            ids = torch.tensor(node.tokens[c0:c1], device=self.device)
            pos = torch.arange(node.start_pos + c0, node.start_pos + c1, device=self.device)
            slots = torch.arange(slot + c0, slot + c1, device=self.device)

            def attend(layer, q, k, v, c1=c1, slots=slots):
                k_pool[layer].index_copy_(0, slots, k)
                v_pool[layer].index_copy_(0, slots, v)
                if self.attention_impl == "none":
                    return torch.zeros_like(q)
                pk = [k_pool[layer, a:b].unsqueeze(0) for a, b in ancestors]
                pv = [v_pool[layer, a:b].unsqueeze(0) for a, b in ancestors]
                own_k = k_pool[layer, slot : slot + c1].unsqueeze(0)
                own_v = v_pool[layer, slot : slot + c1].unsqueeze(0)
                return shared_prefix_attention(
                    q.unsqueeze(0), pk, pv, own_k, own_v, scale=self.scale, impl=self.attention_impl
                )[0]

            self.model(ids, pos, attend)
        self.tree.assign_kv(node, slot)
        self.stats.prefill_tokens += len(node.tokens)

    def _admit(self) -> None:
        """Admit waiting requests in order while memory and the batch-size limit allow."""
        running = self.batch.seqs if self.batch is not None else []
        t0 = time.perf_counter()
        admitted: list[Request] = []
        while self.waiting:
            req = self.waiting[0]
            if len(running) + sum(len(r.seqs) for r in admitted) + len(req.seqs) > self.max_num_seqs:
                break
            try:
                self._prefill_request(req)
            except OutOfSlots:
                if admitted or running:
                    break  # wait for running sequences to free memory
                raise
            self.waiting.popleft()
            admitted.append(req)
        while admitted:
            new = [s for r in admitted for s in r.seqs]
            try:
                self._decide_cuts(running, new)
                self._rebuild(running, new)
                break
            except OutOfSlots:
                if len(admitted) == 1 and not running:
                    raise
                req = admitted.pop()  # too much at once: the last one waits for the next step
                self._unadmit(req)
                self.waiting.appendleft(req)
        for req in admitted:
            self.stats.cache_hit_tokens += req.cached_tokens * len(req.seqs)
            self.stats.prompt_tokens += len(req.prompt_ids) * len(req.seqs)
            self.stats.prefill_tokens += len(req.seqs)  # the last prompt token, run once per sequence
            if req.private_tree is not None:  # sharing off: each sequence holds its own copy now
                for s in req.seqs:
                    s.node = None
                req.private_tree.clear()
                req.private_tree = None
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _prefill_request(self, req: Request) -> None:
        """Insert prompt[:-1] into the tree, prefill its uncached nodes parent-first, pin the path."""
        tree = self.tree if self.prefix_sharing else RadixTree(self.pool)
        shared = req.prompt_ids[:-1]
        _, req.cached_tokens = tree.match(shared)
        node = tree.insert(shared)
        tree.pin(node, len(req.seqs))  # before prefill, so eviction cannot take the path from under us
        try:
            for n in node.path():
                if not n.has_kv:
                    self._prefill_node(n)
        except OutOfSlots:
            tree.pin(node, -len(req.seqs))
            raise
        req.private_tree = None if self.prefix_sharing else tree
        for s in req.seqs:
            s.node = node if node.parent is not None else None

    def _unadmit(self, req: Request) -> None:
        tree = req.private_tree or self.tree
        if req.seqs[0].node is not None:
            tree.pin(req.seqs[0].node, -len(req.seqs))
        for s in req.seqs:
            s.node, s.cut, s.tail_len = None, 0, 0
        if req.private_tree is not None:
            req.private_tree.clear()
            req.private_tree = None

    def _decide_cuts(self, running: list[Sequence], new: list[Sequence]) -> None:
        """Per new sequence, how much of its prompt is read from shared nodes (the cost rule).

        A node is shared when at least two sequences of the batch hold it; everything below the
        deepest such node is copied once into the sequence's own tail. Sharing off: nothing is shared.
        """
        if not self.prefix_sharing:
            return
        holders: dict[int, int] = {}
        for s in running + new:
            for n in s.node.path() if s.node is not None else ():
                holders[id(n)] = holders.get(id(n), 0) + 1
        for s in new:
            s.cut = 0
            for n in s.node.path() if s.node is not None else ():
                if holders[id(n)] < 2:
                    break
                s.cut = n.end_pos

    def _rebuild(self, running: list[Sequence], new: list[Sequence]) -> None:
        """New tail block for running + new sequences (DFS order); tails copied in one indexed op."""
        old = self.batch
        old_rows = [s.row for s in running]
        seqs = sorted(running + new, key=lambda s: s.order_key)
        cap = max(s.max_len - s.cut for s in seqs)
        batch = DecodeBatch(self.pool, seqs, cap, self._alloc(len(seqs) * cap), self.device)
        src, dst = [], []
        for s, old_row in zip(running, old_rows, strict=True):
            src.append(torch.arange(s.tail_len) + old.base + old_row * old.cap)
            dst.append(torch.arange(s.tail_len) + batch.base + s.row * cap)
        for s in new:
            runs = [
                (n.slot, len(n.tokens))
                for n in (s.node.path() if s.node is not None else ())
                if n.start_pos >= s.cut
            ]
            priv = [torch.arange(a, a + n) for a, n in runs]
            if priv:
                p = torch.cat(priv)
                src.append(p)
                dst.append(torch.arange(len(p)) + batch.base + s.row * cap)
                s.tail_len = len(p)
        if src:
            self.pool.copy_slots(torch.cat(dst).to(self.device), torch.cat(src).to(self.device))
        if old is not None:
            old.release()
        batch.refresh()
        self.batch = batch
        self.next_tokens = torch.tensor(
            [s.generated[-1] if s.generated else s.prompt_ids[-1] for s in seqs],
            dtype=torch.long,
            device=self.device,
        )
        self._sampling_state()

    def _sampling_state(self) -> None:
        seqs, dev = self.batch.seqs, self.device
        ps = [s.request.params for s in seqs]
        self.s_temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        self.s_top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
        self.s_top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        self.s_seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev)
        self.s_steps = torch.tensor([len(s.generated) for s in seqs], dtype=torch.long, device=dev)
        self.s_flags = (
            any(p.temperature > 0 for p in ps),
            any(p.top_k > 0 for p in ps),
            any(p.top_p < 1 for p in ps),
        )
        self.s_logprobs = max((p.logprobs for p in ps if p.logprobs is not None), default=None)

    # ---- decoding -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one decode step; returns the requests that finished in this step."""
        self._admit()
        batch = self.batch
        if batch is None or not batch.seqs:
            return []
        t0 = time.perf_counter()
        slots = batch.begin_step()
        k_pool, v_pool, impl = self.pool.k, self.pool.v, self.attention_impl

        def attend(layer, q, k, v):
            k_pool[layer].index_copy_(0, slots, k)
            v_pool[layer].index_copy_(0, slots, v)
            if impl == "none":
                return torch.zeros_like(q)
            return batch.attention(layer, q, self.scale, impl)

        hidden = self.model(self.next_tokens, batch.positions, attend)
        logits = self.model.logits(hidden)
        tokens = self.sampler(
            logits, self.s_temp, self.s_top_k, self.s_top_p, self.s_seeds, self.s_steps, *self.s_flags
        )
        batch.end_step()
        self.stats.peak_kv_tokens = max(
            self.stats.peak_kv_tokens, self.tree.cached_tokens + batch.tail_tokens
        )
        self.s_steps += 1
        self.next_tokens = tokens
        token_list = tokens.tolist()
        logprob_rows = self._logprobs(logits, tokens) if self.s_logprobs is not None else None
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self.stats.generated_tokens += len(token_list)
        done: list[Request] = []
        for i, (s, t) in enumerate(zip(batch.seqs, token_list, strict=True)):
            s.generated.append(t)
            if logprob_rows is not None and s.request.params.logprobs is not None:
                s.logprobs = s.logprobs or []
                s.logprobs.append(logprob_rows[i])
            if self._check_finish(s, t):
                self._finish_sequence(s)
                if s.request.finished:
                    done.append(s.request)
        if any(s.finished for s in batch.seqs):
            keep = torch.tensor([not s.finished for s in batch.seqs], device=self.device)
            batch.drop_finished()
            self.next_tokens = self.next_tokens[keep]
            for name in ("s_temp", "s_top_k", "s_top_p", "s_seeds", "s_steps"):
                setattr(self, name, getattr(self, name)[keep])
            if batch.seqs and batch.dead_fraction >= 0.5:
                self._rebuild(batch.seqs, [])  # compact: tails move once into a block of live rows
            elif not batch.seqs:
                batch.release()
                self.batch = None
        return [self._output(r) for r in done]

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> list[dict[int, float]]:
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        rows = [{t: c} for t, c in zip(tokens.tolist(), chosen, strict=True)]
        if self.s_logprobs:
            top = logp.topk(self.s_logprobs, dim=-1)
            for row, ids, vals in zip(rows, top.indices.tolist(), top.values.tolist(), strict=True):
                row.update(zip(ids, vals, strict=True))
        return rows

    def _check_finish(self, s: Sequence, token: int) -> bool:
        p = s.request.params
        if not p.ignore_eos and token in self.eos_ids:
            s.finish_reason, s.stop_reason = "stop", None
        elif p.stop_token_ids and token in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        elif p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(s.generated)
            window = len(s.text) - max(len(x) for x in p.stop)
            hits = [(i, x) for x in p.stop if (i := text.find(x, max(0, window))) >= 0]
            s.text = text
            if hits:
                i, x = min(hits)
                s.text = text[:i]
                s.finish_reason, s.stop_reason = "stop", x
        if s.finish_reason is None and (
            len(s.generated) >= p.max_tokens
            or len(s.prompt_ids) + len(s.generated) >= self.cfg.max_position_embeddings
        ):
            s.finish_reason = "length"
        return s.finish_reason is not None

    def _finish_sequence(self, s: Sequence) -> None:
        if s.node is not None:
            self.tree.pin(s.node, -1)
        self.stats.per_sequence_kv_tokens += len(s.prompt_ids) + len(s.generated) - 1
        if self.tokenizer is not None and not (s.finish_reason == "stop" and isinstance(s.stop_reason, str)):
            ids = s.generated[:-1] if s.finish_reason == "stop" else s.generated
            s.text = self.tokenizer.decode(ids)

    def _output(self, r: Request) -> RequestOutput:
        outs = [
            CompletionOutput(s.index, s.text, list(s.generated), s.finish_reason, s.logprobs, s.stop_reason)
            for s in r.seqs
        ]
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, outs, True, r.cached_tokens)


def _coalesce(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge touching slot runs so a chain of ancestors is read as one block."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
