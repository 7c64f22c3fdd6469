"""The step-driven engine: continuous batching over a persistent radix-tree prefix cache.

``add_request`` queues a request's n sequences; every ``step``:

1. **schedules** waiting sequences, longest cached prefix first (the seeds' longest-shared-prefix-first,
   which approximates depth-first order), but any sequence that has waited ``max_wait_steps`` goes first;
2. **prefills** at most ``prefill_budget`` uncached prompt tokens, node by node and chunk by chunk, so a
   long prompt never stalls the running sequences for more than one chunk per step;
3. **joins** fully prefilled sequences into the decode batch (the tails are rebuilt once);
4. **grows** the private tails when one is full; if memory runs out, the newest sequences are
   **preempted**: their KV goes into the prefix tree (nothing is lost unless evicted, then recomputed) and
   they wait to be readmitted;
5. **decodes** one token for every running sequence.

Finished sequences hand the KV of their prompt and generated text to the tree, where later requests find
it, and free the rest of their private slots at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import secrets
import time
from collections import deque
from dataclasses import dataclass

import torch

from hydragen.attention.shared_prefix import shared_prefix_attention
from hydragen.engine.batch import DecodeBatch
from hydragen.engine.isolation import failure_message, map_rows, sample_rows
from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sampler import Sampler, derive_seed
from hydragen.engine.sampling_params import ParamError, SamplingParams
from hydragen.engine.sequence import Request, Sequence
from hydragen.kv.pool import KVPool, OutOfSlots
from hydragen.kv.radix import Node, RadixTree

# The cost rule (``Engine._decide_cuts``): a group of nodes held by h batch sequences is read by one batched
# call when (h - 1) x (tokens - MERGE_ROW_TOKENS) >= min_shared_reads: the KV-token reads it saves per step,
# less the LSE merge of each extra query row (worth about MERGE_ROW_TOKENS reads), must pay for the extra
# call. Fitted on a 2-core CPU (fp32, GQA 9/3/64, tails of 128 and 512, batch 2-256, nodes 16-2048 tokens):
# sharing wins above this line and loses below it (docs/performance.md, "cost rule").
DEFAULT_MIN_SHARED_READS = 2048
MERGE_ROW_TOKENS = 16


def sharing_pays(holders: int, tokens: int, min_shared_reads: int) -> bool:
    """The cost rule for one group of nodes (0 turns it off: everything held by two is shared)."""
    return min_shared_reads == 0 or (holders - 1) * (tokens - MERGE_ROW_TOKENS) >= min_shared_reads


def triton_available() -> bool:
    """Whether the optional Triton kernels can be used (triton importable; imported lazily)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # sum over sequences of prompt length
    prefill_tokens: int = 0  # prompt tokens actually run through the model
    cache_hit_tokens: int = 0  # prompt tokens found already cached when a sequence was scheduled
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    per_sequence_kv_tokens: int = 0  # KV tokens the finished sequences would hold as private copies
    peak_kv_tokens: int = 0  # most KV tokens stored at once (tree nodes + private tails)
    preemptions: int = 0
    requests_finished: int = 0

    @property
    def shared_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def hit_rate(self) -> float:
        """Prompt tokens whose prefill was skipped / prompt tokens: the prefix-cache hit rate.

        Counts both prefixes cached by earlier requests and prefixes that concurrent requests computed
        once together (``cache_hit_tokens`` alone only counts what was complete on arrival).
        """
        return self.shared_prompt_tokens / max(self.prompt_tokens, 1)


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
        tail_growth: int = 128,
        share_limit: int | None = None,
        min_shared_reads: int | None = None,
    ):
        if attention not in ("auto", "fused", "torch", "triton", "none"):
            raise ValueError(
                f"attention must be 'auto', 'fused', 'torch', 'triton' or 'none', got {attention!r}"
            )
        if attention == "triton" and not triton_available():
            raise ValueError("attention='triton' needs the triton package (pip install triton)")
        self.model, self.cfg, self.tokenizer, self.device = model, cfg, tokenizer, device
        self.prefix_sharing = prefix_sharing
        # Decode runs the Triton kernels when asked (opt-in until they are measured on a GPU: issue 5);
        # prefill keeps the partials.
        use_triton = attention == "triton"
        if use_triton:
            from hydragen.attention.triton_kernels import check_device

            check_device(torch.device(device))  # fail here, not in the first decode step
        self.decode_impl = "triton" if use_triton else attention
        self.attention_impl = "auto" if attention == "triton" else attention
        self.max_num_seqs, self.prefill_chunk, self.prefill_budget = (
            max_num_seqs,
            prefill_chunk,
            prefill_budget,
        )
        self.max_wait_steps, self.tail_growth = max_wait_steps, tail_growth
        # Ablation knob (bench tree's one-level mode): read at most this many leading context tokens
        # from shared nodes; deeper shared nodes are copied into each sequence's tail instead.
        self.share_limit = share_limit
        if min_shared_reads is None:
            min_shared_reads = DEFAULT_MIN_SHARED_READS
        if not isinstance(min_shared_reads, int) or min_shared_reads < 0:
            raise ValueError(f"min_shared_reads must be a non-negative integer, got {min_shared_reads!r}")
        self.min_shared_reads = min_shared_reads
        self.scale = cfg.head_dim**-0.5
        self.pool = KVPool(cfg.num_layers, kv_cache_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.tree = RadixTree(self.pool)
        self.sampler = Sampler()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.batch: DecodeBatch | None = None
        self.requests: dict[str, Request] = {}
        self.failed: list[Request] = []  # requests ended by an error, reported by the next step()
        self.prefill_starved = False  # the oldest prefilling sequence found no memory, nothing running
        self.stats = EngineStats()
        self.step_count = 0
        self._ids = itertools.count()
        self._joins = itertools.count()
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer is not None else set(cfg.eos_token_ids)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request. Raises ``ParamError`` (a ValueError naming the parameter) for a request the
        engine could never finish: bad token ids, too long for the context, or too big for the KV cache."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_ids, (list, tuple)):
            raise ParamError("prompt", f"prompt token ids must be a list, got {type(prompt_ids).__name__}")
        if not prompt_ids:
            raise ParamError("prompt", "prompt is empty: at least one token is needed")
        ctx = self.cfg.max_position_embeddings
        if len(prompt_ids) >= ctx:  # before scanning the ids: a huge prompt is refused at once
            raise ParamError(
                "prompt", f"prompt has {len(prompt_ids)} tokens; the model's context is {ctx} tokens"
            )
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ParamError("prompt", f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        bad = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad:
            raise ParamError("stop_token_ids", f"stop token id {bad[0]} is out of range [0, {vocab})")
        need = self.sequence_kv_need(len(prompt_ids), params.max_tokens)
        if need > self.pool.num_slots:
            raise ParamError(
                "max_tokens",
                f"one sequence of this request needs up to {need} KV slots (prompt + max_tokens) but the "
                f"cache has {self.pool.num_slots}; lower max_tokens or the prompt length",
            )
        rid = str(next(self._ids)) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, list(prompt_ids), params)
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        req.seqs = [
            Sequence(req, i, derive_seed(base_seed, i), arrival_step=self.step_count) for i in range(params.n)
        ]
        self.requests[rid] = req
        self.waiting.extend(req.seqs)
        return req

    def sequence_kv_need(self, prompt_len: int, max_tokens: int) -> int:
        """KV slots one sequence needs to be sure to finish when it runs alone (admission is per sequence:
        n sequences that do not fit at once run in waves). With sharing on, everything but its newest
        tokens can live in the prefix tree, read in place; with sharing off it holds a private copy of its
        whole context, and rebuilding that copy briefly needs room for two."""
        total = prompt_len + min(max_tokens, self.cfg.max_position_embeddings - prompt_len)
        return total if self.prefix_sharing else 2 * total

    def kv_usage(self) -> dict:
        """KV pages (token slots): in use, held by the prefix cache, and in all. When no request is
        running, used == cached (anything else is a leak)."""
        return {
            "used": self.pool.allocator.used,
            "cached": self.tree.cached_tokens,
            "total": self.pool.num_slots,
        }

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its pages are freed (its computed KV stays cached)."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        leaving = [s for s in req.seqs if not s.finished]
        for s in leaving:
            s.finish_reason = "abort"
        self._leave(leaving)
        self.waiting = deque(s for s in self.waiting if s.request is not req)
        if req.private_tree is not None:
            req.private_tree.clear()
            req.private_tree = None
        self.requests.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or (self.batch is not None and self.batch.seqs))

    @property
    def num_running(self) -> int:
        return len(self.batch.seqs) if self.batch is not None else 0

    # ---- memory -------------------------------------------------------------------------------
    def _alloc(self, n: int) -> int:
        """Allocate n contiguous slots, evicting least-recently-used cached prefixes as needed."""
        try:
            return self.pool.alloc(n)
        except OutOfSlots:
            trees = self._trees()
            if self.pool.allocator.free + sum(t.evictable_tokens() for t in trees) < n:
                raise  # hopeless: keep the cache instead of flushing it for nothing
        for tree in trees:
            while True:
                try:
                    return self.pool.alloc(n)
                except OutOfSlots:
                    if tree.evict(n) == 0:
                        break
        return self.pool.alloc(n)

    def _trees(self) -> list[RadixTree]:
        """The prefix tree, and with sharing off the requests' own trees (whose unpinned KV, left by
        preempted sequences, is evictable too)."""
        private = [r.private_tree for r in self.requests.values() if r.private_tree is not None]
        return [self.tree, *private]

    def _tree_for(self, s: Sequence) -> RadixTree:
        return self.tree if self.prefix_sharing else s.request.private_tree

    # ---- scheduling and prefill ---------------------------------------------------------------
    def _schedule(self) -> None:
        """Move waiting sequences to prefill: aged ones first, then the longest cached prefix."""
        room = self.max_num_seqs - self.num_running - len(self.prefilling)
        if room <= 0 or not self.waiting or (self.prefill_starved and self.prefilling):
            return
        aged = [s for s in self.waiting if self.step_count - s.arrival_step >= self.max_wait_steps]
        if len(aged) >= room or not self.prefix_sharing:
            chosen = (aged + [s for s in self.waiting if s not in aged])[:room]
        else:
            hits: dict[int, int] = {}
            rest = [s for s in self.waiting if self.step_count - s.arrival_step < self.max_wait_steps]
            for s in rest:  # sequences of one request share a context: match it once
                key = id(s.request) if not s.generated else id(s)
                if key not in hits:
                    hits[key] = self.tree.match_len(s.context[:-1])
            rest.sort(key=lambda s: -hits[id(s.request) if not s.generated else id(s)])
            chosen = aged + rest[: room - len(aged)]
        taken = {id(s) for s in chosen}
        self.waiting = deque(s for s in self.waiting if id(s) not in taken)
        for s in chosen:
            self._start_prefill(s)

    def _start_prefill(self, s: Sequence) -> None:
        req = s.request
        if req.first_scheduled is None:
            req.first_scheduled = time.monotonic()
        if not self.prefix_sharing and req.private_tree is None:
            req.private_tree = RadixTree(self.pool)
        tree = self._tree_for(s)
        context = s.context[:-1]
        hit = tree.match_len(context)
        s.node = tree.insert(context)
        tree.pin(s.node, 1)
        if not s.counted:
            s.counted = True
            self.stats.cache_hit_tokens += hit
            self.stats.prompt_tokens += len(s.prompt_ids)
            self.stats.prefill_tokens += 1  # the last prompt token, fed by the first decode step
            req.cached_tokens = max(req.cached_tokens, hit)
        self.prefilling.append(s)

    def _prefill(self) -> list[Sequence]:
        """Spend up to ``prefill_budget`` tokens on uncached nodes; returns sequences ready to decode.

        A chunk that fails (not for memory) ends the requests waiting on that node, and only them.
        """
        budget, ready, still, out_of_memory = self.prefill_budget, [], [], False
        broken: dict[int, tuple[Request, str]] = {}
        for s in self.prefilling:
            tree = self._tree_for(s)
            while budget > 0 and id(s.request) not in broken and (node := _first_without_kv(s.node)):
                try:
                    budget -= self._prefill_chunk(tree, node, budget)
                except OutOfSlots:
                    budget, out_of_memory = 0, True
                except Exception as e:
                    message = failure_message("prefill", e)
                    for x in self.prefilling:
                        if any(n is node for n in x.node.path()):
                            broken.setdefault(id(x.request), (x.request, message))
            (ready if _first_without_kv(s.node) is None else still).append(s)
        if broken:
            still += [s for s in ready if id(s.request) in broken]
            ready = [s for s in ready if id(s.request) not in broken]
        self.prefilling = still
        for req, message in broken.values():
            self._fail(req, message)
        still = self.prefilling
        # Out of memory with nothing running to free any: partial prefills would deadlock each other, so
        # all but the oldest go back to wait (their partial KV becomes evictable), and no other sequence is
        # scheduled until the oldest has its KV (see _alloc_node for how it always gets it).
        self.prefill_starved = out_of_memory and not ready and self.num_running == 0
        if self.prefill_starved and len(still) > 1:
            self._requeue(still[1:])
            self.prefilling = still[:1]
        return ready

    def _prefill_chunk(self, tree: RadixTree, node: Node, budget: int) -> int:
        """Compute the next chunk of node's KV; its queries attend to the ancestors' KV in place."""
        if node.slot < 0:
            node = self._alloc_node(tree, node)
        slot, c0 = node.slot, node.filled
        c1 = min(len(node.tokens), c0 + self.prefill_chunk, c0 + max(budget, 1))
        ancestors = _coalesce([(n.slot, n.slot + len(n.tokens)) for n in node.path()[:-1]])
        ids = torch.tensor(node.tokens[c0:c1], device=self.device)
        pos = torch.arange(node.start_pos + c0, node.start_pos + c1, device=self.device)
        slots = torch.arange(slot + c0, slot + c1, device=self.device)
        k_pool, v_pool = self.pool.k, self.pool.v

        def attend(layer, q, k, v):
            self.pool.write(layer, slots, k, v)
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
        node.filled = c1
        self.stats.prefill_tokens += c1 - c0
        return c1 - c0

    def _alloc_node(self, tree: RadixTree, node: Node) -> Node:
        """Give a node its KV run; returns the node to prefill now.

        With nothing running and one sequence prefilling, that sequence must make progress even when no
        free run is long enough (fragmentation): the cache is emptied of everything unpinned and the node is
        split so that its upper part fits the longest free run (the rest gets its own run later).
        """
        try:
            tree.assign_kv(node, self._alloc(len(node.tokens)), filled=0)
            return node
        except OutOfSlots:
            if self.num_running or len(self.prefilling) > 1:
                raise
            for t in self._trees():
                t.evict(t.cached_tokens)
            run = self.pool.allocator.largest_run()
            if not 0 < run < len(node.tokens):
                raise
            tree.split_at(node, node.start_pos + run)
            upper = node.parent
            tree.assign_kv(upper, self._alloc(run), filled=0)
            return upper

    # ---- the decode batch ---------------------------------------------------------------------
    def _decide_cuts(self, seqs: list[Sequence], share_all: bool = False) -> dict[int, int]:
        """Per sequence, how much of its context is read from shared nodes (the cost rule).

        Consecutive path nodes held by the same number of batch sequences are read by one plan item
        (their holders are the same contiguous range). Such a group is worth reading as shared when the
        reads it saves per step, ``(holders - 1) * (tokens - MERGE_ROW_TOKENS)``, reach
        ``min_shared_reads``: below that the extra call and LSE merge cost more than the per-sequence
        path reading the tokens again (a node held by one sequence never pays). ``min_shared_reads=0``
        turns the rule off. ``share_all`` (used when the copies would not fit in memory) also shares nodes
        held by a single sequence: it reads them in place instead of holding a copy in its tail.
        Groups above the deepest group that pays are shared too (a cut is a prefix); below it the KV
        lives in the sequence's own tail, copied once. Cuts only move down: a running sequence whose
        private prefix became shared drops that part of its tail and reads the node with the others.
        Returns the new cut per sequence id. Sharing off: nothing is shared.
        """
        if not self.prefix_sharing:
            return {id(s): 0 for s in seqs}
        if self.share_limit is not None:  # a node boundary at the limit, so the part above it can be shared
            for s in seqs:
                for n in s.node.path():
                    self.tree.split_at(n, self.share_limit)
        holders: dict[int, int] = {}
        for s in seqs:
            for n in s.node.path():
                holders[id(n)] = holders.get(id(n), 0) + 1
        cuts, threshold = {}, 0 if share_all else self.min_shared_reads
        for s in seqs:
            cut = s.cut if s.row >= 0 else 0
            group_holders, group_tokens = 0, 0
            for n in s.node.path():
                h = holders[id(n)]
                beyond_limit = self.share_limit is not None and n.end_pos > self.share_limit
                if (h < 2 and not share_all) or beyond_limit:
                    break
                if h != group_holders:
                    group_holders, group_tokens = h, 0
                group_tokens += len(n.tokens)
                if sharing_pays(h, group_tokens, threshold):
                    cut = max(cut, n.end_pos)
            cuts[id(s)] = cut
        return cuts

    def _tail_block(self, seqs: list[Sequence], share_all: bool, smallest: bool = False):
        """Cuts, tail lengths, row capacity and the allocated base of a new tail block for seqs.

        ``smallest`` (a lone sequence short of memory): the longest free run, if that is less than the usual
        capacity but holds at least the next token.
        """
        cuts = self._decide_cuts(seqs, share_all)
        # Tail length of each sequence in the new block: running ones drop the part that became shared.
        lens = {id(s): len(s.context) - 1 - cuts[id(s)] for s in seqs}
        cap = max(min(s.max_len - cuts[id(s)], lens[id(s)] + 1 + self.tail_growth) for s in seqs)
        if smallest:  # as much as the longest free run holds once the unpinned cache is dropped
            for tree in self._trees():
                tree.evict(tree.cached_tokens)
            cap = max(max(lens.values()) + 1, min(cap, self.pool.allocator.largest_run() // len(seqs)))
        return cuts, lens, cap, self._alloc(len(seqs) * cap)

    def _rebuild(self, running: list[Sequence], new: list[Sequence]) -> None:
        """New tail block for running + new sequences (DFS order); tails copied in one indexed op.

        When memory is short it falls back to sharing everything in the tree (no copies), then, for a lone
        sequence, to a smaller block (down to room for one token). Raises OutOfSlots (state unchanged)
        when even evicting the whole unpinned cache does not help.
        """
        old = self.batch
        seqs = sorted(running + new, key=lambda s: s.order_key)
        attempts = [(False, False), (True, False)] + ([(True, True)] if len(seqs) == 1 else [])
        for k, (share_all, smallest) in enumerate(attempts):
            try:
                cuts, lens, cap, base = self._tail_block(seqs, share_all, smallest)
                break
            except OutOfSlots:
                if k == len(attempts) - 1:
                    raise
        old_rows = {id(s): s.row for s in running}
        batch = DecodeBatch(self.pool, seqs, cap, base, self.device)
        src, dst = [], []
        for s in running:
            shift = cuts[id(s)] - s.cut
            src.append(torch.arange(shift, s.tail_len) + old.base + old_rows[id(s)] * old.cap)
            dst.append(torch.arange(lens[id(s)]) + batch.base + s.row * cap)
        for s in new:
            runs = [
                torch.arange(n.slot, n.slot + len(n.tokens))
                for n in s.node.path()
                if n.start_pos >= cuts[id(s)]
            ]
            s.join_order = next(self._joins)
            if runs:
                src.append(torch.cat(runs))
                dst.append(torch.arange(lens[id(s)]) + batch.base + s.row * cap)
        for s in seqs:
            s.cut = cuts[id(s)]  # from here on s.tail_len is the new block's length
        if src:
            self.pool.copy_slots(torch.cat(dst).to(self.device), torch.cat(src).to(self.device))
        if old is not None:
            old.release()
        if not self.prefix_sharing:  # sharing off: each sequence holds its own copy of its prompt now
            for s in new:
                s.request.private_tree.pin(s.node, -1)
                s.node = None
            for req in {id(s.request): s.request for s in new}.values():
                if all(x.node is None and x not in self.waiting for x in req.seqs):
                    req.private_tree.clear()
                    req.private_tree = None
        batch.refresh()
        self.batch = batch
        self._sampling_state()

    def _join(self, ready: list[Sequence]) -> None:
        running = list(self.batch.seqs) if self.batch is not None else []
        while ready:
            try:
                self._rebuild(running, ready)
                return
            except OutOfSlots:
                if running or len(ready) > 1:
                    # Not enough memory for all of them: the newest wait (still pinned and prefilled).
                    self.prefilling.insert(0, ready.pop())
                elif self.prefilling:
                    self._requeue(self.prefilling)  # their pinned KV may be what is in the way
                    self.prefilling = []
                else:
                    self._fail(ready.pop().request, "out of KV cache memory for this request")

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Send prefilling sequences back to the front of the queue, unpinning their (partial) KV."""
        for s in reversed(seqs):
            self._tree_for(s).pin(s.node, -1)
            s.node = None
            self.waiting.appendleft(s)

    def _fail(self, req: Request, message: str) -> None:
        """End a request with an error instead of crashing the engine for everyone (reported by step)."""
        req.error = message
        for s in req.seqs:
            if not s.finished:
                s.finish_reason = "error"
        self._leave(list(req.seqs))  # also a sequence that finished in this very step but never left
        self.waiting = deque(s for s in self.waiting if s.request is not req)
        self.failed.append(req)

    def _ensure_tail_room(self) -> None:
        """Grow the tail block when a row is full; preempt the newest sequences if memory is short."""
        batch = self.batch
        if batch is None or batch.max_len < batch.cap:
            return
        while True:
            try:
                self._rebuild(list(batch.seqs), [])
                return
            except OutOfSlots:
                if len(batch.seqs) > 1:
                    self._preempt(max(batch.seqs, key=lambda s: s.join_order))
                elif self.prefilling:
                    self._requeue(self.prefilling)
                    self.prefilling = []
                else:
                    # A lone sequence whose block cannot grow (the old and new block would be needed at
                    # once): its KV goes to the tree and it rejoins reading it in place (admission made
                    # sure that fits). Never fail an admitted request for memory.
                    self._preempt(batch.seqs[0])
                    return

    def _preempt(self, s: Sequence) -> None:
        """Give a running sequence's KV to the tree and send it back to wait (recomputed if evicted)."""
        self.stats.preemptions += 1
        s.preemptions += 1
        self._leave([s])
        s.finish_reason = None
        s.row, s.cut, s.node = -1, 0, None
        s.arrival_step = self.step_count - self.max_wait_steps  # first in line when memory frees
        self.waiting.appendleft(s)

    def _leave(self, seqs: list[Sequence]) -> None:
        """Remove sequences from wherever they run, caching their KV in the tree when sharing is on.

        The batch's plan and sampling tensors are rebuilt once for all of them.
        """
        batch = self.batch
        running = {id(x) for x in batch.seqs} if batch is not None else set()
        leaving: set[int] = set()
        for s in seqs:
            if id(s) in running:
                batch.retire(s, self._cache_tail(s))
                if s.node is not None:
                    self._tree_for(s).pin(s.node, -1)
                leaving.add(id(s))
            elif s in self.prefilling:
                self.prefilling.remove(s)
                self._tree_for(s).pin(s.node, -1)
            s.node = None
        if leaving:
            batch.remove(leaving)
            if batch.seqs:
                self._sampling_state()
            else:
                batch.release()
                self.batch = None

    def _cache_tail(self, s: Sequence) -> tuple[int, int] | None:
        """Insert the sequence's context into the tree, handing over the tail slots that hold new tokens.

        Returns the row-offset range now owned by the tree (not to be freed), or None.
        """
        if not self.prefix_sharing or s.node is None or s.tail_len == 0:
            return None
        context = s.context[: s.cut + s.tail_len]
        leaf = self.tree.insert(context)
        if leaf.parent is None or leaf.slot >= 0 or not all(n.has_kv for n in leaf.path()[:-1]):
            return None
        start = leaf.start_pos - s.cut
        self.tree.assign_kv(leaf, self.batch.base + s.row * self.batch.cap + start)
        self.tree.pin(leaf, 0)  # refresh its LRU time
        return (start, s.tail_len)

    def _sampling_state(self) -> None:
        """Per-row sampling tensors and next inputs, rebuilt only when the batch membership changes."""
        if self.batch is None:
            return
        seqs, dev = self.batch.seqs, self.device
        ps = [s.request.params for s in seqs]
        self.next_tokens = torch.tensor([s.context[-1] for s in seqs], dtype=torch.long, device=dev)
        self.s_temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        # A top_k beyond the vocabulary keeps every token, as top_k=0 does (clamped, so it fits any int64).
        vocab = self.cfg.vocab_size
        self.s_top_k = torch.tensor([min(p.top_k, vocab) for p in ps], dtype=torch.long, device=dev)
        self.s_top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        self.s_seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev)
        self.s_steps = torch.tensor([len(s.generated) for s in seqs], dtype=torch.long, device=dev)
        self.s_flags = (
            any(p.temperature > 0 for p in ps),
            any(p.top_k > 0 for p in ps),
            any(p.top_p < 1 for p in ps),
        )
        self.s_logprobs = max((p.logprobs for p in ps if p.logprobs is not None), default=None)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, prefill a budget, join, decode one token; returns requests finished in this step.

        A failure that belongs to one request (its prefill, sampling, stop check, detokenization or output)
        ends that request with ``RequestOutput.error`` set; the others go on untouched. Anything else raises.
        """
        self.step_count += 1
        t0 = time.perf_counter()
        self._schedule()
        ready = self._prefill()
        if ready:
            self._join(ready)
        self._ensure_tail_room()
        self.stats.prefill_seconds += time.perf_counter() - t0
        batch = self.batch
        done = self._decode(batch) if batch is not None and batch.seqs else []
        failed = [out for req in self.failed if (out := self._finish_request(req)) is not None]
        self.failed = []
        return failed + done

    def _finish_request(self, req: Request) -> RequestOutput | None:
        if self.requests.pop(req.request_id, None) is None:
            return None
        self.stats.requests_finished += 1
        try:
            return self._output(req)
        except Exception as e:
            req.error = req.error or failure_message("output building", e)
            return RequestOutput(
                req.request_id, req.prompt, req.prompt_ids, [], True, req.cached_tokens, req.error
            )

    def _decode(self, batch: DecodeBatch) -> list[RequestOutput]:
        t0 = time.perf_counter()
        slots = batch.begin_step()
        impl = self.decode_impl

        def attend(layer, q, k, v):
            self.pool.write(layer, slots, k, v)
            if impl == "none":
                return torch.zeros_like(q)
            return batch.attention(layer, q, self.scale, impl)

        hidden = self.model(self.next_tokens, batch.positions, attend)
        logits = self.model.logits(hidden)
        row_args = (self.s_temp, self.s_top_k, self.s_top_p, self.s_seeds, self.s_steps)
        tokens, row_errors = sample_rows(self.sampler, logits, row_args, self.s_flags, logits.shape[1])
        batch.end_step()
        self.stats.peak_kv_tokens = max(
            self.stats.peak_kv_tokens, self.tree.cached_tokens + batch.tail_tokens
        )
        self.s_steps += 1
        self.next_tokens = tokens
        token_list = tokens.tolist()
        logprob_rows = None
        if self.s_logprobs is not None:
            logprob_rows, lp_errors = map_rows(
                lambda: self._logprobs(logits, tokens),
                lambda i: self._logprobs(logits[i : i + 1], tokens[i : i + 1])[0],
                len(token_list),
                "logprobs",
            )
            row_errors = {**lp_errors, **row_errors}
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        # Per-request work below runs guarded: an exception ends its request alone (errors: by request).
        errors: dict[int, tuple[Request, str]] = {}
        for i, message in row_errors.items():
            errors.setdefault(id(batch.seqs[i].request), (batch.seqs[i].request, message))
        finished: list[Sequence] = []
        for i, (s, t) in enumerate(zip(batch.seqs, token_list, strict=True)):
            if id(s.request) in errors:
                continue
            try:
                s.generated.append(t)
                self.stats.generated_tokens += 1
                if logprob_rows is not None and s.request.params.logprobs is not None:
                    s.logprobs = s.logprobs or []
                    s.logprobs.append(logprob_rows[i])
                if self._check_finish(s, t):
                    finished.append(s)
            except Exception as e:
                errors.setdefault(id(s.request), (s.request, failure_message("stop check", e)))
        # Texts first: a request's output is built as soon as its last sequence is finished, which may
        # be before the loop below reaches its other sequences that finished in this same step.
        for s in finished:
            if id(s.request) not in errors:
                try:
                    self._finish_sequence(s)
                except Exception as e:
                    errors.setdefault(id(s.request), (s.request, failure_message("detokenization", e)))
        finished = [s for s in finished if id(s.request) not in errors]
        self._leave(finished)
        for req, message in errors.values():
            self._fail(req, message)
        done: list[RequestOutput] = []
        for s in finished:
            if s.request.finished and (out := self._finish_request(s.request)) is not None:
                done.append(out)
        if self.batch is not None and self.batch.seqs and self.batch.dead_fraction >= 0.5:
            # Compact: live tails move once into a new block. Only an optimisation: if memory is short,
            # the old block stays valid.
            with contextlib.suppress(OutOfSlots):
                self._rebuild(list(self.batch.seqs), [])
        return done

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
        too_long = len(s.prompt_ids) + len(s.generated) >= self.cfg.max_position_embeddings
        if s.finish_reason is None and (len(s.generated) >= p.max_tokens or too_long):
            s.finish_reason = "length"
        return s.finish_reason is not None

    def _finish_sequence(self, s: Sequence) -> None:
        self.stats.per_sequence_kv_tokens += len(s.prompt_ids) + len(s.generated) - 1
        s.text = self.text_of(s)

    def text_of(self, s: Sequence) -> str:
        """The completion text so far: stop strings cut, a final EOS/stop token left out."""
        if self.tokenizer is None:
            return ""
        if s.finish_reason == "stop" and isinstance(s.stop_reason, str):
            return s.text
        ids = s.generated[:-1] if s.finish_reason == "stop" else s.generated
        return self.tokenizer.decode(ids)

    def _output(self, r: Request) -> RequestOutput:
        outs = [
            CompletionOutput(s.index, s.text, list(s.generated), s.finish_reason, s.logprobs, s.stop_reason)
            for s in r.seqs
        ]
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, outs, True, r.cached_tokens, r.error)


def _first_without_kv(leaf: Node) -> Node | None:
    """The first node on the path to ``leaf`` whose KV is not complete (prefill goes parent-first)."""
    if leaf.parent is None:
        return None
    return next((n for n in leaf.path() if not n.has_kv), None)


def _coalesce(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge touching slot runs so a chain of ancestors is read as one block."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
