"""This checkout against another hydragen source tree, side by side in one run.

Each tree runs the same measurements in its own process (``PYTHONPATH=<tree>/src``), alternating old and
new for ``--rounds`` rounds; each number is the best of its rounds, so a noisy neighbour hurts both trees
alike. The measuring code below the ``worker`` line is executed as a script inside the other tree's
process, so it uses only the public API both trees have (``LLM``, ``SamplingParams``): an engine redesign
cannot break the comparison.

Measured:
* e2e: one P-token prompt, n samples of T tokens, default sampling (temperature 1) and temperature 0.8 /
  top_p 0.95; wall time of one ``generate``, prefix cache reset before it.
* prefill: 64 requests, each a cached S-token system prompt plus a distinct 16-token question, against one
  uncached S-token prompt (``max_tokens=1``: the time to first token).
* tree step: the tree benchmark's batch (a 1,024-token few-shot block, 4 problems of 512 tokens, 16 samples
  each), prompts cached: mean decode step time, aten ops per step and the dispatch share (the step's time
  outside GEMMs and attention kernels, from ``torch.profiler``), each as the difference between a call of
  1 + s tokens and a call of 1 token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT_NAME = "versus"  # versus.json, versus.md
SAMPLINGS = {"default": {}, "top_p": {"temperature": 0.8, "top_p": 0.95}}
# aten/custom ops doing the arithmetic; the rest of a step's time is dispatch and bookkeeping.
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def _worker(args: dict) -> dict:
    """Runs inside the measured tree's process: only the public API of both trees."""
    import random

    import torch

    from hydragen import LLM, SamplingParams

    torch.set_num_threads(args["threads"])
    llm = LLM(kv_cache_tokens=args["kv_tokens"])
    vocab = llm.config.vocab_size
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def timed(prompts, params) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    out: dict = {}
    prompt = ids(args["prompt_len"])
    timed([prompt[:64]], SamplingParams(max_tokens=2))  # warm-up: lazy init, compiled ops
    for name, sampling in SAMPLINGS.items():
        for n in args["ns"]:
            llm.reset_prefix_cache()
            p = SamplingParams(n=n, max_tokens=args["new_tokens"], ignore_eos=True, seed=0, **sampling)
            out[f"e2e/{name}/{n}"] = timed([prompt], p)

    system, one = ids(args["system_len"]), ids(args["system_len"])
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    llm.reset_prefix_cache()
    out["prefill/uncached_one"] = timed([one], first)
    timed([system], first)  # caches the system prompt
    out["prefill/cached_64"] = timed([system + ids(16) for _ in range(64)], first)

    # The tree step through generate alone: with every prompt cached, a call of 1 + s tokens differs from a
    # call of 1 token by s decode steps of the whole tree (same seeds, same path), so their difference is the
    # steps' time, their ops and their compute (the public API is all both trees must have).
    llm.reset_prefix_cache()
    shots = ids(1024)
    problems = [shots + ids(512) for _ in range(4)]

    def tree(steps: int) -> SamplingParams:
        return SamplingParams(n=16, max_tokens=1 + steps, ignore_eos=True, seed=0)

    timed(problems, tree(0))  # caches every prompt
    steps = args["tree_steps"]
    out["tree/step_s"] = (timed(problems, tree(steps)) - timed(problems, tree(0))) / steps
    prof_steps = 3
    profiles = [_profiled(lambda n=n: timed(problems, tree(n))) for n in (0, prof_steps)]
    (ops0, compute0, wall0), (ops1, compute1, wall1) = profiles
    out["tree/ops_per_step"] = (ops1 - ops0) / prof_steps
    out["tree/dispatch_share"] = max(0.0, 1.0 - (compute1 - compute0) / max(wall1 - wall0, 1e-9))
    return out


def _profiled(run) -> tuple[int, float, float]:
    """Top-level aten/hydragen ops of ``run()``, the seconds they spent computing, and its wall seconds."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = run()
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "hydragen::"))]
    compute_us = sum(e.self_cpu_time_total for e in events if _is_compute(e.key))
    top_level = [
        e for e in prof.events() if e.cpu_parent is None and e.name.startswith(("aten::", "hydragen::"))
    ]
    return len(top_level), compute_us / 1e6, wall


def _is_compute(op: str) -> bool:
    return op in GEMM_OPS or op.startswith("hydragen::") or "scaled_dot_product" in op or "flash" in op


def run_tree(tree: Path, args: dict, keep: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if keep is not None:  # each worker's result also lands there, so a stopped run keeps what it measured
        env["HYDRAGEN_VERSUS_KEEP"] = str(keep)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(old: Path, new: Path, args: dict, rounds: int, keep: Path | None = None) -> dict:
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(rounds):
        for label, tree in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            results[label].append(run_tree(tree, args, keep))
            print(
                f"round {r + 1}/{rounds} {label}: {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return {"rounds": results, "best": best_of(results)}


def best_of(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per tree, the best (smallest) value of every measurement over its rounds."""
    return {label: {k: min(run[k] for run in runs) for k in runs[0]} for label, runs in rounds.items()}


