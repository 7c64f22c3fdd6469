"""Sliding-window groups' pages (kv/window_pages.py): a table holds only what its windows read, released
pages stay for prefix hits as idle parts, a hit never ends where a window's keys are gone, and eviction
never leaves the tree pages that cannot hit. Pages of 4 tokens, a window of 8 (two pages), straight on the
KV manager: every step is followed by the manager's own invariant check."""

from __future__ import annotations

import torch

from hydragen.kv.layout import KVLayout
from hydragen.kv.manager import KVManager, PageTable
from hydragen.kv.pool import PagePool

PS, W = 4, 8


def manager(pages: int = 64, window: int = W) -> KVManager:
    layout = KVLayout((0, 1, 1, 0), (None, window))  # full layers 0 and 3, sliding layers 1 and 2
    return KVManager(PagePool(4, pages, PS, 1, 2, torch.float32, "cpu", layout))


def run(kv: KVManager, table: PageTable, tokens: list[int], publish: bool = True) -> None:
    """Admit ``table`` for ``tokens`` and compute it one page at a time (a long prefill in chunks)."""
    assert kv.admit(table, tokens, None, None) is not None
    for end in range(table.computed + PS, len(tokens) + PS, PS):
        end = min(end, len(tokens))
        assert kv.allocate(table, end)
        kv.computed_to(table, end)
        if publish:
            kv.publish(table, tokens, end)
        kv.check([table])


def parts_held(kv: KVManager, table: PageTable) -> list[int]:
    """The table's pages whose sliding group's page is there."""
    return [i for i, p in enumerate(table.pages) if kv.pool.group_pages[1][p] >= 0]


