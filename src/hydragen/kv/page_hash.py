"""A stable name for every cached page: a hash of its tokens chained with the page before it.

Two processes that cache the same prefix give its pages the same hashes, so a router can match a request's
token ids against what each replica published (``hydragen.dp.kv_events``) without ever seeing the tree.
Python's ``hash`` is salted per process, hence blake2b; 63 bits keep the value a non-negative int64 for
consumers in other languages.

A request's cache salt (a tenant's secret, say) seeds the chain: its first page hashes with the salt's hash
as its parent, so salted prefixes get hashes, and tree nodes, of their own and never meet another salt's.
Without a salt the chain starts from ``None`` as it always did, so routers and events keep their hashes.
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


def chain_root(salt: str | None) -> int | None:
    """What the first page of a context hashes with as its parent: None unsalted, else the salt's hash."""
    if salt is None:
        return None
    h = hashlib.blake2b(salt.encode(), digest_size=8, person=b"hydragen-salt")
    return int.from_bytes(h.digest(), "little") & _MASK


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    *,
    salt: str | None = None,
    parent: int | None = None,
    start: int = 0,
) -> list[int]:
    """The chained hashes of every full page of ``token_ids`` from page ``start`` on (``parent``: the hash of
    page ``start - 1``; for ``start == 0`` the chain starts at the ``salt``'s root)."""
    out: list[int] = []
    if start == 0:
        parent = chain_root(salt)
    for lo in range(start * page_size, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[lo : lo + page_size])
        out.append(parent)
    return out