def tree_commit(tree: Path) -> str:
    """The other tree's git commit (short), or "unknown" when it is not a checkout."""
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return head.stdout.strip() if head.returncode == 0 else "unknown"


def tables(data: dict, args: dict) -> str:
    old, new = data["best"]["old"], data["best"]["new"]
    lines = ["| sampling | n | old e2e s | new e2e s | old / new |", "|---|---|---|---|---|"]
    for name in SAMPLINGS:
        for n in args["ns"]:
            k = f"e2e/{name}/{n}"
            lines.append(f"| {name} | {n} | {old[k]:.2f} | {new[k]:.2f} | {old[k] / new[k]:.2f}x |")
    lines += ["", "| top_p / default, new | n | ratio |", "|---|---|---|"]
    for n in args["ns"]:
        lines.append(f"| | {n} | {new[f'e2e/top_p/{n}'] / new[f'e2e/default/{n}']:.3f} |")
    lines += ["", "| measure | old | new |", "|---|---|---|"]
    for k, fmt in (
        ("prefill/uncached_one", "{:.2f} s"),
        ("prefill/cached_64", "{:.2f} s"),
        ("tree/step_s", "{:.3f} s"),
        ("tree/ops_per_step", "{:.0f}"),
        ("tree/dispatch_share", "{:.0%}"),
    ):
        lines.append(f"| {k} | {fmt.format(old[k])} | {fmt.format(new[k])} |")
    for label, d in (("old", old), ("new", new)):
        ratio = d["prefill/cached_64"] / d["prefill/uncached_one"]
        lines.append(f"| prefill cached_64 / uncached_one, {label} | {ratio:.2f} | |")
    return "\n".join(lines)


def plot(data: dict, args: dict, out: Path) -> Path:
    from hydragen.bench.core.plots import pyplot

    plt = pyplot()

    old, new = data["best"]["old"], data["best"]["new"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, name in zip(axes, SAMPLINGS, strict=True):
        xs = range(len(args["ns"]))
        w = 0.38
        old_label, new_label = f"old ({data.get('against_commit', '?')})", f"new ({data.get('commit', '?')})"
        ax.bar([x - w / 2 for x in xs], [old[f"e2e/{name}/{n}"] for n in args["ns"]], w, label=old_label)
        ax.bar([x + w / 2 for x in xs], [new[f"e2e/{name}/{n}"] for n in args["ns"]], w, label=new_label)
        ax.set_xticks(list(xs), [str(n) for n in args["ns"]])
        ax.set_xlabel("n (samples of one prompt)")
        title = "temperature 1" if name == "default" else "temperature 0.8, top_p 0.95"
        ax.set_title(f"P={args['prompt_len']}, T={args['new_tokens']}, {title}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("end-to-end seconds (lower is better)")
    axes[0].legend()
    fig.tight_layout()
    path = out / "versus_e2e.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(data: dict, out: Path) -> list[Path]:
    return [plot(data, data["params"], out)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hydragen bench versus", description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, required=True, help="the other source tree (a git worktree)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--tree-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    args = {
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "ns": a.n,
        "system_len": a.system_len,
        "tree_steps": a.tree_steps,
        "threads": a.threads,
        # what any part needs at its worst-case admission (every sequence holding a private copy)
        "kv_tokens": max(
            max(a.n) * (a.prompt_len + a.new_tokens),
            64 * (a.system_len + 32),
            64 * (1024 + 512 + a.tree_steps + 8),
        ),
    }
    new_tree = Path(__file__).resolve().parents[4]  # src/hydragen/bench/e2e/versus.py
    data = compare(a.against.resolve(), new_tree, args, a.rounds, a.out / "workers")
    data["params"] = args | {"against": str(a.against.resolve()), "rounds": a.rounds}
    from hydragen.bench.core.common import (
        code_commit,
        machine_description,
    )  # not at the top: workers import the other tree

    data["machine"], data["commit"] = machine_description(), code_commit()
    data["against_commit"] = tree_commit(a.against.resolve())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "versus.json").write_text(json.dumps(data, indent=2))
    md = tables(data, args)
    (a.out / "versus.md").write_text(md + "\n")
    print(md)
    print(f"plot: {plot(data, args, a.out)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.pop(0)  # this file's folder: its modules must not shadow the measured tree's
        result = json.dumps(_worker(json.loads(sys.argv[2])))
        keep = os.environ.get("HYDRAGEN_VERSUS_KEEP")  # a folder: each worker's result also lands there
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            tag = os.environ.get("PYTHONPATH", "tree").strip("/").replace("/", "_")
            (Path(keep) / f"{tag}-{os.getpid()}.json").write_text(result)
        print(result)
    else:
        main()
