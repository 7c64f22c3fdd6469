"""The headline property of the window-page release (issue 41), at small scale on a Gemma-like layout
(``window_groups``: one full group, windowed groups padded to equal rows): however long the context, a page
table holds only its full groups' pages plus, per windowed group, one window, the forward it keeps late and
a page of rounding; driven as the scheduler drives it (``hydragen.bench.windows.kv_bytes.drive``), sharing
on and off, in prefill chunks and decode steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hydragen.attention.layer_spec import AttentionSpec
from hydragen.bench.windows.kv_bytes import drive, layout_pages, make_manager, page_bytes, physical_used
from hydragen.kv.layout import window_groups

PS, W, CHUNK = 4, 16, 8


def gemma_like(layers: int = 9, every: int = 3) -> SimpleNamespace:
    """Every ``every``-th layer full, the rest windowed: 3 full, 6 windowed -> groups of 3 rows."""
    kinds = [(i + 1) % every != 0 for i in range(layers)]
    return SimpleNamespace(
        num_layers=layers, num_kv_heads=1, head_dim=2, kv_groups=window_groups(kinds),
        layer_specs=tuple(AttentionSpec(scale=1.0, window=W if k else None) for k in kinds),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("publish", [True, False])
def test_a_long_context_holds_its_full_groups_and_one_window_per_windowed_group(mode, publish):
    cfg = gemma_like()
    context = 200  # 50 pages, a window of 4
    kv = make_manager(cfg, context, page=PS, chunk=CHUNK)
    layout = kv.pool.layout
    assert layout.groups == 3 and set(layout.released) == {1, 2}
    got = drive(kv, context, mode, publish=publish, chunk=CHUNK, prompt=2 * CHUNK)
    assert got["computed"] == context
    assert got["over_bound"] <= 0  # after every step: full groups + (window + late forward + rounding) each
    table = context // PS
    # after the last decode token: the full group's 50 pages, and per windowed group the pages from the
    # window's first at the previous end (199 - 16 + 1 = 184: page 46) to the end: 4 of them
    assert got["held"] == layout_pages(cfg, context, context - 1, PS) == table + 2 * 4
    # bytes: 58 pages of 3 rows against 9 layers' of every one of 200 tokens
    full = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * context
    assert got["held"] * page_bytes(kv.pool) < full / 2
    # what the windows released is kept for hits when published (idle, evictable), else free
    assert got["idle_parts"] == (2 * (table - 4) if publish else 0)
    assert physical_used(kv) == got["held"] + got["idle_parts"]
    if mode == "decode":  # one token a step: never more than the bound, whatever the moment
        assert got["peak_held"] <= table + 2 * (-(-(W + 1) // PS) + 1)
