"""bench tp: what tensor parallelism costs per decode step, TP = 1 against TP = N, and per all-reduce.

A random-weights Llama (``--model``: a preset, a config.json or a model directory; by default a 16-head,
8-layer, 1024-wide model written to the output folder) decodes ``--max-tokens`` tokens for ``batch``
sequences sampled from one shared prompt, once per tensor-parallel size. Reported per step: decode time
(engine decode seconds / decode steps), the all-reduce calls and their wall time on rank 0 (timed around
each call: it includes waiting for the slowest rank to arrive, which is what a step pays), and the
broadcast of the step's metadata. Every rank runs on its own processes' share of the cores
(``cores // N`` threads each), so on a 2-core CPU, TP = 2 halves the threads per matrix product and adds
2 x layers + 1 all-reduces per step over gloo's loopback TCP: expect it to be slower, not faster.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hydragen.bench.core.common import machine_description, publish, say_quick
from hydragen.bench.core.plots import plot_lines

RESULT_NAME = "tp"
DEFAULT_SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
QUICK_SHAPE = dict(
    DEFAULT_SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=4096
)


class _Timer:
    """Wall time of every call to one method of an object (rank 0's side of a collective)."""

    def __init__(self, owner, name: str):
        self.calls, self.seconds = 0, 0.0
        self._inner = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def measure(
    model_spec, tp: int, batches: list[int], prompt_len: int, max_tokens: int, threads: int | None = None
) -> list[dict]:
    """Rows for one tensor-parallel size; ``threads`` pins TP = 1's torch threads (TP = N sets its own)."""
    from hydragen import LLM, SamplingParams

    kv = (prompt_len + max_tokens + 32) * (max(batches) + 1) * 2
    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model_spec, random_weights=True, tensor_parallel_size=tp, kv_cache_tokens=kv)
    threads = torch.get_num_threads()  # per rank
    try:
        vocab = llm.config.vocab_size
        reduce = broadcast = None
        forwards = _Timer(llm.engine.runner, "forward")
        if tp > 1:
            reduce = _Timer(llm.parallel.group, "all_reduce")
            broadcast = _Timer(llm.parallel.group, "broadcast_from_first")
        rows = []
        for batch in batches:
            prompt = [(7 + 13 * i) % vocab for i in range(prompt_len)]
            params = SamplingParams(n=batch, temperature=0, max_tokens=max_tokens, ignore_eos=True)
            warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            llm.generate([prompt], warm, use_tqdm=False)  # the prompt is cached: the run below only decodes
            st = llm.engine.stats
            before = (st.decode_seconds, st.decode_steps, forwards.calls)
            r0 = (reduce.calls, reduce.seconds) if reduce else (0, 0.0)
            b0 = (broadcast.calls, broadcast.seconds) if broadcast else (0, 0.0)
            llm.generate([prompt], params, use_tqdm=False)
            steps = st.decode_steps - before[1]
            step_s = (st.decode_seconds - before[0]) / max(steps, 1)
            row = {"tp": tp, "threads": threads, "batch": batch, "steps": steps, "step_ms": 1e3 * step_s}
            row["hidden"] = llm.config.hidden_size
            if reduce is not None:
                runs = max(forwards.calls - before[2], 1)  # forwards in the run (each sends one step)
                calls, secs = reduce.calls - r0[0], reduce.seconds - r0[1]
                row |= {
                    "allreduce_calls_per_step": calls / runs,
                    "allreduce_ms_per_call": 1e3 * secs / max(calls, 1),
                    "allreduce_share": secs / runs / step_s if step_s else float("nan"),
                    "broadcast_ms_per_step": 1e3 * (broadcast.seconds - b0[1]) / runs,
                    "broadcasts_per_step": (broadcast.calls - b0[0]) / runs,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        llm.close()


def run(model, tps: list[int], batches: list[int], prompt_len: int, max_tokens: int, out: Path, quick: bool):
    if quick:
        say_quick("bench tp")
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = out / "tp_bench_config.json"
        model.write_text(json.dumps(QUICK_SHAPE if quick else DEFAULT_SHAPE, indent=2))
    from hydragen.tp.launcher import threads_per_rank

    threads_before = torch.get_num_threads()
    rows = []
    for tp in tps:
        # TP = 1 at every core, and also at the threads one rank of the largest TP gets: that row separates
        # what splitting costs (communication) from what it changes in threads per matrix product.
        counts = (
            [threads_before] if tp > 1 else sorted({threads_before, threads_per_rank(max(tps))}, reverse=True)
        )
        for threads in counts:
            rows += measure(model, tp, batches, prompt_len, max_tokens, threads if tp == 1 else None)
            torch.set_num_threads(
                threads_before
            )  # TP = N set cores // N for rank 0; the next run starts over
    from hydragen.bench.tp.allreduce_probe import probe

    for tp in (t for t in tps if t > 1):  # the same all-reduces with nothing else running
        idle = {r["rows"]: r["idle_allreduce_ms"] for r in probe(tp, rows[0]["hidden"], batches)}
        for r in rows:
            if r["tp"] == tp:
                r["idle_allreduce_ms"] = idle[r["batch"]]
    columns = [
        "tp",
        "threads",
        "batch",
        "step_ms",
        "allreduce_calls_per_step",
        "allreduce_ms_per_call",
        "allreduce_share",
        "idle_allreduce_ms",
        "broadcast_ms_per_step",
        "broadcasts_per_step",
    ]
    notes = (
        f"Decode of {max_tokens} tokens for `batch` sequences from one {prompt_len}-token prompt, random "
        f"weights of {Path(str(model)).name}. threads: torch threads per rank. step_ms: decode time per "
        "step. allreduce: rank 0's wall time per call (waiting for the slowest rank included) and its share "
        "of a step. idle_allreduce_ms: the same all-reduce (batch x hidden fp32) between fresh processes "
        "doing nothing else. broadcast: the step's metadata, rank 0 to the others (1 per step when it fits "
        "one buffer). gloo over loopback TCP; the installed torch has no shared-memory CPU all-reduce."
    )
    params = {"tps": tps, "batches": batches, "prompt_len": prompt_len, "max_tokens": max_tokens}
    title = "Tensor parallelism: per-step cost"
    quick_note = (
        "a 32-token prompt and batches of 1-4 on a small random model: a step is a few milliseconds, so the "
        "all-reduces dominate it and TP = 2 is slower than TP = 1 (on a 2-core machine it is at any size)."
    )
    paths = publish(
        rows,
        columns,
        out,
        RESULT_NAME,
        title,
        notes,
        plots=plots,
        quick=quick,
        quick_note=quick_note,
        params=params,
    )
    for path in paths:
        print(path)
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    rows, quick = data["rows"], data.get("quick", False)
    tps = sorted({r["tp"] for r in rows})
    runs = sorted({(r["tp"], r.get("threads", 0)) for r in rows}, key=lambda k: (k[0], -k[1]))

    def name(tp: int, threads: int) -> str:
        return f"TP = {tp}, {threads} thread{'s' if threads != 1 else ''}" + (" per rank" if tp > 1 else "")

    steps = {
        name(tp, th): (
            [r["batch"] for r in rows if (r["tp"], r.get("threads", 0)) == (tp, th)],
            [r["step_ms"] for r in rows if (r["tp"], r.get("threads", 0)) == (tp, th)],
        )
        for tp, th in runs
    }
    paths = [
        plot_lines(
            steps,
            out / "tp_step_time.png",
            "Decode step time, one model split over TP processes",
            "sequences decoded per step",
            "ms per decode step",
            logx=True,
            quick=quick,
            ylim_zero=True,
        )
    ]
    split = [tp for tp in tps if tp > 1]
    if split:
        reduce = {}
        for tp in split:
            mine = [r for r in rows if r["tp"] == tp]
            batch = [r["batch"] for r in mine]
            reduce[f"TP = {tp}, inside decode steps"] = (batch, [r["allreduce_ms_per_call"] for r in mine])
            if all("idle_allreduce_ms" in r for r in mine):
                reduce[f"TP = {tp}, alone (probe)"] = (batch, [r["idle_allreduce_ms"] for r in mine])
        paths.append(
            plot_lines(
                reduce,
                out / "tp_allreduce_time.png",
                "All-reduce wall time per call on rank 0 (gloo, loopback TCP)",
                "sequences decoded per step",
                "ms per all-reduce call",
                logx=True,
                quick=quick,
                ylim_zero=True,
            )
        )
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench tp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="random-weights shape: preset, config.json or model directory"
    )
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="sequences per step (default 1 8 32)")
    p.add_argument("--prompt-len", type=int, default=None, help="shared prompt tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=None, help="decode steps per run (default 32)")
    p.add_argument("--quick", action="store_true", help="toy sizes: checks the run works (seconds)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    a = p.parse_args(argv)
    batches = a.batches or ([1, 4] if a.quick else [1, 8, 32])
    prompt_len = a.prompt_len or (32 if a.quick else 512)
    max_tokens = a.max_tokens or (4 if a.quick else 32)
    if any(t < 1 for t in a.tp) or any(b < 1 for b in batches):
        p.error("--tp and --batches take positive integers")
    print(f"[bench tp] {machine_description()}", flush=True)
    run(a.model, a.tp, batches, prompt_len, max_tokens, a.out, a.quick)


if __name__ == "__main__":
    main()
