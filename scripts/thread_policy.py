"""Measure hydragen's CLI under each thread count and OpenMP wait policy, on a quiet and a loaded machine.

    python scripts/thread_policy.py --out docs/results/threads [--load 3] [--reps 2]
    python scripts/thread_policy.py --out docs/results/threads --replot     # the plot again, from the JSON

Runs, as subprocesses on the embedded model: ``generate`` with one greedy completion, ``generate -n 8`` (the
``make run`` command) and a piped two-turn ``chat``; for every thread count in --threads and every wait
policy in --policies (``default`` leaves OMP_WAIT_POLICY unset: libgomp spins before it sleeps; ``passive``
sleeps at once); with no other load and with --load busy-loop processes beside them. Writes
``threads.md`` (the table), ``threads.json`` (every run, with the machine and commit) and ``threads.png``
(each setting's speed relative to one thread, quiet and loaded).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a haiku about sharing."
LONG_PROMPT = (
    "Summarise this text. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 80
)
CHAT_INPUT = "My name is Ada.\nWhat is my name?\n"
TIMEOUT = 300.0


def _spin() -> None:
    while True:
        pass


def _run(cmd: list[str], env: dict, stdin: str | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "timeout": True}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    out = {"wall_s": wall}
    if m := re.search(r"loaded in ([\d.]+) s", p.stderr):
        out["load_s"] = float(m.group(1))
    if m := re.search(r"first token after ([\d.]+) s, then ([\d.]+) tokens/s", p.stderr):
        out["ttft_s"], out["tok_s"] = float(m.group(1)), float(m.group(2))
    if "load_s" in out:
        out["work_s"] = wall - out["load_s"]
    return out


def commands(threads: int | str) -> dict[str, tuple[list[str], str | None]]:
    base = [sys.executable, "-m", "hydragen"]
    t = [] if threads == "auto" else ["--threads", str(threads)]  # auto: hydragen's default
    return {
        "generate n=1": (
            base + ["generate", PROMPT, "--max-tokens", "48", "--temperature", "0", "--ignore-eos", *t],
            None,
        ),
        "generate n=8": (
            base + ["generate", PROMPT, "-n", "8", "--max-tokens", "48", "--seed", "1", "--ignore-eos", *t],
            None,
        ),
        "generate n=16, 1.1K-token prompt": (
            base
            + ["generate", LONG_PROMPT, "-n", "16", "--max-tokens", "32", "--seed", "1", "--ignore-eos", *t],
            None,
        ),
        "chat, 2 turns": (base + ["chat", "--max-tokens", "48", "--temperature", "0", *t], CHAT_INPUT),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--load", type=int, default=3, help="busy-loop processes for the loaded runs")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--threads", nargs="+", default=[1, os.cpu_count() or 1], help="thread counts, or auto (the default)"
    )
    ap.add_argument("--policies", nargs="+", default=["default", "passive"])
    ap.add_argument("--replot", action="store_true", help="redraw threads.png from threads.json")
    args = ap.parse_args()
    args.threads = [t if t == "auto" else int(t) for t in args.threads]
    if args.replot:
        data = json.loads((args.out / "threads.json").read_text())
        print(plot(data["rows"], data["machine"], args.out))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    configs = [(load, th, pol) for load in (0, args.load) for th in args.threads for pol in args.policies]
    for k, (load, threads, policy) in enumerate(configs, 1):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "default":
            env["OMP_WAIT_POLICY"] = policy.upper()
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(load)]
        for s in spinners:
            s.start()
        try:
            time.sleep(1.0 if load else 0.0)
            for name, (cmd, stdin) in commands(threads).items():
                runs = [_run(cmd, env, stdin) for _ in range(args.reps)]
                rows.append(
                    {"load": load, "threads": threads, "policy": policy, "command": name, "runs": runs}
                )
                done = [r for r in runs if r.get("work_s") is not None]
                rate = statistics.median(r["tok_s"] for r in done) if done and "tok_s" in done[0] else None
                work = statistics.median(r["work_s"] for r in done) if done else None
                print(
                    f"[{k}/{len(configs)}] load {load}, threads {threads}, wait {policy:8s} {name:32s} "
                    + (f"{rate:7.1f} tok/s  " if rate else " " * 16)
                    + (f"{work:6.1f} s" if work is not None else "timeout"),
                    flush=True,
                )
        finally:
            for s in spinners:
                s.terminate()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit,
        "loadavg_at_end": os.getloadavg(),
    }
    (args.out / "threads.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (args.out / "threads.md").write_text(_table(rows, machine, args.load))
    print((args.out / "threads.md").read_text())
    print(plot(rows, machine, args.out))


def _speed(row: dict) -> float | None:
    """1 / the command's wall time without the model load (None: timed out): what a user waits for."""
    done = [r for r in row["runs"] if r.get("work_s") is not None]
    return 1.0 / statistics.median(r["work_s"] for r in done) if done else None


