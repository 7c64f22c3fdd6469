"""Hierarchical sharing, as the Hydragen paper's competitive-programming experiment (its Figure 7): a
few-shot block of F tokens shared by every sequence, problems of L tokens each shared by that problem's k
samples, T new tokens per sample; a batch is K problems at once (K x k sequences).

* tree: full tree sharing (what hydragen does on its own): the few-shot block and each problem are stored
  once and read once per step by the sequences under them.
* onelevel: only the few-shot block is shared (the scheduler's ``Sharing(limit=F)``); each sample holds its
  own copy of its problem's KV, as an engine that shares only a common system prompt would.
* nosharing: every sample holds its whole prompt (reference).

Compared at equal batch (each K of the sweep) and at the larger batch the memory saved by the tree allows:
the most problems whose KV fits in what one-level sharing needs at the largest K of the sweep. Reported:
decode throughput = generated tokens / decode time (prefill excluded), wall time per problem (the paper's
measure: time to work through a dataset of problems) and peak KV memory.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

from hydragen.bench.core.common import machine_description, publish, say_quick, touch_kv_pool
from hydragen.bench.core.plots import Missing, label, plot_lines

RESULT_NAME = "tree"  # tree.json, tree.md
MODES = ("tree", "onelevel", "nosharing")


def tree_prompts(vocab: int, fewshot: int, problems: int, problem_len: int, seed: int = 0) -> list[list[int]]:
    """K prompts = the same few-shot block + a distinct problem; problems differ in their first token."""
    rng = random.Random(seed)
    shots = [rng.randrange(100, vocab) for _ in range(fewshot)]
    prompts = []
    for p in range(problems):
        body = [rng.randrange(100, vocab) for _ in range(problem_len)]
        body[0] = 100 + p  # distinct first token: the tree branches exactly at the few-shot boundary
        prompts.append(shots + body)
    return prompts


def kv_tokens_needed(
    mode: str, fewshot: int, problems: int, problem_len: int, k: int, new_tokens: int
) -> int:
    """KV tokens each mode stores when every sample has finished (prompt KV + generated KV)."""
    samples = problems * k
    if mode == "tree":
        return fewshot + problems * problem_len + samples * new_tokens
    if mode == "onelevel":
        return fewshot + problems * problem_len + samples * (problem_len + new_tokens)
    return problems * (fewshot + problem_len) + samples * (fewshot + problem_len + new_tokens)


def time_mode(llm, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    from hydragen import SamplingParams
    from hydragen.engine.stats import EngineStats

    llm.reset_prefix_cache()
    llm.engine.stats = EngineStats()
    params = SamplingParams(n=k, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    st = llm.engine.stats
    assert all(len(c.token_ids) == new_tokens for o in outs for c in o.outputs)
    return dict(
        wall_s=wall,
        # Steps that only decoded: their tokens over their time (steps that also prefilled are left out).
        decode_tok_s=st.decode_step_tokens / max(st.decode_seconds, 1e-9),
        step_ms=1e3 * st.decode_seconds / max(st.decode_steps, 1),
        peak_kv_mib=st.peak_kv_tokens * llm.engine.pool.bytes_per_token / 2**20,
        preemptions=st.preemptions,
        tokens=[c.token_ids for o in outs for c in o.outputs],
    )


def run(
    model=None,
    fewshot: int = 1024,
    problem_len: int = 512,
    samples: int = 16,
    problem_counts: list[int] = (1, 4),
    new_tokens: int = 32,
    modes: list[str] = MODES,
    out: Path = Path("bench-out"),
    max_batch: int = 1024,
    random_weights: bool = False,
    quick: bool = False,
    page_size: int = 16,
) -> list[dict]:
    """Sweep problems per batch for every mode, then tree sharing at the batch one-level's memory holds."""
    from hydragen import LLM

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    counts, k, F, L, T = sorted(problem_counts), samples, fewshot, problem_len, new_tokens
    if quick:
        say_quick("tree")
    budget = kv_tokens_needed("onelevel", F, counts[-1], L, k, T)
    k_mem = min((budget - F) // (L + k * T), max_batch // k)
    print(
        f"[tree] {machine_description()}; F={F} L={L} k={k} T={T}; one-level with {counts[-1]} problems "
        f"needs {budget} KV tokens, which hold tree sharing with {k_mem} problems",
        file=sys.stderr,
    )
    rows: list[dict] = []
    reference: dict[int, list] = {}
    for mode in modes:
        runs = [(c, "sweep") for c in counts]
        if mode == "tree" and k_mem > counts[-1]:
            runs.append((k_mem, "memory-matched"))
        most = max(c for c, _ in runs)
        kv = kv_tokens_needed(mode, F, most, L, k, T)  # this mode's own need at its largest run
        llm = LLM(
            model,
            prefix_sharing=mode != "nosharing",
            # Twice the need: a tight pool would make late joiners wait (more, smaller steps).
            kv_cache_tokens=2 * kv + most * k * 8 + 1024,
            max_num_seqs=most * k,
            random_weights=random_weights,
            page_size=page_size,
        )
        touch_kv_pool(llm)
        if mode == "onelevel":
            from hydragen.engine.scheduler import Sharing

            llm.engine.scheduler.sharing = Sharing(enabled=True, limit=F)
        prompts = tree_prompts(llm.config.vocab_size, F, most, L)
        time_mode(llm, prompts[: counts[0]], k, 2)  # warm-up at full prompt size
        for c, kind in runs:
            r = time_mode(llm, prompts[:c], k, T)
            tokens = r.pop("tokens")
            if c in reference:
                # Exact attention: the modes differ only by fp32 rounding (~1e-6 in the logits), which can
                # still flip a temperature-1 draw that lands on a CDF boundary between two tokens.
                same = sum(x == y for x, y in zip(tokens, reference[c], strict=True))
                r["same_seqs"] = same / len(tokens)
            else:
                reference[c] = tokens
            row = dict(mode=mode, point=kind, problems=c, batch=c * k, **r)
            row["s_per_problem"] = r["wall_s"] / c
            row["kv_tokens_model"] = kv_tokens_needed(mode, F, c, L, k, T)
            rows.append(row)
            print(
                f"[tree] {mode:9s} problems={c:3d} batch={c * k:5d}: decode {r['decode_tok_s']:8.1f} tok/s, "
                f"wall {r['wall_s']:6.2f} s, peak KV {r['peak_kv_mib']:7.1f} MiB",
                file=sys.stderr,
            )
        del llm
        gc.collect()
    base = [x for x in rows if x["mode"] == "onelevel" and x["problems"] == counts[-1]]
    for r in rows:
        if base and r["mode"] == "tree":
            r["vs_onelevel_max"] = r["decode_tok_s"] / base[0]["decode_tok_s"]
            r["time_saved"] = 1 - r["s_per_problem"] / base[0]["s_per_problem"]
    cols = ["mode", "point", "problems", "batch", "decode_tok_s", "vs_onelevel_max", "s_per_problem"]
    cols += [
        "time_saved",
        "step_ms",
        "wall_s",
        "peak_kv_mib",
        "kv_tokens_model",
        "same_seqs",
        "preemptions",
    ]
    params = dict(
        fewshot=F,
        problem_len=L,
        samples=k,
        new_tokens=T,
        problem_counts=counts,
        memory_matched=k_mem,
        page_size=page_size,
    )
    publish(
        rows,
        cols,
        out,
        RESULT_NAME,
        f"Hierarchical sharing (F={F} few-shot, problems of L={L}, k={k} samples, T={T})",
        f"model {model or 'embedded SmolLM2-135M'}; one-level with {counts[-1]} problems needs {budget} KV "
        f"tokens; tree sharing fits {k_mem} problems in that memory. vs_onelevel_max and time_saved compare "
        f"with one-level at {counts[-1]} problems; same_seqs: fraction of samples whose tokens equal "
        "tree sharing's.",
        quick=quick,
        quick_note=(
            "a 48-token few-shot block and 24-token problems are too short for a shared read to pay back its "
            "fixed cost, so negative time_saved and ratios below 1 are expected at this size; same_seqs "
            "compares temperature-1 samples of two or four sequences. The full run uses F=1024, L=512."
        ),
        plots=plots,
        params=params,
    )
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    """Decode throughput vs batch for the three modes; the memory-matched tree point is labelled."""
    rows, prm, quick = data["rows"], data["params"], data.get("quick", False)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = {}
    for m in modes:
        pts = sorted((r["batch"], r["decode_tok_s"]) for r in rows if r["mode"] == m)
        series[label(m)] = ([x for x, _ in pts], [y for _, y in pts])
    matched = [r for r in rows if r.get("point") == "memory-matched"]
    notes, missing = [], []
    most = max((r["problems"] for r in rows if r.get("point") == "sweep"), default=0)
    for r in matched:
        text = f"{r['problems']} problems: what fits in the KV memory\none-level sharing needs for {most}"
        notes.append((r["batch"], r["decode_tok_s"], text))
        why = f"would need more KV memory than one-level sharing uses at {most} problems"
        missing += [Missing(label(m), r["batch"], why) for m in modes if m != "tree"]
    F, L, k, T = (prm.get(key, "?") for key in ("fewshot", "problem_len", "samples", "new_tokens"))
    return [
        plot_lines(
            series,
            out / "tree_throughput_vs_batch.png",
            f"A few-shot block of {F:,} tokens shared by all, each {L}-token problem by its {k} samples "
            f"({T} new tokens each): decode throughput",
            "batch (problems x samples)",
            "decode tokens/s, all samples together",
            logx=True,
            missing=missing,
            notes=notes,
            quick=quick,
            ylim_zero=True,
        )
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench tree", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M)")
    p.add_argument("--random-weights", metavar="CONFIG", default=None, help="a preset or config.json shape")
    p.add_argument("--fewshot", type=int, default=1024, help="F, few-shot tokens shared by all (1024)")
    p.add_argument("--problem-len", type=int, default=512, help="L, tokens per problem (512)")
    p.add_argument("--samples", type=int, default=16, help="k, samples per problem (16)")
    p.add_argument("--problems", type=int, nargs="+", default=[1, 4], help="problems per batch to sweep")
    p.add_argument("--new-tokens", type=int, default=32, help="T, tokens per sample (32)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-batch", type=int, default=1024, help="cap on the memory-matched batch (1024)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (16)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    a = p.parse_args(argv)
    if a.random_weights and a.model:
        p.error("give either --model or --random-weights, not both")
    if a.quick:
        a.fewshot, a.problem_len, a.samples, a.problems, a.new_tokens = 48, 24, 2, [1, 2], 4
    run(
        a.random_weights or a.model,
        a.fewshot,
        a.problem_len,
        a.samples,
        a.problems,
        a.new_tokens,
        a.modes.split(","),
        a.out,
        a.max_batch,
        random_weights=a.random_weights is not None,
        quick=a.quick,
        page_size=a.page_size,
    )


if __name__ == "__main__":
    main()
