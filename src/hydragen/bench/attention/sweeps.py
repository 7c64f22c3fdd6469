"""What ``bench attention`` sweeps: the attention shapes (query heads, KV heads, head dim) and the
(batch, prefix, suffix) points of each sweep, with the shapes' names in words for tables and plots."""

from __future__ import annotations

# name -> (Hq, Hkv, D)
SHAPES: dict[str, tuple[int, int, int]] = {"paper": (8, 1, 128), "gqa": (9, 3, 64)}
SHAPE_WORDS = {"paper": "the paper's shape", "gqa": "SmolLM2's GQA shape"}

# Sweeps: (batch, prefix, suffix) grid plus a suffix sweep at one (batch, prefix).
SWEEPS: dict[str, dict] = {
    "quick": dict(batch=[1, 4], prefix=[16, 64], suffix=[8], suffix_sweep=[4, 16], suffix_at=(4, 64)),
    "cpu": dict(
        batch=[1, 8, 32, 128, 256],
        prefix=[64, 1024, 4096, 16384],
        suffix=[128],
        suffix_sweep=[32, 512],
        suffix_at=(128, 1024),
    ),
    "cuda": dict(
        batch=[1, 8, 64, 256, 1024],
        prefix=[0, 64, 256, 1024, 4096, 16384],
        suffix=[128],
        suffix_sweep=[32, 512],
        suffix_at=(256, 4096),
    ),
    "full": dict(
        batch=[2**i for i in range(11)],
        prefix=[1024, 2048, 4096, 8192, 16384],
        suffix=[32, 128, 512],
        suffix_sweep=[],
        suffix_at=None,
    ),
}


def sweep_points(
    batch: list[int],
    prefix: list[int],
    suffix: list[int],
    suffix_sweep: list[int] = (),
    suffix_at: tuple[int, int] | None = None,
) -> list[tuple[int, int, int]]:
    """(B, P, S) points: the batch x prefix x suffix grid, then the extra suffix values at one (B, P)."""
    points = [(b, p, s) for s in suffix for p in prefix for b in batch]
    if suffix_at is not None:
        points += [(suffix_at[0], suffix_at[1], s) for s in suffix_sweep]
    seen: set[tuple[int, int, int]] = set()
    return [x for x in points if not (x in seen or seen.add(x))]


def shape_words(shape: str) -> str:
    hq, hkv, d = SHAPES.get(shape, (0, 0, 0))
    return (
        f"{SHAPE_WORDS.get(shape, shape)}: {hq} query heads, {hkv} KV head{'s' if hkv > 1 else ''}, dim {d}"
    )
