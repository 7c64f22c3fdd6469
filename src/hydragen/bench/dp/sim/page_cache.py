"""One simulated replica's prefix cache: whole pages named by chained hash, held by requests, LRU-evicted.

The same states as ``hydragen.kv`` (held, cached, idle, free) at page level, without the KV itself. A
request's prompt pages enter the cache when it is admitted (before they are computed: a request with the
same prefix admitted meanwhile holds them and waits for their writer), its generated pages when it ends.
Idle pages are evicted least recently used, leaves first: a path is touched deepest page first, so a page
is never older than the pages after it on any path, and the oldest idle page is always a leaf. Every page
that enters or leaves produces a ``BlockStored``/``BlockRemoved`` event, as a replica publishes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hydragen.dp.kv_events import BlockRemoved, BlockStored


@dataclass
class CachedPage:
    parent: int | None
    refs: int = 0
    computed: bool = False
    writer: object | None = None  # the request computing it (None once computed)


class OutOfPages(Exception):
    """Not enough free or idle pages."""


class PageCache:
    def __init__(self, pages: int, page_size: int):
        self.capacity, self.page_size = pages, page_size
        self.pages: dict[int, CachedPage] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently used first
        self.private = 0  # pages held outside the cache (a context's partial last page, generated pages)
        self.events: list = []  # BlockStored / BlockRemoved since the last ``take_events``

    @property
    def free(self) -> int:
        return self.capacity - len(self.pages) - self.private

    def match(self, hashes: list[int]) -> int:
        """Leading pages of ``hashes`` in the cache (computed or being computed)."""
        n = 0
        for h in hashes:
            if h not in self.pages:
                break
            n += 1
        return n

    def make_room(self, pages: int) -> None:
        """Evict idle pages until ``pages`` are free; raises OutOfPages (evicting nothing) if it cannot."""
        if pages > self.free + len(self.idle):
            raise OutOfPages(pages)
        gone = []
        while self.free < pages:
            h, _ = self.idle.popitem(last=False)
            del self.pages[h]
            gone.append(h)
        if gone:
            self.events.append(BlockRemoved(gone))

    def hold(self, hashes: list[int]) -> None:
        for h in hashes:
            page = self.pages[h]
            if page.refs == 0:
                self.idle.pop(h, None)
            page.refs += 1

    def store(self, parent: int | None, hashes: list[int], tokens: list[list[int]], writer, computed: bool):
        """New pages (room already made) continuing the path that ends at ``parent``, held by the caller;
        ``writer`` computes them later unless they are ``computed`` already."""
        if not hashes:
            return
        for i, h in enumerate(hashes):
            self.pages[h] = CachedPage(
                hashes[i - 1] if i else parent, refs=1, computed=computed, writer=None if computed else writer
            )
        self.events.append(
            BlockStored(list(hashes), parent, [t for page in tokens for t in page], self.page_size)
        )

    def computed_upto(self, hashes: list[int], writer) -> None:
        """``writer`` finished computing these pages of its path."""
        for h in hashes:
            page = self.pages.get(h)
            if page is not None and page.writer is writer:
                page.computed, page.writer = True, None

    def first_uncomputed(self, hashes: list[int]) -> int | None:
        for i, h in enumerate(hashes):
            if not self.pages[h].computed:
                return i
        return None

    def release(self, hashes: list[int], writer) -> None:
        """Let go of a held path: pages it was still to compute leave the cache when nobody else holds
        them (another holder becomes their writer); the others go idle, touched deepest first."""
        removed = []
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            page = self.pages[h]
            page.refs -= 1
            if page.writer is writer and not page.computed:
                if page.refs == 0:
                    del self.pages[h]
                    removed.append(h)
                    continue
                page.writer = None  # a holder waiting on it takes it over (see ``adopt``)
            if page.refs == 0:
                self.idle[h] = None
                self.idle.move_to_end(h)
        if removed:
            self.events.append(BlockRemoved(removed))

    def adopt(self, hashes: list[int], writer) -> int | None:
        """The first page of ``hashes`` nobody is computing any more (its writer let go): ``writer`` takes
        it and every later uncomputed orphan over; returns its index, or None."""
        start = None
        for i, h in enumerate(hashes):
            page = self.pages[h]
            if not page.computed and page.writer is None:
                page.writer = writer
                start = i if start is None else start
        return start

    def take_events(self) -> list:
        out, self.events = self.events, []
        return out