def plot(rows: list[dict], machine: dict, out: Path) -> Path:
    """Two panels (quiet, loaded): each setting's speed relative to one thread, per command."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    commands = list(dict.fromkeys(r["command"] for r in rows))
    settings = [k for k in dict.fromkeys((r["threads"], r["policy"]) for r in rows) if k != (1, "default")]
    fig, axes = plt.subplots(1, len(loads), figsize=(6.5 * len(loads), 4.2), sharey=True)
    for ax, load in zip(axes if len(loads) > 1 else [axes], loads, strict=True):
        by = {(r["command"], r["threads"], r["policy"]): _speed(r) for r in rows if r["load"] == load}
        width = 0.8 / len(settings)
        for j, (threads, policy) in enumerate(settings):
            ratios = [
                (by[(c, threads, policy)] or 0.0) / by[(c, 1, "default")] if by[(c, 1, "default")] else 0.0
                for c in commands
            ]
            xs = [i + (j - (len(settings) - 1) / 2) * width for i in range(len(commands))]
            label = f"{threads} thread{'s' * (threads > 1)}" + (
                ", OMP passive" if policy == "passive" else ""
            )
            bars = ax.bar(xs, ratios, width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(commands)), [c.replace(", ", ",\n") for c in commands], fontsize=8)
        ax.set_title("quiet machine" if load == 0 else f"loaded: {load} busy-loop processes beside it")
        ax.set_ylabel("speed relative to 1 thread\n(1 / time without the load; higher is better)")
        ax.set_ylim(0, 1.45)
        ax.legend(fontsize=8, loc="upper center", ncols=len(settings))
    fig.suptitle(
        f"hydragen CLI: thread count and OpenMP wait policy ({machine['cpu']}, {machine['cores']} cores)"
    )
    fig.tight_layout()
    path = out / "threads.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cell(row: dict) -> str:
    done = [r for r in row["runs"] if r.get("work_s") is not None]
    if not done:
        return f"> {TIMEOUT:.0f} s"
    work = statistics.median(r["work_s"] for r in done)
    if "tok_s" in done[0] and row["command"] != "chat, 2 turns":
        rate = statistics.median(r["tok_s"] for r in done)
        ttft = statistics.median(r["ttft_s"] for r in done)
        return f"{rate:.1f} tok/s, TTFT {ttft:.2f} s"
    return f"{work:.1f} s"


def _table(rows: list[dict], machine: dict, load: int) -> str:
    heads = list(dict.fromkeys((r["threads"], r["policy"]) for r in rows))
    out = [
        f"# Thread count and OpenMP wait policy ({machine['cpu']}, {machine['cores']} cores, "
        f"commit {machine['commit'][:10]})",
        "",
        f"Loaded: {load} busy-loop processes beside hydragen. Cells: decode rate after the first token and "
        "time to first token (medians), or the wall time without the model load for the chat.",
        "",
        "| machine | command | "
        + " | ".join(("automatic" if t == "auto" else f"{t} thread(s)") + f", wait {p}" for t, p in heads)
        + " |",
        "|---|---|" + "---|" * len(heads),
    ]
    for load_value in sorted({r["load"] for r in rows}):
        for command in dict.fromkeys(r["command"] for r in rows):
            cells = []
            for t, p in heads:
                row = next(
                    r
                    for r in rows
                    if (r["load"], r["command"], r["threads"], r["policy"]) == (load_value, command, t, p)
                )
                cells.append(_cell(row))
            label = "quiet" if load_value == 0 else f"loaded (+{load_value})"
            out.append(f"| {label} | {command} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
