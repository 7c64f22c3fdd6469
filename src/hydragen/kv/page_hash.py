"""A stable name for every cached page: a hash of its tokens chained with the page before it.

Two processes that cache the same prefix give its pages the same hashes, so a router can match a request's
token ids against what each replica published (``hydragen.dp.kv_events``) without ever seeing the tree.
Python's ``hash`` is salted per process, hence blake2b; 63 bits keep the value a non-negative int64 for
consumers in other languages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_MASK = (1 << 63) - 1


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The hash of one full page whose predecessor hashed to ``parent`` (None for the first page)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((-1 if parent is None else parent).to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The chained hashes of every full page of ``token_ids``."""
    out: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size])
        out.append(parent)
    return out
