"""The running decode batch: sequences in prefix-tree DFS order, private tails, and the attention plan.

* Sequences are sorted depth-first by their shared prompt, so the sequences under any tree node are a
  contiguous range [i, j) of the batch: a node's queries are a slice, never a gather.
* Each sequence's private tail (prompt tokens not worth sharing, the last prompt token, and generated
  tokens) is one row of a single [rows, cap] block of pool slots, read as a batch with no copy.
* The plan lists (slot run, query range) items, one per shared node run; a step's attention is one
  batched tail partial plus one matrix-matrix partial per item, merged through their LSE. With
  ``impl="triton"`` the items become device tables (``attention/tree_plan.py``) and a layer is two or
  three kernel launches, however many items there are.
The block is rebuilt (tails copied once) only when sequences join or half of its rows are dead.
"""

from __future__ import annotations

import torch

from hydragen.attention.merge import merge_into
from hydragen.attention.shared_prefix import level_attention, suffix_attention
from hydragen.attention.tree_plan import TreePlan, build_tree_plan
from hydragen.engine.sequence import Sequence
from hydragen.kv.pool import KVPool


class DecodeBatch:
    # Extra build_tree_plan arguments (chunk_tokens, block_m, tail_split_len, ...); tests shrink them.
    plan_options: dict = {}

    def __init__(self, pool: KVPool, seqs: list[Sequence], cap: int, base: int, device):
        """``base``: first slot of an already allocated run of len(seqs) * cap slots."""
        self.pool, self.device = pool, device
        self.seqs = seqs
        self.rows = len(seqs)
        self.cap = cap
        self.base = base
        # Slots a view may read must hold finite values (0 * NaN would poison masked-out keys).
        pool.k[:, self.base : self.base + self.rows * cap].zero_()
        pool.v[:, self.base : self.base + self.rows * cap].zero_()
        self.row_alive = [True] * self.rows
        for r, s in enumerate(seqs):
            s.row = r
        self.items: list[tuple[int, int, int, int]] = []
        self.refresh()

    # ---- membership -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Recompute per-step tensors and the plan after sequences joined or left."""
        seqs, dev = self.seqs, self.device
        self.row_index = torch.tensor([s.row for s in seqs], dtype=torch.long, device=dev)
        self.tail_lens = torch.tensor([s.tail_len for s in seqs], dtype=torch.long, device=dev)
        self.positions = torch.tensor([s.cut + s.tail_len for s in seqs], dtype=torch.long, device=dev)
        self.max_len = max((s.tail_len for s in seqs), default=0)
        self.tail_tokens = sum(s.tail_len for s in seqs)
        self.uniform = len({s.tail_len for s in seqs}) <= 1 and len(seqs) == self.rows
        self.items = plan_items(seqs)
        self.tree_plan: TreePlan | None = None  # Triton tables, built on first use after a change

    def retire(self, seq: Sequence, keep: tuple[int, int] | None = None) -> None:
        """Free a leaving sequence's row at once, except slots [keep) that now belong to the tree."""
        base = self.base + seq.row * self.cap
        if keep is None:
            self.pool.release(base, self.cap)
        else:
            self.pool.release(base, keep[0])
            self.pool.release(base + keep[1], self.cap - keep[1])
        self.row_alive[seq.row] = False

    def remove(self, leaving: set[int]) -> None:
        """Drop retired sequences (by id) from the running list; the block stays until compaction."""
        self.seqs = [s for s in self.seqs if id(s) not in leaving]
        self.refresh()

    def release(self) -> None:
        for r, alive in enumerate(self.row_alive):
            if alive:
                self.pool.release(self.base + r * self.cap, self.cap)
                self.row_alive[r] = False

    @property
    def dead_fraction(self) -> float:
        return 1 - len(self.seqs) / max(self.rows, 1)

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self) -> torch.Tensor:
        """Reserve each sequence's next tail slot; returns the slots [B] for this step's K/V."""
        slots = self.base + self.row_index * self.cap + self.tail_lens
        self.tail_lens += 1
        self.max_len += 1
        self.tail_tokens += len(self.seqs)
        if not self.uniform:
            self.row_lens = torch.zeros(self.rows, dtype=torch.long, device=self.device)
            self.row_lens[self.row_index] = self.tail_lens
        return slots

    def end_step(self) -> None:
        self.positions += 1

    def attention(self, layer: int, q: torch.Tensor, scale: float, impl: str) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]: tails for the whole batch at once, then each shared item."""
        if impl == "triton":
            return self._triton_attention(layer, q, scale)
        pool, b = self.pool, q.shape[0]
        hkv, d = pool.k.shape[2], pool.k.shape[3]
        block = slice(self.base, self.base + self.rows * self.cap)
        kb = pool.k[layer, block].view(self.rows, self.cap, hkv, d)[:, : self.max_len]
        vb = pool.v[layer, block].view(self.rows, self.cap, hkv, d)[:, : self.max_len]
        if self.uniform:
            out, lse = suffix_attention(q.unsqueeze(1), kb, vb, None, scale, impl)
        else:
            qr = q.new_zeros(self.rows, 1, q.shape[1], d)
            qr[self.row_index] = q.unsqueeze(1)
            out, lse = suffix_attention(qr, kb, vb, self.row_lens, scale, impl)
            if self.rows != b:
                out, lse = out[self.row_index], lse[self.row_index]
        if not self.items:
            return out.view(b, -1, d)
        acc, acc_lse = out.view(b, -1, d).float(), lse.view(b, -1).contiguous()
        for start, end, i, j in self.items:
            o, lo = level_attention(
                q[i:j].unsqueeze(1),
                pool.k[layer, start:end].unsqueeze(0),
                pool.v[layer, start:end].unsqueeze(0),
                scale,
                impl,
            )
            merge_into(acc[i:j], acc_lse[i:j], o.squeeze(1), lo.squeeze(1))
        return acc.to(q.dtype)

    def _triton_attention(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Shared units, tails and merge as one launch each; only the tail lengths change per step."""
        from hydragen.attention.triton_kernels import tree_decode_attention  # optional dependency

        k, v = self.pool.k[layer], self.pool.v[layer]
        if self.tree_plan is None:
            hkv = k.shape[1]
            self.tree_plan = build_tree_plan(
                self.items,
                self.base + self.row_index * self.cap,
                group=q.shape[1] // hkv,
                num_kv_heads=hkv,
                tail_cap=self.cap,
                **self.plan_options,
            )
        return tree_decode_attention(q, k, v, self.tree_plan, self.tail_lens, scale)


def plan_items(seqs: list[Sequence]) -> list[tuple[int, int, int, int]]:
    """(slot_start, slot_end, i, j) for every shared node run read by the contiguous sequences [i, j).

    Nodes below a sequence's cut are shared by it. Consecutive nodes read by the same range whose slot
    runs touch are fused into one item, so a chain of short nodes costs one kernel call.
    """
    spans: dict[int, list] = {}  # id(node) -> [node, first, last]
    order = []
    for idx, s in enumerate(seqs):
        if s.node is None:
            continue
        for node in s.node.path():
            if node.end_pos > s.cut:
                break
            span = spans.get(id(node))
            if span is None or span[2] != idx - 1:
                span = [node, idx, idx]
                spans[id(node)] = span
                order.append(span)
            else:
                span[2] = idx
    items: list[tuple[int, int, int, int]] = []
    for node, i, last in order:
        start, end = node.slot, node.slot + len(node.tokens)
        prev = items[-1] if items else None
        if prev and prev[2:] == (i, last + 1) and prev[1] == start:
            items[-1] = (prev[0], end, i, last + 1)
        else:
            items.append((start, end, i, last + 1))
    return items
