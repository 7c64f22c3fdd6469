"""Long document, many questions: the Hydragen paper's "needle" setting on a model that fits a laptop.

A long synthetic document (seeded filler prose built from word lists, no downloads) hides N facts of the
form "The dog named Biscuit has fur that is green."; the shared prefix is an instruction, the document and
a few answered example questions; each of Q prompts then asks about one more dog. All Q prompts go to the
engine in one ``generate`` call, greedy, a few tokens each, stopping at a newline.

Measured per Q, with prefix sharing on and off:

- on (``LLM(prefix_sharing=True)``): the Q prompts meet in the radix tree, the document + examples are
  prefilled once, and every decode step reads that KV once for all Q questions (one batched attention
  product per shared node), each question keeping only its own suffix in a private tail;
- off (``LLM(prefix_sharing=False)``): every question is an independent request with a private prefix
  tree: it prefills its whole prompt, document included, copies that KV into its own decode tail and
  attends to its own copy; nothing is reused across questions.

Reported: time to answer all Q questions (the prefix cache is emptied before every timed run, so the
document is prefilled inside the timed region every time) and seconds per question; prompt tokens run
through the model vs. served from shared KV; peak KV memory; and answer accuracy: the answer's first word
(lowercase, punctuation stripped) equals the fact's color, chance being 1 / number of colors. Sharing on
and off must give identical answer tokens (the attention is exact, not approximate): the run checks it,
records it, and fails if they differ.

Prompt format, fixed after measuring SmolLM2-135M-Instruct on 13 questions about an 800-token document
with 16 facts (two seeds): "stem" 46% / 54%, plain "raw" completion after "Answer:" 23% / 38%, the
model's chat template with few-shot turns ("chat") 23% / 23%; chance is 10%. The "stem" question ends
with an answer stem that restates the fact's wording ("Answer: The dog named X has fur that is"), so the
model's first word is the color: the task is retrieval from the document, as in the paper's needle test,
not paraphrase. ``--format`` reruns the others.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydragen.bench.core.common import machine_description, publish, say_quick
from hydragen.bench.core.plots import label, plot_lines
from hydragen.bench.longdoc.document import (
    COLORS,
    DEFAULT_FORMAT,
    FORMATS,
    Document,
    Fact,
    build_prompts,
    first_word,
    make_document,
)

RESULT_NAME = "longdoc"  # longdoc.json, longdoc.md


def _tokenize(llm, prompts: list, fmt: str) -> list[list[int]]:
    tok = llm.tokenizer
    if fmt == "chat":
        return [tok.apply_chat_template(conv) for conv in prompts]
    return [tok.encode(p) for p in prompts]


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return n


@dataclass
class Setup:
    """Everything the runs share: the document, the few-shot facts and the questions (longest Q)."""

    doc: Document
    doc_tokens: int
    shots: list[Fact]
    questions: list[Fact]


def make_setup(llm, doc_tokens: int, num_facts: int, num_shots: int, max_q: int, seed: int) -> Setup:
    count = lambda s: len(llm.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    doc = make_document(num_facts, doc_tokens, count, seed)
    order = list(doc.facts)
    random.Random(seed + 1).shuffle(order)
    if num_shots >= num_facts:
        raise ValueError(f"need more facts ({num_facts}) than few-shot examples ({num_shots})")
    shots, pool = order[:num_shots], order[num_shots:]
    # More questions than facts: questions repeat (still valid; their prompts are identical).
    questions = [pool[i % len(pool)] for i in range(max_q)]
    return Setup(doc, count(doc.text), shots, questions)


def _make_llm(model, sharing: bool):
    """The engine with its default KV cache (a quarter of free memory; reserved, touched only when used)."""
    from hydragen import LLM

    llm = LLM(model, prefix_sharing=sharing)
    if llm.tokenizer is None:
        raise ValueError(
            f"bench longdoc needs a model with a tokenizer (it asks questions in text); "
            f"{llm.model_path} has no tokenizer files"
        )
    return llm


def timed_run(llm, prompt_ids: list[list[int]], params) -> tuple[dict, list]:
    """One generate() call over all prompts, prefix cache emptied first: timings, stat deltas, outputs."""
    st = llm.engine.stats
    llm.reset_prefix_cache()
    st.peak_kv_tokens = 0  # a running maximum: restart it so this run's peak is its own
    before = (st.prompt_tokens, st.prefill_tokens, st.generated_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    prompt, prefill = st.prompt_tokens - before[0], st.prefill_tokens - before[1]
    stats = dict(
        time_s=elapsed,
        prompt_tokens=prompt,
        prefill_tokens=prefill,
        shared_tokens=prompt - prefill,
        generated_tokens=st.generated_tokens - before[2],
        peak_kv_mib=st.peak_kv_tokens * llm.engine.pool.bytes_per_token / 2**20,
    )
    return stats, [o.outputs[0] for o in outs]


def run(
    model=None,
    doc_tokens: int = 1500,
    num_facts: int = 24,
    questions: tuple[int, ...] = (1, 4, 16),
    modes: tuple[str, ...] = ("on", "off"),
    num_shots: int = 3,
    max_tokens: int = 4,
    fmt: str = DEFAULT_FORMAT,
    seed: int = 0,
    out: Path = Path("bench-out"),
    quick: bool = False,
    threads: int | None = None,
) -> list[dict]:
    """Time answering Q questions about one long document with sharing on/off; write JSON, MD and PNG."""
    import torch

    from hydragen import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)

    if quick:
        say_quick("longdoc")
        doc_tokens, num_facts, questions, num_shots = 200, 6, (1, 3), 2
    questions = tuple(sorted(set(questions)))
    if not questions or questions[0] < 1:
        raise ValueError(f"question counts must be >= 1, got {questions}")
    if not modes or any(m not in ("on", "off") for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be on, off or both; got {list(modes)}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
    print(f"[longdoc] {machine_description()}", file=sys.stderr)

    llms, setup, prompt_ids = {}, None, []
    for mode in modes:  # both engines stay loaded so that each Q runs on and off back to back
        t0 = time.perf_counter()
        llms[mode] = llm = _make_llm(model, mode == "on")
        if setup is None:  # the document is measured in the model's tokens
            setup = make_setup(llm, doc_tokens, num_facts, num_shots, questions[-1], seed)
            prompts = build_prompts(setup.doc, setup.shots, setup.questions, fmt)
            prompt_ids = _tokenize(llm, prompts, fmt)
            longest, common = max(map(len, prompt_ids)), _common_prefix(prompt_ids)
            print(
                f"[longdoc] document {setup.doc_tokens} tokens, {num_facts} facts, {num_shots} examples; "
                f"prompts up to {longest} tokens, {common} common to all; format {fmt!r}",
                file=sys.stderr,
            )
        need = questions[-1] * (longest + max_tokens + 2) + longest  # sharing off: a copy per question
        if llm.engine.pool.num_slots < need:
            raise ValueError(
                f"Q={questions[-1]} needs {need} KV slots with sharing off; the cache has "
                f"{llm.engine.pool.num_slots}: ask fewer questions or use a shorter document"
            )
        # Warm-up on two prompts longer than one prefill chunk (every kernel shape the timed runs use);
        # the timed runs then start from an empty cache.
        warm = prompt_ids[0][: llm.engine.scheduler.prefill_chunk + 64]
        llm.generate([warm, warm + [warm[-1]]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        print(
            f"[longdoc] sharing {mode}: loaded and warmed up in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    assert setup is not None

    rows: list[dict] = []
    tokens: dict[tuple[str, int], list[list[int]]] = {}  # (mode, Q) -> answer token ids
    for q in questions:
        for mode in modes:
            stats, outs = timed_run(llms[mode], prompt_ids[:q], params)
            expected = [f.color for f in setup.questions[:q]]
            correct = sum(first_word(o.text) == c for o, c in zip(outs, expected, strict=True))
            tokens[(mode, q)] = [o.token_ids for o in outs]
            rows.append(
                dict(
                    mode=mode,
                    questions=q,
                    doc_tokens=setup.doc_tokens,
                    **stats,
                    s_per_question=stats["time_s"] / q,
                    correct=correct,
                    accuracy=correct / q,
                    answers=[o.text for o in outs],
                    expected=expected,
                )
            )
            print(
                f"[longdoc] sharing {mode:3s} Q={q:3d}: {stats['time_s']:7.2f}s "
                f"({stats['time_s'] / q:.2f} s/question), prefilled {stats['prefill_tokens']}, "
                f"shared {stats['shared_tokens']}, peak KV {stats['peak_kv_mib']:.0f} MiB, "
                f"accuracy {correct}/{q}",
                file=sys.stderr,
            )
    del llms, llm
    gc.collect()
    rows.sort(key=lambda r: (modes.index(r["mode"]), r["questions"]))

    # Exactness: the same answer tokens with sharing on and off, and the same answer to a question
    # whatever else shares the batch.
    both = len(modes) == 2
    for row in rows:
        mode, q = row["mode"], row["questions"]
        other = "off" if mode == "on" else "on"
        row["answers_match"] = tokens[(mode, q)] == tokens[(other, q)] if both else None
        if both and mode == "on":
            off = next(x for x in rows if x["mode"] == "off" and x["questions"] == q)
            row["speedup_vs_off"] = off["time_s"] / row["time_s"]
    match = all(r["answers_match"] is not False for r in rows)
    consistent = all(tokens[(m, q)] == tokens[(m, questions[-1])][:q] for m in modes for q in questions)

    acc = next(r["accuracy"] for r in reversed(rows))  # largest Q; identical across modes when they match
    notes = (
        f"Model: {_model_name(model)}; fp32, greedy, at most {max_tokens} answer tokens, stop at newline; "
        f"prompt format {fmt!r}. Document: {setup.doc_tokens} tokens of generated filler prose with "
        f'{num_facts} facts ("The dog named X has fur that is Y.", {len(COLORS)} colors) and {num_shots} '
        f"answered examples in the shared prefix; prompts up to {longest} tokens, {common} of them common "
        f"to all. **Accuracy at Q={questions[-1]}: {acc:.0%}** ({1 / len(COLORS):.0%} is chance). "
        + (
            f"Answers with sharing on and off: **{'identical' if match else 'DIFFERENT'}** for every Q. "
            if both
            else ""
        )
        + f"Answers {'do not depend' if consistent else 'DEPEND'} on the other questions in the batch. "
        "Sharing on prefills the document once and serves the other questions' prompt tokens from its "
        "shared KV (with Q=1 nothing is shared: the tree and the sequence's tail both hold the prompt). "
        "Sharing off prefills every question's whole prompt and copies it into that sequence's private "
        "tail; prefill is budgeted per engine step, so questions are prefilled about one per step and "
        "each finishes a few decode steps later: few private copies coexist, and peak KV stays well "
        "below Q copies while the time grows with Q. The prefix cache is emptied before every timed run; "
        "on and off run back to back for each Q. prefill_tokens counts each prompt's last token (fed by "
        "the first decode step); peak KV is sampled at decode steps."
    )
    cols = [
        "mode",
        "questions",
        "doc_tokens",
        "time_s",
        "s_per_question",
        "speedup_vs_off",
        "prefill_tokens",
        "shared_tokens",
        "peak_kv_mib",
        "accuracy",
        "answers_match",
    ]
    title = f"Long document, many questions (document {setup.doc_tokens} tokens, {num_facts} facts)"
    prm = dict(doc_tokens=setup.doc_tokens, num_facts=num_facts, questions=list(questions), modes=list(modes))
    publish(
        rows,
        cols,
        out,
        RESULT_NAME,
        title,
        notes,
        quick=quick,
        quick_note=(
            "a 215-token document with 6 facts and 3 questions: accuracy moves in steps of 1/3 and the "
            "speedups rest on one or three requests; the full run asks 16 questions about 1,545 tokens."
        ),
        plots=plots,
        params=prm,
    )
    if not match:
        raise RuntimeError("answers differ between sharing on and off: attention is not exact")
    if not consistent:
        raise RuntimeError("an answer changed with the other questions in the batch: attention is not exact")
    return rows


def plots(data: dict, out: Path) -> list[Path]:
    """Time to answer Q questions, sharing on and off."""
    rows, quick = data["rows"], data.get("quick", False)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = {
        label(m): (
            [r["questions"] for r in rows if r["mode"] == m],
            [r["time_s"] for r in rows if r["mode"] == m],
        )
        for m in modes
    }
    doc = data["params"].get("doc_tokens") or rows[0]["doc_tokens"]
    return [
        plot_lines(
            series,
            out / "longdoc_time_vs_questions.png",
            f"Time to answer Q questions about one {doc:,}-token document",
            "questions (Q)",
            "seconds to answer all Q questions",
            quick=quick,
            ylim_zero=True,
        )
    ]


def _model_name(model) -> str:
    if model is None:
        return "embedded SmolLM2-135M-Instruct"
    return Path(model).name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="hydragen bench longdoc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint with a tokenizer (default: embedded model)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the run works (seconds)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out)")
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length in tokens (default 1500)")
    p.add_argument("--facts", type=int, default=24, help="facts planted in the document (default 24)")
    p.add_argument("--shots", type=int, default=3, help="answered examples in the shared prefix (default 3)")
    p.add_argument("--questions", type=int, nargs="+", default=[1, 4, 16], help="Q values (default 1 4 16)")
    p.add_argument("--modes", default="on,off", help="prefix sharing on, off or both (default on,off)")
    p.add_argument("--max-tokens", type=int, default=4, help="answer tokens at most (default 4)")
    p.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT, help="prompt format (default stem)")
    p.add_argument("--seed", type=int, default=0, help="document seed (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a = p.parse_args(argv)
    try:
        run(
            a.model,
            doc_tokens=a.doc_tokens,
            num_facts=a.facts,
            questions=tuple(a.questions),
            modes=tuple(m.strip() for m in a.modes.split(",") if m.strip()),
            num_shots=a.shots,
            max_tokens=a.max_tokens,
            fmt=a.format,
            seed=a.seed,
            out=a.out,
            quick=a.quick,
            threads=a.threads,
        )
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
