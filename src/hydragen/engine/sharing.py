"""Which context pages a step reads once for many sequences (Hydragen's shared units), by the cost rule.

Work items sorted by their page tables put the items that hold the same page next to each other (a page
held by several tables has the same pages before it in all of them). The longest common prefix of
neighbours then gives the shared structure of the step as nested intervals: items [lo, hi) share pages
[parent depth, depth). Each interval is read by one batched call when the cost rule says it pays; an item
reads everything above its deepest such interval through shared runs too (its cut is a prefix), and the
rest of its context per sequence, in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydragen.engine.step_plan import SharedRun, Work

# The cost rule: pages read by q query rows through one batched call save (q - 1) x tokens KV reads per
# step, less the LSE merge of each extra row (worth about MERGE_ROW_TOKENS reads); sharing pays when that
# reaches min_shared_reads. Below it each sequence reads them itself, in place (no copy either way).
# Fitted on a 2-core CPU (docs/performance.md, "cost rule").
DEFAULT_MIN_SHARED_READS = 2048
MERGE_ROW_TOKENS = 16


def sharing_pays(
    holders: int, tokens: int, min_shared_reads: int, merge_row_tokens: int = MERGE_ROW_TOKENS
) -> bool:
    """The cost rule for one group (0 turns it off: everything held by two is shared). ``holders`` is the
    number of query rows that read it; ``merge_row_tokens`` is what ``bench cost-rule`` fits."""
    return min_shared_reads == 0 or (holders - 1) * (tokens - merge_row_tokens) >= min_shared_reads


@dataclass
class _Interval:
    lo: int
    hi: int  # items [lo, hi)
    top: int  # pages [top, depth) are this interval's own
    depth: int


def context_pages(w: Work, page_size: int) -> tuple[int, ...]:
    """The pages holding only context computed before this step (what other items may share)."""
    return w.pages[: w.start // page_size]


def order(work: list[Work], page_size: int) -> list[Work]:
    """Depth-first order of the step's page tables."""
    return sorted(work, key=lambda w: (context_pages(w, page_size), w.seq.request.request_id, w.seq.index))


def plan_sharing(
    work: list[Work], page_size: int, min_shared_reads: int
) -> tuple[list[SharedRun], list[int]]:
    """(shared runs, cut per item) for items already in depth-first order."""
    n = len(work)
    pages = [context_pages(w, page_size) for w in work]
    lcp = [_common_prefix(pages[i - 1], pages[i]) for i in range(1, n)]
    intervals = _intervals(lcp, n)
    rows = [0]
    for w in work:
        rows.append(rows[-1] + len(w.tokens))
    cuts = [0] * n
    for iv in intervals:
        if sharing_pays(rows[iv.hi] - rows[iv.lo], (iv.depth - iv.top) * page_size, min_shared_reads):
            for i in range(iv.lo, iv.hi):
                cuts[i] = max(cuts[i], iv.depth)
    runs: list[SharedRun] = []
    for iv in intervals:
        i = iv.lo
        while i < iv.hi:  # maximal stretches of the interval whose items read it shared
            if cuts[i] < iv.depth:
                i += 1
                continue
            j = i
            while j < iv.hi and cuts[j] >= iv.depth:
                j += 1
            if j - i > 1:
                runs.append(SharedRun(iv.top, iv.depth, i, j))
            else:  # one item alone: it reads these pages itself
                pass
            i = j
    for i in range(n):  # a cut is only worth a shared run where another item shares it
        cuts[i] = max((r.page_hi for r in runs if r.lo <= i < r.hi), default=0)
    runs.sort(key=lambda r: (r.lo, r.page_lo))
    return runs, cuts


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two page tuples (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _intervals(lcp: list[int], n: int) -> list[_Interval]:
    """The nested intervals of items sharing a page prefix (lcp-intervals), children before parents."""
    out: list[_Interval] = []
    stack: list[list[int]] = [[0, 0]]  # [depth, lo]
    for i in range(1, n + 1):
        cur = lcp[i - 1] if i < n else 0
        lo = i - 1
        while cur < stack[-1][0]:
            depth, lo = stack.pop()
            parent = max(cur, stack[-1][0])
            out.append(_Interval(lo, i, parent, depth))
        if cur > stack[-1][0]:
            stack.append([cur, lo])
    return out
