"""Engine vs transformers on tiny random checkpoints: greedy tokens must match exactly."""

from __future__ import annotations

import pytest
import torch

from hydragen import LLM, SamplingParams

# Prompts that share at several depths: a common stem, two branches, a prompt that is a prefix of
# another, a duplicate, and an unrelated one.
STEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [
    STEM + [30, 31, 32, 33, 34],
    STEM + [30, 31, 40],
    STEM + [50, 51, 52, 53, 54, 55, 56],
    STEM,
    STEM + [30, 31, 32, 33, 34],
    [7, 8, 9, 10, 60, 61],
]
T = 10


def hf_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = hf.generate(
            torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def references(tiny_models):
    return {name: hf_greedy(path, PROMPTS, T) for name, path in tiny_models.items()}


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "llama3_mqa",
        "mistral",
        "mistral_window",
        "qwen2",
        "qwen3",
        "phi3",
        "phi3_window",
        "phi4_mini",
        "gemma2",
        "gemma3",
    ],
)
@pytest.mark.parametrize("sharing", [True, False])
def test_greedy_matches_transformers(tiny_models, references, name, sharing):
    llm = LLM(tiny_models[name], prefix_sharing=sharing, kv_cache_tokens=4096)
    outs = llm.generate(
        PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=T, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for out, ref in zip(outs, references[name], strict=True):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.token_ids == ref
            assert c.finish_reason == "length"


# Prompts several windows long for models whose windows are 8 tokens: a 30-token shared stem, branches off
# it, a prompt that is a prefix of another, and an unrelated one; 24 tokens generated.
WINDOW = 8
LONG_STEM = [(7 * i) % 200 + 20 for i in range(30)]
LONG_PROMPTS = [
    LONG_STEM + [41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
    LONG_STEM + [41, 42, 60],
    LONG_STEM,
    [9, 8, 7, 6, 5, 4, 3, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23],
]
LONG_T = 24


@pytest.fixture(scope="module")
def narrow_windows(tmp_path_factory):
    """The Gemma tiny models with 8-token windows, and transformers' greedy tokens on LONG_PROMPTS."""
    from tests.conftest import TINY, save_tiny

    root = tmp_path_factory.mktemp("narrow")
    out = {}
    for name in ("gemma2", "gemma3"):
        path = save_tiny({**TINY[name], "sliding_window": WINDOW}, root / name)
        out[name] = (path, hf_greedy(path, LONG_PROMPTS, LONG_T))
    return out


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("sharing, page_size", [(True, 16), (False, 16), (True, 4)])
def test_greedy_matches_transformers_several_windows_long(narrow_windows, name, sharing, page_size):
    """Windowed layers see only their last 8 positions of a 30-54-token context, through shared runs (pages
    of 4: runs the window leaves partly or wholly behind) and private tails alike."""
    path, ref = narrow_windows[name]
    llm = LLM(path, prefix_sharing=sharing, kv_cache_tokens=4096, page_size=page_size)
    params = SamplingParams(n=2, temperature=0, max_tokens=LONG_T, ignore_eos=True)
    outs = llm.generate(LONG_PROMPTS, params, use_tqdm=False)
    for out, want in zip(outs, ref, strict=True):
        assert [c.token_ids for c in out.outputs] == [want, want]
    llm.engine.kv.check([])


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_windowed_groups_give_back_pages_before_the_window(narrow_windows, name):
    """Mid-generation, every running table's windowed KV groups hold no page wholly before the window of
    where its previous forward ended (they move a forward late: kv/window_pages.py; the full-attention
    group 0 keeps them all), sharing off (a released page goes back at once) and the step reading past the
    gaps gives transformers' tokens."""
    path, ref = narrow_windows[name]
    llm = LLM(path, prefix_sharing=False, kv_cache_tokens=4096, page_size=4)
    eng = llm.engine
    released = eng.pool.layout.released
    assert released and 0 not in released and set(released.values()) == {WINDOW}
    requests = [
        eng.add_request(p, SamplingParams(max_tokens=LONG_T, temperature=0, ignore_eos=True))
        for p in LONG_PROMPTS
    ]
    seen = 0
    while eng.has_unfinished():
        before = {id(s.kv): s.kv.computed for s in eng.scheduler.running}
        eng.step()
        for s in eng.scheduler.running:
            table = s.kv
            previous = before.get(id(table), 0)  # where its previous forward ended
            gone = max(0, (previous - WINDOW + 1) // 4)  # pages no token from there on reaches
            for g in released:
                held = eng.pool.in_group(table.pages, g)
                assert all(p < 0 for p in held[:gone]) and all(p >= 0 for p in held[gone:]), (g, gone, held)
            assert all(p >= 0 for p in table.pages)
            seen += gone > 0
    assert seen
    eng.kv.check([])
    assert [r.seqs[0].out.generated for r in requests] == ref


def test_prefill_once_per_tree_node(tiny_models):
    """One-token pages make the prefix tree a token tree: every distinct prefix of the prompts (but their
    last tokens) is computed once, whichever request computes it first, and each request's last prompt
    token once for its n samples (they sample from the same logits). Sharing off, each request computes
    its own prompt once and its samples copy it."""
    params = SamplingParams(n=3, temperature=0, max_tokens=2, ignore_eos=True)
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096, page_size=1)
    llm.generate(PROMPTS, params, use_tqdm=False)
    st = llm.engine.stats
    unique = set()
    for p in PROMPTS:
        unique.update(tuple(p[: i + 1]) for i in range(len(p) - 1))
    assert st.prefill_tokens == len(unique) + len(PROMPTS)
    assert st.prompt_tokens == 3 * sum(len(p) for p in PROMPTS)
    off = LLM(tiny_models["llama"], prefix_sharing=False, kv_cache_tokens=4096, page_size=1)
    off.generate(PROMPTS, params, use_tqdm=False)
    assert off.engine.stats.prefill_tokens == sum(len(p) for p in PROMPTS)


def test_shared_nodes_are_batched_not_copied(tiny_models):
    """With sharing on, the decode plan reads the shared stem once for the whole range of sequences."""
    # Small pages: memory is counted in whole pages, and a 16-token page per sequence would dwarf these
    # 17-token prompts; what is checked here is that the shared prompt is not stored per sequence.
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096, page_size=2)
    eng = llm.engine
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(n=4, temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(6):  # the prompts (those sharing another's pages wait for them), the samples' forks
        eng.step()
        if len(eng.last_plan.work) == 12:
            break
    plan = eng.last_plan
    assert len(plan.work) == 12 and all(len(w.tokens) == 1 for w in plan.work)  # all 12 decode
    stem = [r for r in plan.shared if (r.lo, r.hi) == (0, 12)]
    assert stem and stem[0].page_hi * 2 >= len(STEM), f"no shared run covers all 12 sequences: {plan.shared}"
    # Each sequence reads per sequence only its last, partial page (nothing of the shared prompt).
    assert max(w.start - cut * 2 for w, cut in zip(plan.work, plan.cuts, strict=True)) <= 2
    assert eng.stats.peak_kv_tokens < 12 * len(PROMPTS[0])


def test_alone_equals_batched(tiny_models):
    llm = LLM(tiny_models["qwen2"], kv_cache_tokens=8192)
    params = SamplingParams(n=1, temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    many = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    outs = llm.generate(many, params, use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone for o in outs[2 :: len(PROMPTS)])


def test_seeded_sampling_reproducible_and_distinct(tiny_models):
    path = tiny_models["llama"]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    a = LLM(path, kv_cache_tokens=4096).generate(PROMPTS[:2], params, use_tqdm=False)
    b = LLM(path, prefix_sharing=False, kv_cache_tokens=4096).generate(PROMPTS[:2], params, use_tqdm=False)
    ids_a = [[c.token_ids for c in o.outputs] for o in a]
    ids_b = [[c.token_ids for c in o.outputs] for o in b]
    assert ids_a == ids_b
    assert len({tuple(x) for x in ids_a[0]}) > 1, "n samples of one prompt must differ"
    c = LLM(path, kv_cache_tokens=4096).generate(
        PROMPTS[:2], SamplingParams(**{**params.__dict__, "seed": 8}), use_tqdm=False
    )
    assert [[x.token_ids for x in o.outputs] for o in c] != ids_a


@pytest.mark.parametrize("name", ["mistral", "gemma2"])  # Gemma 2: soft-capped scores and logits
def test_logprobs_match_transformers(tiny_models, name):
    from transformers import AutoModelForCausalLM

    path = tiny_models[name]
    llm = LLM(path, kv_cache_tokens=4096)
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 6
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = torch.tensor([PROMPTS[0] + out.token_ids])
    logp = torch.log_softmax(hf(full).logits[0].float(), -1)
    for t, (tok, row) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        expect = logp[len(PROMPTS[0]) - 1 + t]
        assert tok in row and len(row) >= 3
        for k, v in row.items():
            assert abs(v - expect[k].item()) < 1e-4


def test_stop_token_ids_max_tokens_and_eos(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096)
    ref = (
        llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # The model's EOS (id 2 in the tiny config) ends a sequence unless ignore_eos.
    llm.engine.eos_ids = {ref[1]}
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[
        0
    ]
    assert out.token_ids == ref[: ref.index(ref[1]) + 1] and out.finish_reason == "stop"


def test_bad_inputs_raise_clear_errors(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096)
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 999]], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        llm.generate([[3] * 600], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    for bad in (
        dict(n=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_tokens=0),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(logprobs=50),
        dict(seed="x"),
        dict(skip_special_tokens="no"),
        dict(temperature=float("nan")),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_models["llama"], dtype="float64")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_models["llama"], device="tpu")


def test_unsupported_architecture_named(tmp_path, tiny_models):
    import json
    import shutil

    path = tmp_path / "gpt"
    shutil.copytree(tiny_models["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(str(path))


def test_memory_pressure_runs_in_waves(tiny_models):
    """A cache too small for all requests at once still completes every request, in waves."""
    llm = LLM(tiny_models["llama"], kv_cache_tokens=200)
    params = SamplingParams(n=2, temperature=0, max_tokens=T, ignore_eos=True)
    outs = llm.generate(PROMPTS * 3, params, use_tqdm=False)
    ref = LLM(tiny_models["llama"], kv_cache_tokens=8192).generate(PROMPTS * 3, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_fp32(tiny_models, dtype):
    """bf16/fp16 weights and KV: the first greedy token and its log-probability follow fp32."""
    params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    ref = LLM(tiny_models["llama"], kv_cache_tokens=4096).generate(PROMPTS, params, use_tqdm=False)
    out = LLM(tiny_models["llama"], dtype=dtype, kv_cache_tokens=4096).generate(
        PROMPTS, params, use_tqdm=False
    )
    for o, r in zip(out, ref, strict=True):
        assert all(len(c.token_ids) == 3 for c in o.outputs)
        tok = r.outputs[0].token_ids[0]
        assert o.outputs[0].token_ids[0] == tok
        assert abs(o.outputs[0].logprobs[0][tok] - r.outputs[0].logprobs[0][tok]) < 0.1


def test_each_row_samples_with_its_own_settings_as_the_batch_changes(tiny_models):
    """The runner keeps the last batch's sampling settings as tensors and reuses them while the same sequences
    sample again. Here the batch changes under it (a request ends and a waiting one takes its row, with the
    same batch size), and every request must still draw exactly what it draws alone."""
    path = tiny_models["llama"]
    settings = [
        dict(temperature=0.0, max_tokens=3),
        dict(temperature=1.5, top_k=5, max_tokens=8, seed=3),
        dict(temperature=0.7, top_p=0.5, min_p=0.1, max_tokens=12, seed=4),
        dict(temperature=1.2, top_p=0.9, max_tokens=9, seed=5),
        dict(temperature=0.9, max_tokens=6, seed=6),
    ]
    params = [SamplingParams(ignore_eos=True, **s) for s in settings]
    prompts = [PROMPTS[i] for i in range(len(params))]
    llm = LLM(path, kv_cache_tokens=4096, max_num_seqs=3)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [
        llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
        for p, q in zip(prompts, params, strict=True)
    ]
    assert together == alone
    assert len({tuple(t[:3]) for t in alone}) == len(alone)  # the settings draw different tokens
