"""Preallocated KV storage for all layers, handed out in contiguous runs of token slots.

A run is [start, start + length) in the flat slot axis. Contiguity is the point: a tree node's keys are
a zero-copy view ``k[layer, start:end]`` that a fused kernel reads directly, and a decode batch's private
tails form one [rows, cap] block viewed as a batch without gathering. Free space is a sorted list of
extents, allocated best-fit and coalesced on free.
"""

from __future__ import annotations

import bisect

import torch


class OutOfSlots(RuntimeError):
    """No free run is long enough; the caller may evict cached prefixes and retry."""


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_slots]
        self.used = 0

    @property
    def free(self) -> int:
        return self.num_slots - self.used

    def largest_run(self) -> int:
        return max(self._lengths, default=0)

    def alloc(self, n: int) -> int:
        """Start of a contiguous run of n slots (best fit). Raises OutOfSlots."""
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        best = -1
        for i, length in enumerate(self._lengths):
            if length >= n and (best < 0 or length < self._lengths[best]):
                best = i
                if length == n:
                    break
        if best < 0:
            raise OutOfSlots(
                f"no free run of {n} KV slots (free {self.free}, largest run {self.largest_run()})"
            )
        start = self._starts[best]
        if self._lengths[best] == n:
            del self._starts[best], self._lengths[best]
        else:
            self._starts[best] += n
            self._lengths[best] -= n
        self.used += n
        return start

    def release(self, start: int, n: int) -> None:
        if n <= 0:
            return
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, n)
        self.used -= n
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)


class KVPool:
    """k/v: [num_layers, num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # torch.empty reserves address space only; pages are touched when slots are first written.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.allocator = SlotAllocator(num_slots)
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k.element_size()
        self.peak_used = 0

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def alloc(self, n: int) -> int:
        start = self.allocator.alloc(n)
        self.peak_used = max(self.peak_used, self.allocator.used)
        return start

    def release(self, start: int, n: int) -> None:
        self.allocator.release(start, n)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [T, Hkv, D] of one layer at ``slots`` [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy K/V of slots ``src`` into slots ``dst`` across all layers in one indexed op per tensor."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
