"""Paged KV storage: fixed-size pages of token slots, handed out by page, shared through refcounts.

k/v are ``[layers, num_pages * page_size, Hkv, D]``: slot ``s`` lives in page ``s // page_size``. Pages are
the unit of allocation, so an allocation succeeds whenever enough pages are free, however scattered they
are. The allocator still prefers consecutive pages (best fit over free extents, and growth right after a
holder's last page) because consecutive pages are consecutive slots: one zero-copy view a fused kernel
reads directly.

``refs[p]`` counts the page tables that hold page p. A page nobody holds is either free (in the
allocator) or kept by the prefix cache, which decides that (``kv/manager.py``); the pool only counts.

**Layer groups** (``kv/layout.py``). A model whose layers form several KV groups has a page of every group
for each page of a table: the page ids tables, the tree and the scheduler see are group 0's, and
``group_pages[g][p]`` is group g's page beside page p, taken and freed with it (from the one allocator, so
any group can use a page another gave back). The tensors are ``[rows, slots, Hkv, D]``, layer i in row
``layout.row_of_layer[i]`` of its group's pages. ``num_pages`` and the free/used counts are in table
pages (a page of every group each). With one group, group_pages is the identity and rows are layers.

A sliding-window group's page (``layout.released``) can go before its table page: ``part_refs[g][p]``
counts the holds on group g's page beside p (a table holds it while its window can still read it), and
``free_part`` gives it back alone (``group_pages[g][p] = -1``); the KV manager decides when.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from hydragen.kv.layout import KVLayout

PageRuns = list[tuple[int, int]]  # [(first_page, end_page), ...]


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

    def alloc(self, n: int) -> PageRuns:
        """n pages as runs [(first, end), ...]: one run when an extent fits, else the largest extents."""
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        if n > self.free:
            raise OutOfPages(f"need {n} KV pages, {self.free} free")
        fits = [i for i, length in enumerate(self._lengths) if length >= n]
        if fits:
            i = min(fits, key=lambda j: (self._lengths[j], self._starts[j]))
            return [self._take(i, n)]
        runs: PageRuns = []
        while n:
            i = max(range(len(self._lengths)), key=lambda j: (self._lengths[j], -self._starts[j]))
            take = min(n, self._lengths[i])
            runs.append(self._take(i, take))
            n -= take
        runs.sort()
        return runs

    def alloc_at(self, page: int, n: int) -> bool:
        """Take pages [page, page + n) if they are all free (lets a holder grow without breaking its run)."""
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
        if (i < len(self._starts) and self._starts[i] < start + n) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start
        ):
            raise RuntimeError(f"KV pages [{start}, {start + n}) released while already free")
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
        layout: KVLayout | None = None,
    ):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size and num_pages must be positive, got {page_size}, {num_pages}")
        layout = layout or KVLayout.single(num_layers)
        if len(layout.group_of_layer) != num_layers:
            raise ValueError(f"a KV layout of {len(layout.group_of_layer)} layers for {num_layers} layers")
        self.layout, self.groups = layout, layout.groups
        self.page_size, self.num_pages = page_size, num_pages
        physical = num_pages * self.groups
        shape = (layout.rows, physical * page_size, num_kv_heads, head_dim)
        # torch.empty reserves address space only; pages are touched when slots are first written.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(physical)
        self.refs = [0] * physical
        # group_pages[g][p]: group g's page beside table page p (-1: none); group 0's is p itself.
        self.group_pages = [list(range(physical))] + [[-1] * physical for _ in range(self.groups - 1)]
        # part_refs[g][p]: holds on window group g's page beside table page p (kv/manager.py)
        self.part_refs = {g: [0] * physical for g in layout.released}
        self.bytes_per_token = 2 * layout.rows * self.groups * num_kv_heads * head_dim * self.k.element_size()
        self.peak_used = 0

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return self.allocator.free // self.groups

    @property
    def free_physical(self) -> int:
        """Free pages of any group (a table page takes one of every group)."""
        return self.allocator.free

    @property
    def used_pages(self) -> int:
        """Pages out of the allocator: held by page tables or kept by the prefix cache."""
        return self.num_pages - self.free_pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def take(self, n: int, after: int | None = None) -> list[int]:
        """n fresh pages, each held once; right after page ``after`` when those are free (the holder's run
        then stays one view), else best fit. Raises OutOfPages when fewer than n are free. Each comes with
        a page of every other group (``group_pages``)."""
        if n <= 0:
            return []
        groups = self.groups
        grow = groups == 1 and after is not None and after + 1 + n <= self.num_pages
        if grow and self.allocator.alloc_at(after + 1, n):
            pages = list(range(after + 1, after + 1 + n))
        else:
            if n * groups > self.allocator.free:
                raise OutOfPages(f"need {n} KV pages, {self.free_pages} free")
            taken = [p for a, b in self.allocator.alloc(n * groups) for p in range(a, b)]
            pages = taken[:n]
            for g in range(1, groups):  # each group's pages a run of their own where the extents allow
                for p, q in zip(pages, taken[g * n : (g + 1) * n], strict=True):
                    self.group_pages[g][p] = q
        for p in pages:
            self.refs[p] = 1
            for held in self.part_refs.values():
                held[p] = 1
        self.peak_used = max(self.peak_used, self.used_pages)
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drop one hold on each page; returns the pages nobody holds any more (the caller frees or keeps
        them: the pool does not know which ones the prefix cache wants)."""
        dropped = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                dropped.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"KV page {p} released more often than held")
        return dropped

    def free(self, pages: Iterable[int]) -> None:
        """Give unheld pages back to the allocator (with their other groups' pages still there)."""
        for p in pages:
            if self.refs[p]:
                raise RuntimeError(f"KV page {p} freed while held {self.refs[p]} time(s)")
            self.allocator.release(p)
            for g in range(1, self.groups):
                if self.group_pages[g][p] >= 0:
                    self.free_part(g, p)

    def free_part(self, group: int, page: int) -> None:
        """Give back group ``group``'s page beside table page ``page`` alone (a window moved past it)."""
        held = self.part_refs.get(group)
        if held is not None and held[page]:
            raise RuntimeError(f"group {group}'s page beside {page} freed while held {held[page]} time(s)")
        self.allocator.release(self.group_pages[group][page])
        self.group_pages[group][page] = -1

    def in_group(self, pages, group: int) -> tuple[int, ...]:
        """Group ``group``'s pages beside table pages ``pages``."""
        if group == 0:
            return tuple(pages)
        mine = self.group_pages[group]
        return tuple(mine[p] for p in pages)

    def write(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [T, Hkv, D] of one layer (its ``row``, at its group's ``slots`` [T]), rounded to the
        pool's dtype (a 16-bit cache under float32 compute)."""
        self.k[row].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[row].index_copy_(0, slots, v.to(self.v.dtype))

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy K/V of table slots ``src`` into ``dst`` in every layer, each group's in its own pages (a
        page's computed part handed to another holder; the no-sharing baseline's private copies). A window
        group's page gone on either side (outside the window) is not copied."""
        if self.groups > 1:
            dst, src = self._every_group(dst, src)
        self.copy_physical(dst, src)

    def _every_group(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ps = self.page_size
        to, of = dst.tolist(), src.tolist()
        out_to, out_of = list(to), list(of)
        for g in range(1, self.groups):
            mine = self.group_pages[g]
            for d, s in zip(to, of, strict=True):
                a, b = mine[d // ps], mine[s // ps]
                if a >= 0 and b >= 0:
                    out_to.append(a * ps + d % ps)
                    out_of.append(b * ps + s % ps)
        as_tensor = lambda x: torch.tensor(x, dtype=src.dtype, device=src.device)  # noqa: E731
        return as_tensor(out_to), as_tensor(out_of)

    def copy_physical(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots ``src`` into ``dst`` in every row (slots of any group, as stored)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def page_runs(pages: Iterable[int]) -> PageRuns:
    """Consecutive pages merged into runs [(first, end), ...], in order."""
    out: PageRuns = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
