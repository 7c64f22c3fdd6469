"""KV bytes per token of context: every layer stored in full, against hydragen's layout with the window-page
release (``kv/window_pages.py``), measured on the real KVManager and PagePool.

No model runs. One page table is driven as the scheduler drives it (``admit`` / ``allocate`` /
``computed_to`` / ``publish``, page size 16), two ways:

  prefill  a prompt of C - 1 tokens admitted at once, computed in chunks of 512, then one decode step
  decode   a 512-token prompt, then decoded one token a step up to C tokens

After the last step the pool's physical pages (pages of any KV group) are counted: **held** (the table's
group-0 pages plus the window groups' pages its windows still hold) and **idle parts** (released window
pages of published pages, kept for prefix hits and evictable like idle cache). Also the **peak** held during
the run. Bytes are pages x the pool's physical page size (2 x rows x page x Hkv x D x 2 bytes, float16);
per token = bytes / C.

Analytic columns: ``full`` = 2 x layers x Hkv x D x 2 bytes a token; ``ideal windowed`` = global layers
keep C tokens, each local layer min(C, W), no rounding; ``layout`` = what hydragen's layout should hold:
each full group ceil(C/P) pages, each window group the pages from the window's first page at the previous
forward's end (the late slide) to the table's end, every page ``rows`` rows (groups padded to the largest).

Usage:
  PYTHONPATH=src python -m hydragen.bench.windows.kv_bytes [--contexts 4096 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hydragen.kv.layout import model_kv_layout
from hydragen.kv.manager import KVManager, PageTable
from hydragen.kv.pool import PagePool
from hydragen.model.config import ModelConfig
from hydragen.model.presets import PRESETS

PAGE, CHUNK, PROMPT_DECODE = 16, 512, 512
MODELS = ("gemma-3-4b", "gemma-3-1b")


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[name])


def make_manager(cfg, context: int, page: int = PAGE, windowed: bool = True, chunk: int = CHUNK) -> KVManager:
    """A KV manager of the model's layout (every layer one group when not ``windowed``), room for one
    ``context`` plus a chunk, tensors on the meta device (nothing is written)."""
    layout = model_kv_layout(cfg) if windowed else None
    pages = -(-context // page) + chunk // page + 2
    pool = PagePool(
        cfg.num_layers, pages, page, cfg.num_kv_heads, cfg.head_dim, torch.float16, "meta", layout
    )
    return KVManager(pool)


def physical_used(kv: KVManager) -> int:
    a = kv.pool.allocator
    return a.num_pages - a.free


def page_bytes(pool: PagePool) -> int:
    """Bytes of one physical page (one group's page): every row of the pool's tensors, K and V."""
    return pool.bytes_per_token // pool.groups * pool.page_size


def drive(
    kv: KVManager,
    context: int,
    mode: str,
    publish: bool = True,
    chunk: int = CHUNK,
    prompt: int = PROMPT_DECODE,
) -> dict:
    """One table to ``context`` tokens (``mode`` prefill or decode); returns the pool's pages at the end
    and the peak held. ``publish``: sharing on (the table's pages go into the prefix tree)."""
    ps = kv.page_size
    tokens = [(i * 7919) % 50_000 + 1 for i in range(context + 1)]
    t = PageTable()
    peak = 0
    bounds: list[int] = []  # held after each step, against the headline bound (``window_bound``)

    def held() -> int:
        return physical_used(kv) - kv.windows.idle - kv.idle * kv._fixed

    def step(end: int) -> None:
        nonlocal peak
        assert kv.allocate(t, end), "pool too small"
        peak = max(peak, held())
        before = t.computed
        kv.computed_to(t, end)
        if publish and end // ps > t.published:
            kv.publish(t, tokens[:end], end)
        peak = max(peak, held())
        bounds.append(held() - window_bound(kv, end, end - before, len(t.pages)))

    prompt = context - 1 if mode == "prefill" else prompt
    shared = kv.admit(t, tokens[:prompt], None, prompt if publish else None)
    assert shared == 0
    peak = held()
    while t.computed < prompt:
        step(min(prompt, t.computed + chunk))
    after_prompt = held()
    if mode == "prefill":
        step(context)  # one decode step: its token's KV
    else:
        while t.computed < context:
            step(t.computed + 1)
    kv.check([t])
    return {
        "held": held(),
        "idle_parts": kv.windows.idle,
        "peak_held": peak,
        "computed": t.computed,
        "after_prompt": after_prompt,
        "over_bound": max(bounds),
    }


def window_bound(kv: KVManager, end: int, forward: int, pages: int) -> int:
    """Most physical pages a table of ``pages`` pages computed to ``end`` should hold after a forward of
    ``forward`` tokens: every full group's pages, and per window group one window plus the forward it
    keeps late plus a page of rounding, and the pages the table already has past ``end`` (a prompt's,
    taken at admission)."""
    ps, layout = kv.page_size, kv.pool.layout
    ahead = pages - -(-end // ps)
    out = 0
    for g in range(layout.groups):
        w = layout.released.get(g)
        out += pages if w is None else min(pages, ahead + -(-(w + forward) // ps) + 1)
    return out


def layout_pages(cfg, context: int, before: int, page: int = PAGE) -> int:
    """Physical pages hydragen's layout should hold after a forward from ``before`` to ``context``."""
    layout = model_kv_layout(cfg)
    table = -(-context // page)
    out = 0
    for g in range(layout.groups):
        w = layout.released.get(g)
        out += table if w is None else table - min(table, max(0, (before - w + 1) // page))
    return out


def measure(name: str, context: int, mode: str) -> dict:
    cfg = model_config(name)
    layout = model_kv_layout(cfg)
    kv = make_manager(cfg, context)
    got = drive(kv, context, mode)
    end = got["computed"]
    before = end - 1  # the last forward was one decode token in both modes
    pb = page_bytes(kv.pool)
    elt = 2  # float16
    token = 2 * cfg.num_kv_heads * cfg.head_dim * elt  # one layer's K and V of one token
    windows = [s.window for s in cfg.layer_specs]
    n_global = sum(1 for w in windows if w is None)
    ideal = sum(end if w is None else min(end, w) for w in windows) * token
    expect = layout_pages(cfg, end, before)
    return {
        "model": name,
        "context": context,
        "mode": mode,
        "layers (global/local)": f"{n_global}/{cfg.num_layers - n_global}",
        "groups x rows": f"{layout.groups} x {layout.rows}",
        "full B/token": cfg.num_layers * token,
        "ideal windowed B/token": round(ideal / end),
        "layout (analytic) B/token": round(expect * pb / end),
        "measured held B/token": round(got["held"] * pb / end),
        "held pages": got["held"],
        "analytic pages": expect,
        "idle parts (cached, evictable)": got["idle_parts"],
        "held after last chunk B/token": (
            round(got["after_prompt"] * pb / (end - 1)) if mode == "prefill" else ""
        ),
        "peak held B/token": round(got["peak_held"] * pb / end),
        "measured / full": round(got["held"] * pb / end / (cfg.num_layers * token), 3),
    }


COLUMNS = [
    "model", "context", "mode", "layers (global/local)", "groups x rows", "full B/token",
    "ideal windowed B/token", "layout (analytic) B/token", "measured held B/token", "held pages",
    "analytic pages", "idle parts (cached, evictable)", "held after last chunk B/token",
    "peak held B/token", "measured / full",
]  # fmt: skip


def plots(data: dict, out: Path) -> list[Path]:
    from hydragen.bench.core.plots import plot_lines

    paths = []
    for name in MODELS:
        rows = [r for r in data["rows"] if r["model"] == name and r["mode"] == "decode"]
        if not rows:
            continue
        xs = [r["context"] for r in rows]
        series = {
            "every layer in full": (xs, [r["full B/token"] / 1024 for r in rows]),
            "hydragen windowed (measured, held)": (xs, [r["measured held B/token"] / 1024 for r in rows]),
            "ideal windowed (no rounding)": (xs, [r["ideal windowed B/token"] / 1024 for r in rows]),
        }
        paths.append(
            plot_lines(
                series,
                out / f"kv_bytes_{name}.png",
                f"{name}: KV bytes per token of context (float16)",
                "context (tokens)",
                "KiB per token",
                logx=True,
                logy=True,
            )  # fmt: skip
        )
    return paths


def main() -> None:
    from hydragen.bench.core.common import publish

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--plot-contexts", type=int, nargs="*", default=[1024, 2048, 8192, 16384])
    ap.add_argument("--out", type=Path, default=Path("docs/results/windows"))
    args = ap.parse_args()
    rows = []
    for name in MODELS:
        for c in sorted(set(args.contexts) | set(args.plot_contexts)):
            for mode in ("prefill", "decode") if c in args.contexts else ("decode",):
                rows.append(measure(name, c, mode))
                print(rows[-1], flush=True)
    notes = (
        f"Page size {PAGE}, prefill chunks of {CHUNK}, float16 cache. 'held' = physical pages the table "
        "holds after its last step (a decode token); 'idle parts' = released window pages kept beside "
        "published pages for prefix hits (evictable, not counted in held). 'held after last chunk' = "
        "held right after the prompt's last 512-token chunk (the window slides one forward late: a "
        "chunk's worth more). 'peak held' = most held at any point of the run (admission takes every "
        "group's pages for the whole prompt). Per token = bytes / context."
    )
    publish(
        rows, COLUMNS, args.out, "kv_bytes", "KV bytes per token of context: full vs window-page release",
        notes, plots=plots, params=vars(args) | {"out": str(args.out)},
    )  # fmt: skip


if __name__ == "__main__":
    main()
