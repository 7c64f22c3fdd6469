"""The model runner: turns the scheduler's plan into one packed batch, runs the model once, samples.

Every prefill chunk of every node and request, and every decoding sequence's pending token(s) (one for
a decode step, several for a multi-token extend), go through one varlen forward: one call per linear
layer per step, whatever the mix. Attention for the whole step is one ``step_attention`` call per layer
over metadata built once per step:

* **units** read a contiguous KV run with a matrix-matrix product for a contiguous range of tokens:
  a shared tree node for the decoding sequences that hold it (DFS order makes them contiguous), or a
  prefill chunk's ancestors and its own earlier part (and the chunk itself, causally);
* **segments** read, per token, the KV it does not get from units: unshared path nodes in place and
  the sequence's own pages, through their slot runs (no copy).
Each layer first writes the step's new K/V into the pool, then attends, so a sequence may decode in the
same step that computes the last chunk of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydragen.attention.step_attention import StepAttentionMeta, step_attention
from hydragen.engine.isolation import map_rows, sample_rows
from hydragen.engine.sampler import SampleOutput, Sampler
from hydragen.engine.scheduler import StepPlan
from hydragen.engine.sequence import Sequence
from hydragen.kv.manager import KVManager
from hydragen.kv.pool import Runs, coalesce, slice_runs, slot_list, take_runs


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V is written
    meta: StepAttentionMeta
    logit_rows: torch.Tensor  # [B] the token whose logits sample each decoding sequence's next token
    num_prefill_tokens: int
    # Triton decode (attention="triton"): the decode tokens' tables; ``meta`` then covers prefill only.
    tree_plan: object | None = None
    tail_lens: torch.Tensor | None = None
    shared_items: int = 0  # shared runs read by ranges of decoding sequences


class ModelRunner:
    # Extra build_tree_plan arguments for the Triton path (chunk_tokens, block_m, ...); tests shrink them.
    plan_options: dict = {}

    def __init__(self, model, cfg, kv: KVManager, device, attention: str = "auto"):
        self.model, self.cfg, self.kv, self.device = model, cfg, kv, device
        self.use_triton = attention == "triton"
        # Engine names -> step_attention's: "fused" is the compiled CPU op (refused where it cannot run).
        self.attention = {"triton": "auto", "fused": "cpp"}.get(attention, attention)
        if self.use_triton:
            from hydragen.attention.triton_kernels import check_device

            check_device(torch.device(device))  # fail here, not in the first decode step
            kv.reserve_whole = True
        self.scale = cfg.head_dim**-0.5
        self.sampler = Sampler()
        if torch.device(device).type == "cpu":
            # Compile (once per machine, ~30 s) or load the CPU ops now, not inside the first request: the
            # sampler uses them whatever the attention implementation.
            from hydragen.native.build import load_ops

            load_ops()
        self._sampling_key: tuple = ()
        self._sampling: tuple = ()

    # ---- the packed batch ------------------------------------------------------------------------
    def pack(self, plan: StepPlan) -> PackedBatch:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        units: list[tuple[int, int, int, int, int]] = []
        segments: list[tuple[int, int, Runs, int]] = []
        unit_of_run: dict[tuple[int, int], int] = {}
        for ch in plan.prefill:
            node, t0 = ch.node, len(ids)
            n = ch.end - ch.start
            ids += node.tokens[ch.start : ch.end]
            pos += range(node.start_pos + ch.start, node.start_pos + ch.end)
            own = slice_runs(node.runs, ch.start, ch.end)
            slots += slot_list(own)
            seen = [r for a in node.path()[:-1] for r in a.runs] + take_runs(node.runs, ch.start)
            for lo, hi in coalesce(seen):
                # Chunks packed back to back that read the same run (siblings under one cached system
                # prompt) share one unit: the run is read once for all their rows.
                last = unit_of_run.get((lo, hi))
                if last is not None and units[last][3] == t0:
                    units[last] = (lo, hi, units[last][2], t0 + n, 0)
                else:
                    unit_of_run[(lo, hi)] = len(units)
                    units.append((lo, hi, t0, t0 + n, 0))
            if len(own) == 1:
                units.append((own[0][0], own[0][1], t0, t0 + n, 1))
                segments.append((t0, t0 + n, [], 0))
            else:
                segments.append((t0, t0 + n, own, 1))
        num_prefill = len(ids)
        starts, logit_rows = [], []
        for s in plan.decode:
            t0, c, p = len(ids), s.computed, s.pending
            starts.append(t0)
            ids += s.context[c : c + p]
            pos += range(c, c + p)
            slots += self.kv.own_slots(s, c, c + p)
            path = s.node.path() if s.node is not None else ()
            runs = [r for n in path if n.start_pos >= s.cut and n.end_pos <= s.own_start for r in n.runs]
            runs += take_runs(s.own_runs, c + p - s.own_start)
            segments.append((t0, t0 + p, coalesce(runs), c - s.cut + 1))
            logit_rows.append(t0 + p - 1)
        starts.append(len(ids))
        dev = self.device
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        batch = PackedBatch(
            as_tensor(ids), as_tensor(pos), as_tensor(slots), None, as_tensor(logit_rows), num_prefill
        )
        batch.shared_items = len(plan.items)
        if self.use_triton and self._triton_decode(
            batch, plan, segments[-len(plan.decode) :] if plan.decode else []
        ):
            segments = segments[: len(segments) - len(plan.decode)]
            batch.meta = StepAttentionMeta.build(units, segments, num_prefill, dev)
            return batch
        units += [(lo, hi, starts[i], starts[j], 0) for lo, hi, i, j in plan.items]
        batch.meta = StepAttentionMeta.build(units, segments, len(ids), dev)
        return batch

    def _triton_decode(self, batch: PackedBatch, plan: StepPlan, segments) -> bool:
        """Tables for the Triton tree-decode kernels, when every decoding sequence feeds one token and
        reads its private KV from one run (its own pages, reserved whole); else the step uses the CPU op."""
        if (
            not plan.decode
            or any(s.pending != 1 for s in plan.decode)
            or any(len(r) != 1 for _, _, r, _ in segments)
        ):
            return False
        from hydragen.attention.tree_plan import build_tree_plan

        hkv = self.cfg.num_kv_heads
        starts = torch.tensor([r[0][0] for _, _, r, _ in segments], dtype=torch.long, device=self.device)
        lens = [r[0][1] - r[0][0] for _, _, r, _ in segments]
        batch.tree_plan = build_tree_plan(
            plan.items,
            starts,
            group=self.cfg.num_heads // hkv,
            num_kv_heads=hkv,
            tail_cap=max(lens),
            **self.plan_options,
        )
        batch.tail_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        return True

    # ---- running it ----------------------------------------------------------------------------------
    def forward(self, batch: PackedBatch) -> torch.Tensor | None:
        """Runs the model; returns logits [B, V] (fp32) at the decoding sequences' last tokens."""
        pool, meta, impl = self.kv.pool, batch.meta, self.attention

        def attend(layer, q, k, v):
            pool.write(layer, batch.slots, k, v)
            if impl == "none":
                return torch.zeros_like(q)
            if batch.tree_plan is None:
                return step_attention(q, pool.k[layer], pool.v[layer], meta, self.scale, impl=impl)
            n = batch.num_prefill_tokens
            out = torch.empty_like(q)
            if n:
                out[:n] = step_attention(q[:n], pool.k[layer], pool.v[layer], meta, self.scale, impl=impl)
            out[n:] = self._triton_attention(layer, q[n:], batch)
            return out

        hidden = self.model(batch.input_ids, batch.positions, attend)
        if batch.logit_rows.numel() == 0:
            return None
        return self.model.logits(hidden[batch.logit_rows])

    def _triton_attention(self, layer: int, q: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        from hydragen.attention.triton_kernels import tree_decode_attention  # optional dependency

        pool = self.kv.pool
        return tree_decode_attention(
            q, pool.k[layer], pool.v[layer], batch.tree_plan, batch.tail_lens, self.scale
        )

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], num_logprobs: int | None = None
    ) -> tuple[torch.Tensor, list[dict[int, float]] | None, dict[int, str]]:
        """One token per decoding sequence (seeded per sequence: independent of the batch), its logprobs
        when asked, and {row: error} for rows that could not be sampled.

        The batch is sampled in one call; if that raises or gives an impossible token, the rows are run
        again one at a time and only the failing ones are reported (``engine/isolation.py``).
        """
        key = tuple(id(s) for s in seqs)
        if key != self._sampling_key:
            self._sampling_key, self._sampling = key, self._sampling_tensors(seqs)
        temp, top_k, top_p, seeds, min_p, flags = self._sampling
        steps = torch.tensor([len(s.generated) for s in seqs], dtype=torch.long, device=self.device)
        row_args = (temp, top_k, top_p, seeds, steps)
        extra = (min_p, flags[3])
        vocab = logits.shape[1]
        try:
            out = self._sample_batch(logits, row_args, flags[:3] + extra, num_logprobs)
            if out.tokens.shape == (len(seqs),) and bool(((out.tokens >= 0) & (out.tokens < vocab)).all()):
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

    def _sampling_tensors(self, seqs: list[Sequence]) -> tuple:
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
