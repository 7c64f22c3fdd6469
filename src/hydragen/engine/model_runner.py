"""The model runner: runs a packed step through the model once and samples the next tokens.

The step comes packed by ``packing.py`` (every work item's tokens in one varlen batch, its attention
metadata built once per layer kind's group and mask: a sliding window's has its bounds); attention for the
whole step is one ``step_attention`` call per layer, with its kind's metadata, scale and soft-cap. Sampling is
one call for the batch, seeded per sequence, so a sequence's draws never depend on the rest of the batch.
"""

from __future__ import annotations

import time

import torch

from hydragen.attention.layer_spec import model_layer_specs
from hydragen.attention.step_attention import step_attention
from hydragen.engine.isolation import map_rows, sample_rows
from hydragen.engine.packing import PackedBatch, pack, triton_tables
from hydragen.engine.sampler import SampleOutput, Sampler
from hydragen.engine.sequence import SequenceState
from hydragen.engine.step_plan import StepPlan, Work
from hydragen.errors import ConfigError
from hydragen.kv.pool import PagePool
from hydragen.model.layer_stack import stack_layers


class ModelRunner:
    # Extra build_tree_plan arguments for the Triton path (chunk_tokens, block_m, ...); tests shrink them.
    plan_options: dict = {}

    def __init__(self, model, cfg, pool: PagePool, device, attention: str = "auto"):
        self.model, self.cfg, self.pool, self.device = model, cfg, pool, device
        self.use_triton = attention == "triton"
        # Engine names -> step_attention's: "fused" is the compiled CPU op (refused where it cannot run).
        self.attention = {"triton": "auto", "fused": "cpp"}.get(attention, attention)
        if self.use_triton:
            from hydragen.attention.triton_kernels import check_device

            check_device(torch.device(device))  # fail here, not in the first decode step
        self.specs = model_layer_specs(cfg)
        if why := self.specs.unsupported():
            raise ConfigError(
                "model", f"this model cannot run exactly yet: {why}, which hydragen's kernels skip"
            )
        self.layer_spec = self.specs.of_layer  # layer -> its kind (its metadata in a packed batch)
        self.scales = [self.specs.specs[i].scale for i in self.layer_spec]
        self.softcaps = self.specs.softcaps()
        self.layer_group = pool.layout.group_of_layer if pool is not None else ()  # whose pages it reads
        self.layer_row = pool.layout.row_of_layer if pool is not None else ()  # its row in them
        self.sampler = Sampler()
        self._settings: tuple | None = None  # (sequence ids, tensors) of the last batch sampled
        if torch.device(device).type == "cpu":
            # Compile (once per machine, ~30 s) or load the CPU ops now, not inside the first request: the
            # sampler uses them whatever the attention implementation.
            from hydragen.native.build import load_ops

            load_ops()

    def pack(self, plan: StepPlan) -> PackedBatch:
        """The plan as one packed batch; pure decode steps also get the Triton tables on that path."""
        pool = self.pool
        in_group = pool.in_group if pool.groups > 1 else None
        batch, _ = pack(plan, pool.page_size, self.device, self.specs, in_group)
        if self.use_triton and pool.groups == 1:  # (several KV groups: the general path)
            c = self.cfg
            built: dict = {}  # per mask (window): kinds that see the same keys share one plan
            for spec in self.specs.specs:
                if spec.mask_key not in built:
                    built[spec.mask_key] = triton_tables(
                        plan, self.pool.page_size, self.device, c.num_heads // c.num_kv_heads, c.num_kv_heads,
                        self.plan_options, spec.window,
                    )  # fmt: skip
            tables = [built[spec.mask_key] for spec in self.specs.specs]
            if tables[0] is not None:
                batch.tree_plan, batch.tail_lens = tables[0]
                batch.tree_plans = tuple(t[0] for t in tables)
        return batch

    # ---- running it ----------------------------------------------------------------------------------
    def forward(self, batch: PackedBatch) -> torch.Tensor | None:
        """Runs the model; returns logits [B, V] (fp32) at the decoding sequences' last tokens."""
        pool, metas, impl = self.pool, batch.metas, self.attention
        spec, scales, rows, groups = self.layer_spec, self.scales, self.layer_row, self.layer_group
        caps = self.softcaps

        def attend(layer, q, k, v):
            row = rows[layer]
            pool.write(row, batch.slots_of(groups[layer]), k, v)
            if impl == "none":
                return torch.zeros_like(q)
            if batch.tree_plan is None:
                meta = metas[spec[layer]]
                return step_attention(q, pool.k[row], pool.v[row], meta, scales[layer], impl, caps[layer])
            return self._triton_attention(row, q, batch, scales[layer], caps[layer], spec[layer])

        layers = None
        if impl in ("auto", "cpp") and batch.tree_plan is None:  # every layer in one C++ call, if it can
            slots = (batch.slots, *batch.group_slots)
            layers = stack_layers(self.model, pool.k, pool.v, slots, metas, spec, scales, groups, rows, caps)
        hidden = self.model(batch.input_ids, batch.positions, attend, layers=layers, final_norm=False)
        if batch.logit_rows.numel() == 0:
            return None
        return self.model.logits(hidden[batch.logit_rows], normalized=False)

    def time_rows(self, rows: int, context: int = 64, repeats: int = 2) -> float:
        """Seconds of a step of ``rows`` decode rows, each over ``context`` tokens of scratch KV: the forward
        and the sampling of every row at temperature 0.8 / top_p 0.95 (the costlier kind of draw, so the
        rule errs towards not speculating), best of ``repeats`` after a warm-up. The speculative cost rule's
        t(R), measured at start-up on pages nobody holds yet."""
        pool = self.pool
        pages = pool.take(pool.pages_for(context + 1))
        dev = self.device
        draw = (
            torch.full((rows,), 0.8, device=dev), torch.zeros(rows, dtype=torch.long, device=dev),
            torch.full((rows,), 0.95, device=dev), torch.arange(rows, device=dev),
            torch.zeros(rows, dtype=torch.long, device=dev), True, False, True,
        )  # fmt: skip
        try:
            work = tuple(Work(None, tuple(pages), context, (0,), 1) for _ in range(rows))
            plan = StepPlan(work, cuts=(0,) * rows)
            best = float("inf")
            for i in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                logits = self.forward(self.pack(plan))
                if isinstance(self.sampler, Sampler):  # (tests may swap in a plain callable)
                    self.sampler.sample(logits, *draw)
                if i:
                    best = min(best, time.perf_counter() - t0)
            return best
        finally:
            pool.free(pool.release(pages))

    def _triton_attention(
        self, row: int, q: torch.Tensor, batch: PackedBatch, scale: float, softcap=None, kind: int = 0
    ) -> torch.Tensor:
        from hydragen.attention.triton_kernels import tree_decode_attention  # optional dependency

        pool = self.pool
        tree = batch.tree_plans[kind] if batch.tree_plans else batch.tree_plan
        return tree_decode_attention(
            q, pool.k[row], pool.v[row], tree, batch.tail_lens, scale, softcap=softcap
        )

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[SequenceState],
        num_logprobs: int | None = None,
        offsets: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[dict[int, float]] | None, dict[int, str]]:
        """One token per row (row i is ``seqs[i]``'s; seeded per sequence: independent of the batch), its
        logprobs when asked, and {row: error} for rows that could not be sampled. Row i draws the uniform of
        its sequence's step len(generated) + ``offsets[i]``: a verified draft position's row (offset j: j
        drafts before it) draws what decoding that position alone would draw.

        The batch is sampled in one call; if that raises or gives an impossible token, the rows are run
        again one at a time and only the failing ones are reported (``engine/isolation.py``).
        """
        temp, top_k, top_p, seeds, min_p, flags = self._sampling_tensors(seqs)
        steps = [len(s.generated) for s in seqs]
        if offsets is not None:
            steps = [a + b for a, b in zip(steps, offsets, strict=True)]
        steps = torch.tensor(steps, dtype=torch.long, device=self.device)
        row_args = (temp, top_k, top_p, seeds, steps)
        extra = (min_p, flags[3])
        vocab = logits.shape[1]
        try:
            out = self._sample_batch(logits, row_args, flags[:3] + extra, num_logprobs)
            if out.tokens.shape == (len(seqs),) and all(0 <= t < vocab for t in out.tokens.tolist()):
                return out.tokens, _logprob_dicts(out) if num_logprobs is not None else None, {}
        except Exception:  # noqa: BLE001  found row by row below
            pass
        tokens, errors = sample_rows(self.sampler, logits, row_args, flags[:3] + extra, vocab)
        if num_logprobs is None:
            return tokens, None, errors
        rows, lp_errors = map_rows(
            lambda: logprob_rows(logits, tokens, num_logprobs),
            lambda i: logprob_rows(logits[i : i + 1], tokens[i : i + 1], num_logprobs)[0],
            len(seqs),
            "logprobs",
        )
        return tokens, rows, {**lp_errors, **errors}

    def _sample_batch(self, logits, row_args, flags, num_logprobs) -> SampleOutput:
        sample = getattr(self.sampler, "sample", None)
        if sample is None:  # a plain callable (tests wrap the sampler)
            tokens = self.sampler(logits, *row_args, *flags)
            if num_logprobs is None:
                return SampleOutput(tokens)
            return _sample_output(logits, tokens, num_logprobs)
        return sample(logits, *row_args, *flags, num_logprobs=num_logprobs)

    def _sampling_tensors(self, seqs: list[SequenceState]) -> tuple:
        """The rows' sampling settings as tensors, and which features any row uses. A decode step usually
        samples the same sequences as the step before, and a request's settings are fixed once it is
        submitted: then the last step's tensors serve again (five tensor builds a step, at batch 1 a few
        per cent of it). Sequence ids are never reused, so the key cannot match another batch."""
        key = tuple(s.seq_id for s in seqs)
        if self._settings is not None and self._settings[0] == key:
            return self._settings[1]
        built = self._build_sampling_tensors(seqs)
        self._settings = (key, built)
        return built

    def _build_sampling_tensors(self, seqs: list[SequenceState]) -> tuple:
        dev = self.device
        ps = [s.request.params for s in seqs]
        return (
            torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev),
            # A top_k beyond the vocabulary keeps every token, as top_k=0 does (clamped to fit int64).
            torch.tensor([min(p.top_k, self.cfg.vocab_size) for p in ps], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
            torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev),
            torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev),
            (
                any(p.temperature > 0 for p in ps),
                any(p.top_k > 0 for p in ps),
                any(p.top_p < 1 for p in ps),
                any(p.min_p > 0 for p in ps),
            ),
        )


def _logprob_dicts(out: SampleOutput) -> list[dict[int, float]]:
    rows = [{t: c} for t, c in zip(out.tokens.tolist(), out.logprobs.tolist(), strict=True)]
    if out.top_ids is not None:
        tops = zip(out.top_ids.tolist(), out.top_logprobs.tolist(), strict=True)
        for row, (ids, vals) in zip(rows, tops, strict=True):
            row.update(zip(ids, vals, strict=True))
    return rows


def _sample_output(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> SampleOutput:
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if not top:
        return SampleOutput(tokens, chosen)
    best = logp.topk(top, dim=-1)
    return SampleOutput(tokens, chosen, best.indices, best.values)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[dict[int, float]]:
    """Per row {token: logprob} for the chosen token plus the ``top`` most likely ones."""
    return _logprob_dicts(_sample_output(logits, tokens, top))
