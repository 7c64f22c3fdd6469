"""What checking k drafted tokens in one forward costs: t(M) / t(1) for a forward of M new tokens of one
sequence over a cached prompt, M = 1..16, through the engine as it runs (the one-call layer stack, the
packed kernels, the step attention).

Verifying k drafts is a forward of M = k + 1 rows where a decode step is M = 1. On a CPU an M = 1 step
streams every weight once; if M rows cost about as much, a few accepted drafts pay for the whole check,
and if they cost M times as much, nothing does. This is the "before" of speculative decoding's kernel
work: each M is timed as ``generate`` of the cached prompt plus M new tokens with ``max_tokens=1``, which
runs exactly one forward of M rows and samples its last one. A verification also needs the logits of
every row; the LM head's extra M - 1 rows are not in these times.

Random-weight GGUFs of real shapes (``--real-size``; weights do not change the time) and the embedded
model. Each M takes the fastest of ``--reps`` calls, every call with a fresh tail (never cached).

Usage:
  python -m hydragen.bench.spec.verify_rows [--real-size llama-3.2-1b:Q4_K_M,llama-3.1-8b:Q4_K_M]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from hydragen.bench.core.common import publish, say_quick
from hydragen.bench.core.plots import plot_lines

RESULT_NAME = "verify_rows"


def say(message: str) -> None:
    print(f"[verify_rows] {message}", file=sys.stderr, flush=True)


def time_rows(model, rows: list[int], prompt_len: int, reps: int) -> dict[int, float]:
    """Seconds of one forward of M new tokens over a cached ``prompt_len``-token prompt, per M (fastest)."""
    from hydragen import LLM, SamplingParams

    llm = LLM(model, kv_cache_tokens=prompt_len + 64 * (max(rows) + 1) * (reps + 1) + 256)
    vocab = llm.config.vocab_size
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prompt = ids(prompt_len)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)  # cached from here on (whole pages)
    llm.generate([prompt + ids(4)], one, use_tqdm=False)  # warm-up
    best: dict[int, float] = {}
    for _ in range(reps):  # rounds over every M: a slow phase of the machine hits each M alike
        for m in rows:
            tail = ids(m)
            t0 = time.perf_counter()
            out = llm.generate([prompt + tail], one, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            if out[0].cached_prompt_tokens < prompt_len:  # else this timed a prefill, not M rows
                raise RuntimeError(
                    f"the prompt was not cached ({out[0].cached_prompt_tokens} of {prompt_len})"
                )
            best[m] = min(best.get(m, float("inf")), elapsed)
    llm.close()
    return best


# The two bounds drawn beside the models: grey, dashed, no markers.
BOUNDS = ("M x t(1) (each row a full weight stream)", "t(1) (rows free)")


def plots(data: dict, out: Path) -> list[Path]:
    from hydragen.bench.core.plots import STYLES

    for name in BOUNDS:
        STYLES.setdefault(name, dict(color="0.55", linestyle="--", marker=""))
    series: dict[str, tuple[list, list]] = {}
    for r in data["rows"]:
        xs, ys = series.setdefault(r["model"], ([], []))
        xs.append(r["M"])
        ys.append(r["t(M) / t(1)"])
    ms = sorted({r["M"] for r in data["rows"]})
    series[BOUNDS[0]] = (ms, ms)
    series[BOUNDS[1]] = (ms, [1.0] * len(ms))
    return [
        plot_lines(
            series,
            out / "verify_rows.png",
            "One forward of M new tokens over a cached prompt, against M = 1",
            "M, rows of one sequence in the forward (k drafts: M = k + 1)",
            "t(M) / t(1)",
            quick=data.get("quick", False),
        )
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m hydragen.bench.spec.verify_rows", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--real-size", default="llama-3.2-1b:Q4_K_M,llama-3.1-8b:Q4_K_M", metavar="PRESET:SCHEME,..."
    )
    p.add_argument(
        "--embedded", action=argparse.BooleanOptionalAction, default=True, help="the embedded model too"
    )
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512, help="cached prompt tokens (default 512)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the embedded model, M = 1..3, one rep")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    rows_of = list(range(1, (3 if a.quick else a.max_rows) + 1))
    models: list[tuple[str, object]] = (
        [("SmolLM2-135M Q4_1 (embedded)", None)] if a.embedded or a.quick else []
    )
    if not a.quick:
        from hydragen.model.gguf_write import random_gguf_file

        for spec in (x.strip() for x in a.real_size.split(",") if x.strip()):
            models.append((spec, random_gguf_file(spec)))
    if a.quick:
        say_quick("verify_rows")
    rows = []
    for name, model in models:
        say(f"{name}: M = {rows_of[0]}..{rows_of[-1]}, {1 if a.quick else a.reps} reps")
        times = time_rows(model, rows_of, 64 if a.quick else a.prompt, 1 if a.quick else a.reps)
        for m in rows_of:
            rows.append(
                {"model": name, "M": m, "t(M) ms": 1e3 * times[m], "t(M) / t(1)": times[m] / times[1]}
            )
            say(f"{name}: M = {m:2d}: {1e3 * times[m]:8.1f} ms, {times[m] / times[1]:.2f} x t(1)")
    notes = (
        f"One sequence, a cached {64 if a.quick else a.prompt}-token prompt, M new tokens in one forward "
        "(generate with max_tokens=1); the fastest of the reps, rounds over every M. Logits of the last row "
        "only: a verification's M - 1 further LM-head rows are not included."
    )
    publish(rows, ["model", "M", "t(M) ms", "t(M) / t(1)"], a.out, RESULT_NAME,
            "Verifying drafts: one forward of M rows against M = 1", notes, plots=plots, quick=a.quick,
            params={"prompt": a.prompt, "reps": a.reps, "models": [n for n, _ in models]})  # fmt: skip


if __name__ == "__main__":
    main()
