"""Paged KV storage: fixed-size pages of token slots, handed out as runs, shared through refcounts.

k/v are ``[layers, num_pages * page_size, Hkv, D]``: slot ``s`` lives in page ``s // page_size``. Pages
are the unit of allocation, so an allocation succeeds whenever enough pages are free, however they are
scattered. The allocator still prefers consecutive pages (best-fit over free extents) because a run of
consecutive pages is a run of consecutive slots: one zero-copy view that a fused kernel reads directly.

Holders (tree nodes, sequence tails) own *slot runs* ``[(lo, hi), ...]``. Splitting a tree node at a
token inside a page leaves both halves touching that page, so pages are reference counted by holders:
a holder counts once on every page it touches, and a page returns to the free list when no holder
touches it any more.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

Runs = list[tuple[int, int]]


class OutOfPages(RuntimeError):
    """Not enough free pages; the caller may evict cached prefixes or preempt, then retry."""


class PageAllocator:
    """Free pages as sorted, coalesced extents; allocation returns page runs (best fit first)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_pages]
        self.free = num_pages

    def largest_run(self) -> int:
        return max(self._lengths, default=0)

    def alloc(self, n: int) -> Runs:
        """n pages as runs [(first, end), ...]: one run when an extent fits, else the largest extents."""
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        if n > self.free:
            raise OutOfPages(f"need {n} KV pages, {self.free} free")
        fits = [i for i, length in enumerate(self._lengths) if length >= n]
        if fits:
            i = min(fits, key=lambda j: (self._lengths[j], self._starts[j]))
            return [self._take(i, n)]
        runs: Runs = []
        while n:
            i = max(range(len(self._lengths)), key=lambda j: (self._lengths[j], -self._starts[j]))
            take = min(n, self._lengths[i])
            runs.append(self._take(i, take))
            n -= take
        runs.sort()
        return runs

    def alloc_at(self, page: int, n: int) -> bool:
        """Take pages [page, page + n) if they are all free (lets a tail grow without breaking its run)."""
        i = bisect.bisect_right(self._starts, page) - 1
        if i < 0 or self._starts[i] + self._lengths[i] < page + n:
            return False
        start, length = self._starts[i], self._lengths[i]
        del self._starts[i], self._lengths[i]
        if page > start:
            self._starts.insert(i, start)
            self._lengths.insert(i, page - start)
            i += 1
        if start + length > page + n:
            self._starts.insert(i, page + n)
            self._lengths.insert(i, start + length - page - n)
        self.free -= n
        return True

    def _take(self, i: int, n: int) -> tuple[int, int]:
        start = self._starts[i]
        if self._lengths[i] == n:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += n
            self._lengths[i] -= n
        self.free -= n
        return start, start + n

    def release(self, start: int, n: int = 1) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, n)
        self.free += n
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)


class PagePool:
    """KV tensors plus the page allocator and per-page holder counts."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        device,
    ):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size and num_pages must be positive, got {page_size}, {num_pages}")
        self.page_size, self.num_pages = page_size, num_pages
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # torch.empty reserves address space only; pages are touched when slots are first written.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)
        self.refs = [0] * num_pages
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k.element_size()
        self.peak_used = 0
        # How often a growing holder got the page right after its last one (its run stays one view).
        self.stats_contiguous_growth = 0
        self.stats_split_growth = 0

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.allocator.free

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, tokens: int) -> Runs:
        """Fresh pages for ``tokens`` slots (held once); returns the slot runs covering whole pages."""
        ps = self.page_size
        page_runs = self.allocator.alloc(self.pages_for(tokens))
        for a, b in page_runs:
            for p in range(a, b):
                self.refs[p] = 1
        self.peak_used = max(self.peak_used, self.used_pages)
        return [(a * ps, b * ps) for a, b in page_runs]

    def extend(self, runs: Runs, tokens: int) -> Runs:
        """Fresh pages for ``tokens`` more slots after ``runs``, consecutive with its last page when free."""
        n = self.pages_for(tokens)
        if runs and runs[-1][1] % self.page_size == 0:
            nxt = runs[-1][1] // self.page_size
            if nxt + n <= self.num_pages and self.allocator.alloc_at(nxt, n):
                for p in range(nxt, nxt + n):
                    self.refs[p] = 1
                self.peak_used = max(self.peak_used, self.used_pages)
                self.stats_contiguous_growth += 1
                return [(nxt * self.page_size, (nxt + n) * self.page_size)]
        self.stats_split_growth += bool(runs)
        return self.allocate(tokens)

    def pages(self, runs: Runs) -> set[int]:
        """Pages touched by slot runs."""
        ps, out = self.page_size, set()
        for lo, hi in runs:
            if hi > lo:
                out.update(range(lo // ps, (hi - 1) // ps + 1))
        return out

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.allocator.release(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"KV page {p} released more often than held")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [T, Hkv, D] of one layer at ``slots`` [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy K/V of slots ``src`` into ``dst`` in every layer (the no-sharing baseline's copies)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


# ---- slot runs ------------------------------------------------------------------------------------
def runs_len(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def take_runs(runs: Runs, n: int) -> Runs:
    """The first n slots of ``runs``."""
    return split_runs(runs, n)[0]


def split_runs(runs: Runs, n: int) -> tuple[Runs, Runs]:
    """(first n slots, the rest) of ``runs``."""
    head: Runs = []
    rest: Runs = []
    left = n
    for a, b in runs:
        if left >= b - a:
            head.append((a, b))
            left -= b - a
        elif left > 0:
            head.append((a, a + left))
            rest.append((a + left, b))
            left = 0
        else:
            rest.append((a, b))
    return head, rest


def slice_runs(runs: Runs, start: int, end: int) -> Runs:
    """Slots [start, end) of the concatenation of ``runs``."""
    return split_runs(split_runs(runs, end)[0], start)[1]


def append_runs(runs: Runs, more: Runs) -> None:
    """Extend ``runs`` in place, merging a run that continues the last one."""
    for a, b in more:
        if b <= a:
            continue
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))


def coalesce(runs: Runs) -> Runs:
    out: Runs = []
    append_runs(out, runs)
    return out


def slot_list(runs: Runs) -> list[int]:
    out: list[int] = []
    for a, b in runs:
        out.extend(range(a, b))
    return out