def test_a_long_context_keeps_its_full_layers_and_one_window():
    kv = manager()
    t = PageTable()
    tokens = list(range(100, 180))  # 20 pages
    run(kv, t, tokens, publish=False)  # sharing off: nothing is cached
    # The window moves one forward late (after the pages that forward filled are published): to where the
    # next-to-last chunk ended, 76, whose token reads positions 69..76.
    assert t.window_from == {1: (76 - W + 1) // PS}
    assert parts_held(kv, t) == [17, 18, 19]
    assert kv.pool.free_physical == 2 * 64 - 20 - 3  # 20 full-layer pages, 3 sliding ones: not 40
    kv.release(t, None)
    kv.check([])
    assert kv.pool.free_physical == 2 * 64


def test_released_window_pages_stay_for_hits_and_a_hit_ends_where_the_window_exists():
    kv = manager()
    a = PageTable()
    tokens = list(range(100, 140))  # 10 pages
    run(kv, a, tokens)
    assert kv.windows.idle == 7  # pages 0-6: released by the window (a forward late), kept for hits
    kv.release(a, tokens)
    kv.check([])
    assert kv.windows.idle == 10 and kv.idle == 10
    b = PageTable()
    assert kv.cached_pages(b, tokens + [1, 2, 3, 4]) == 10

    # The leaf's own sliding page goes: no hit can end there (its next token reads it), so the leaf goes
    # with it; the page before is still a valid end.
    dead = kv.windows.evict(1, a_pages(kv, tokens)[9])
    assert [n.depth for n in dead] == [9]
    for node in dead:
        kv._evict_leaf(node)
    kv.check([])
    assert kv.cached_pages(b, tokens + [1, 2, 3, 4]) == 9

    # An inner sliding page goes: the ends whose windows read it are cut back past it.
    kv.windows.evict(1, a_pages(kv, tokens)[3])
    kv.check([])
    c = PageTable()
    assert kv.cached_pages(c, tokens[:20] + [7] * 9) == 3  # ends after pages 4 and 5 read page 3
    assert kv.cached_pages(PageTable(), tokens + [1]) == 9  # deeper ends never read it
    assert kv.unreachable_pages() == 0

    # Starting on a hit holds its window's pages again: they are no longer idle.
    idle = kv.windows.idle
    assert kv.admit(b, tokens + [1, 2, 3, 4], None, None) == 9
    assert b.window_from == {1: 7} and kv.windows.idle == idle - 2
    kv.check([b])


def test_a_table_on_a_hit_holds_the_hits_window_until_it_ends():
    """A request that starts on a shared prefix keeps that prefix's last window held while it runs, though its
    own window moves on: the next request sharing the prefix hits all of it however hard the cache is
    evicted meanwhile (without the anchor the window's parts were idle, and evicted first)."""
    kv = manager()
    system = list(range(100, 132))  # 8 pages; a hit at its end reads positions 25-31: pages 6 and 7
    a = PageTable()
    run(kv, a, system + [1, 2, 3, 4])
    kv.release(a, system + [1, 2, 3, 4])
    b = PageTable()
    mine = system + list(range(200, 240))  # 10 pages past the hit: its window leaves the prompt behind
    run(kv, b, mine)
    assert b.anchor == 8 and b.window_from[1] > 8
    held = kv.pool.part_refs[1]
    assert [held[p] for p in b.pages[4:8]] == [0, 0, 1, 1]
    kv.evict_idle()  # every idle part and idle page goes; the prompt's pages are b's
    kv.check([b])
    assert kv.cached_pages(PageTable(), system + [9] * 5) == 8
    anchored = b.pages[6:8]
    kv.release(b, mine)  # the anchor's parts are now idle, kept for hits like any released part
    kv.check([])
    assert [held[p] for p in anchored] == [0, 0] and kv.windows.idle >= 2
    assert kv.cached_pages(PageTable(), system + [9] * 5) == 8


def a_pages(kv: KVManager, tokens: list[int]) -> list[int]:
    """The cached pages of ``tokens``, in order."""
    probe = PageTable()
    n = kv.cached_pages(probe, tokens + [0])
    return [node.page for node in kv.tree.match(tokens, kv._hashes(probe, tokens, n))]


def test_eviction_frees_old_window_pages_first_and_leaves_no_dead_pages():
    """A small pool: a second long context needs room, taken least recently used first from the idle
    sliding pages and idle leaves; every idle leaf left is still a valid end."""
    kv = manager(pages=24)
    a, b = PageTable(), PageTable()
    first = list(range(100, 140))
    run(kv, a, first)
    kv.release(a, first)
    run(kv, b, list(range(500, 560)))  # 15 pages and their window: needs what a left behind
    kv.check([b])
    assert kv.unreachable_pages() == 0
    for page, node in kv.tree.nodes.items():
        if not node.children and not kv.pool.refs[page]:
            assert kv.windows.valid_end(node)
    kv.release(b, None)
    kv.check([])


def test_fork_and_truncate_respect_the_window():
    kv = manager()
    src = PageTable()
    tokens = list(range(100, 138))  # 9 full pages and 2 tokens
    run(kv, src, tokens)
    reserved = kv.reserve(1)
    dst = PageTable()
    kv.fork(dst, src, src.computed, 9, list(reserved))
    assert dst.window_from == src.window_from
    kv.check([src, dst])
    assert kv.allocate(src, 44)
    kv.computed_to(src, 44, verified=38)  # drafted positions past its context: its window stays
    kv.check([src, dst])
    try:
        kv.truncate(src, 30)  # below published pages
    except ValueError as e:
        assert "cannot truncate" in str(e)
    else:
        raise AssertionError("a truncation below a released window was accepted")
    kv.truncate(src, 38)
    kv.check([src, dst])
    assert kv.allocate(src, 50)
    kv.computed_to(src, 46)
    kv.computed_to(src, 50)  # no drafts: the window moves on (to 46, a forward late), and cannot come back
    try:
        kv.truncate(src, 38)
    except ValueError as e:
        assert "window" in str(e)
    else:
        raise AssertionError("a truncation below a released window was accepted")
    kv.release(src, tokens)
    kv.release(dst, tokens)
    kv.check([])


def test_unreachable_pages_counts_cached_pages_no_hit_can_use():
    """A window of 2 tokens inside 4-token pages: a running table's window sits in its partial last page, so
    its published pages' window pages are idle; evicted, the path it holds can end no hit until it publishes
    the next page. The metric counts those pages, and is 0 again after."""
    kv = manager(window=2)
    t = PageTable()
    tokens = list(range(100, 140))
    assert kv.admit(t, tokens[:38], None, None) is not None
    for end in (4, 20, 36, 38, 39):  # (a window moves a forward late)
        assert kv.allocate(t, end)
        kv.computed_to(t, end)
        kv.publish(t, tokens, end)
    assert t.published == 9 and kv.unreachable_pages() == 0
    while (part := kv.windows.oldest_idle()) is not None:
        assert kv.windows.evict(part[1], part[2]) == []  # t holds the path: nothing to prune
    kv.check([t])
    assert kv.unreachable_pages() == 9  # every end on t's path reads a window page that is gone
    assert kv.unreachable_pages(max_age=60.0) == 9  # reused within max_age
    assert kv.allocate(t, 40)
    kv.computed_to(t, 40)
    kv.publish(t, tokens, 40)  # page 9: its own window page is there, so it ends a hit
    assert kv.unreachable_pages() == 0
    kv.check([t])
