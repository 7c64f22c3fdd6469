"""What rank 0 tells the other ranks, as int64 buffers broadcast over the group.

A message is one fixed-size buffer (``FIRST`` int64: command, payload length, then the payload's start)
and, only when the payload does not fit, a second broadcast with the rest. A decode step of a few dozen
sequences fits the first buffer: one broadcast per step.

Commands: ``STEP`` (a packed batch: input ids, positions, slots, logit rows and the step-attention
metadata's tensors), ``COPY`` (KV slot copies of the no-sharing baseline), ``SETUP`` (the KV pool's
size and the attention kernel), ``NOOP`` (a heartbeat while rank 0 is idle), ``STOP``, and ``REPORT``
(after a step some worker's forward raised in: each worker sends its error's text, ``TPGroup.gather_texts``).
"""

from __future__ import annotations

import torch

from hydragen.attention.step_attention import StepAttentionMeta, distinct_metas
from hydragen.engine.model_runner import PackedBatch
from hydragen.tp.group import TPGroup

STEP, COPY, SETUP, NOOP, STOP, REPORT = range(6)
NAMES = {STEP: "step", COPY: "copy", SETUP: "setup", NOOP: "noop", STOP: "stop", REPORT: "report"}
FIRST = 2048
ATTENTION_CODES = ("auto", "fused", "torch", "none")
KV_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16)  # the KV pool's dtype in SETUP

# PackedBatch / StepAttentionMeta tensors in wire order.
_BATCH_TENSORS = ("input_ids", "positions", "slots", "logit_rows")
_META_TENSORS = (
    "units",
    "seg_tok",
    "seg_run",
    "runs",
    "seg_visible",
    "work_runs",
    "pieces",
    "blocks",
    "tok_ptr",
    "tok_parts",
    "tok_first",
    "unit_pos",
    "seg_pos",
)


def send(group: TPGroup, command: int, payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast one command (payload: a 1-D int64 CPU tensor)."""
    n = 0 if payload is None else payload.numel()
    first = torch.zeros(FIRST, dtype=torch.int64)
    first[0], first[1] = command, n
    head = min(n, FIRST - 2)
    if head:
        first[2 : 2 + head] = payload[:head]
    group.broadcast_from_first(first)
    if n > head:
        group.broadcast_from_first(payload[head:].contiguous())


def receive(group: TPGroup) -> tuple[int, torch.Tensor]:
    """Other ranks: wait for rank 0's next command; returns (command, payload)."""
    first = group.broadcast_from_first(torch.empty(FIRST, dtype=torch.int64))
    command, n = int(first[0]), int(first[1])
    head = min(n, FIRST - 2)
    payload = first[2 : 2 + head]
    if n > head:
        rest = group.broadcast_from_first(torch.empty(n - head, dtype=torch.int64))
        payload = torch.cat([payload, rest])
    return command, payload


def pack_step(batch: PackedBatch) -> torch.Tensor:
    """The batch as one int64 buffer: its scalars, which distinct metadata each layer kind reads, then per
    tensor (numel, columns), then the values (the batch's tensors with every KV group's slots, then each
    distinct metadata's)."""
    distinct, index = distinct_metas(batch.metas)
    tensors = [getattr(batch, n) for n in _BATCH_TENSORS] + list(batch.group_slots)
    scalars = [batch.num_prefill_tokens, len(batch.group_slots), len(distinct), len(index), *index]
    for meta in distinct:
        tensors += [getattr(meta, n) for n in _META_TENSORS]
        window = 0 if meta.window is None else meta.window  # a window is >= 1
        scalars += [meta.num_tokens, meta.num_parts, meta.max_item_tokens, meta.slots_needed, window]
    shapes = []
    for t in tensors:
        shapes += [t.numel(), t.shape[1] if t.dim() == 2 else 0]
    head = torch.tensor(scalars + shapes, dtype=torch.int64)
    return torch.cat([head] + [t.reshape(-1).to("cpu", torch.int64) for t in tensors])


def unpack_step(payload: torch.Tensor, device: torch.device) -> PackedBatch:
    """The PackedBatch rank 0 packed, on ``device``; the torch kernel's Python lists are rebuilt too."""
    num_prefill, more_groups, num_distinct, num_specs = payload[:4].tolist()
    at = 4
    index = payload[at : at + num_specs].tolist()
    at += num_specs
    meta_scalars = payload[at : at + 5 * num_distinct].view(-1, 5).tolist()
    at += 5 * num_distinct
    groups = [f"slots.{g}" for g in range(1, 1 + more_groups)]
    names = list(_BATCH_TENSORS) + groups + [f"{n}.{m}" for m in range(num_distinct) for n in _META_TENSORS]
    shapes = payload[at : at + 2 * len(names)].tolist()
    at += 2 * len(names)
    values = {}
    for i, name in enumerate(names):
        numel, cols = shapes[2 * i], shapes[2 * i + 1]
        flat = payload[at : at + numel]
        values[name] = flat.view(-1, cols) if cols else flat
        at += numel
    metas = [
        _unpack_meta({n: values[f"{n}.{m}"] for n in _META_TENSORS}, meta_scalars[m], device)
        for m in range(num_distinct)
    ]
    on = {name: values[name].to(device) for name in _BATCH_TENSORS}
    return PackedBatch(
        on["input_ids"], on["positions"], on["slots"], tuple(metas[i] for i in index), on["logit_rows"],
        num_prefill_tokens=num_prefill, group_slots=tuple(values[n].to(device) for n in groups),
    )  # fmt: skip


def _unpack_meta(values: dict, scalars: list[int], device: torch.device) -> StepAttentionMeta:
    num_tokens, num_parts, max_item_tokens, slots_needed, window = scalars
    units, seg_tok, seg_run = values["units"], values["seg_tok"].tolist(), values["seg_run"].tolist()
    runs = [tuple(r) for r in values["runs"].tolist()]
    visible = values["seg_visible"].tolist()
    segment_list = [
        (seg_tok[s], seg_tok[s + 1], runs[seg_run[s] : seg_run[s + 1]], visible[s])
        for s in range(len(visible))
    ]
    return StepAttentionMeta(
        **{name: values[name].to(device) for name in _META_TENSORS},
        num_tokens=num_tokens,
        num_parts=num_parts,
        max_item_tokens=max_item_tokens,
        slots_needed=slots_needed,
        unit_list=[tuple(u) for u in units.tolist()],
        segment_list=segment_list,
        window=window or None,
    )


def pack_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.cat([dst.reshape(-1).cpu(), src.reshape(-1).cpu()]).to(torch.int64)


def unpack_copy(payload: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dst, src = payload.to(device).chunk(2)
    return dst, src
