"""The benchmarks run end to end at tiny sizes and write well-formed results (speed is not checked)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hydragen.bench.core.common import QUICK_BANNER
from hydragen.bench.e2e.decode_throughput import decode_rate, step_floor_seconds, sweep_points
from hydragen.bench.e2e.decode_throughput import main as e2e_main
from hydragen.bench.e2e.decode_throughput import run as run_e2e
from hydragen.bench.e2e.tree_sharing import kv_tokens_needed, tree_prompts
from hydragen.bench.e2e.tree_sharing import run as run_tree
from tests.helpers.sampling_helpers import reference

PNG = b"\x89PNG\r\n\x1a\n"


def test_e2e_quick(tiny_models, tmp_path):
    rows = run_e2e(
        tiny_models["llama"],
        prompt_len=24,
        ns=[1, 3],
        new_tokens=12,
        modes=["hydragen", "nosharing", "noattn"],
        out=tmp_path,
        p_sweep=[8, 16],
    )
    points = [(24, 1), (24, 3), (8, 3), (16, 3)]
    assert [(r["mode"], r["prompt_len"], r["n"]) for r in rows] == [
        (m, p, n) for m in ("hydragen", "nosharing", "noattn") for p, n in points
    ]
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert len(data["rows"]) == 12 and data["machine"]
    # A rate is a difference of two timed runs; one that timing noise swamps is NaN (said, not hidden).
    finite = [r for r in data["rows"] if not math.isnan(r["decode_tok_s"])]
    assert len(finite) >= len(rows) // 2
    for r in data["rows"]:
        assert r["time_T"] > 0 and r["time_1"] > 0
        if math.isnan(r["decode_tok_s"]):
            assert r["time_T"] - r["time_1"] <= 0.05 * r["time_T"]
            assert math.isnan(r["step_ms"])  # the same noise: no step time either (never a negative one)
            continue
        assert r["step_ms"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["n"] * 11 / (r["time_T"] - r["time_1"]))
        ceiling = next(
            x["decode_tok_s"]
            for x in rows
            if x["mode"] == "noattn" and (x["prompt_len"], x["n"]) == (r["prompt_len"], r["n"])
        )
        if math.isnan(ceiling):
            continue
        assert r["of_ceiling"] == pytest.approx(r["decode_tok_s"] / ceiling)
    assert (tmp_path / "e2e.md").read_text().count("\n| hydragen |") == 4
    for name in ("e2e_throughput_vs_n.png", "e2e_throughput_vs_prompt.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_e2e_peers_run_in_their_own_processes_and_a_crash_is_reported(tiny_models, tmp_path, monkeypatch):
    """transformers runs and times itself in a process of its own; llama.cpp dying of SIGSEGV there (as an
    AMX build of llama-cpp-python does in llama_decode) is reported, and the run goes on without it."""
    from hydragen.bench.peers import llamacpp_peer
    from tests.helpers.crashing_peer import SegfaultingPeer

    monkeypatch.setattr(llamacpp_peer, "unavailable", lambda model, random: None)
    monkeypatch.setattr(llamacpp_peer, "Peer", SegfaultingPeer)
    modes = ["hydragen", "llamacpp", "hf"]
    rows = run_e2e(tiny_models["llama"], 16, [1, 2], 3, modes, tmp_path)
    assert [(r["mode"], r["n"]) for r in rows] == [("hydragen", 1), ("hydragen", 2), ("hf", 1), ("hf", 2)]
    assert all(r["time_T"] > 0 for r in rows)
    skipped = json.loads((tmp_path / "e2e.json").read_text())["params"]["skipped"]
    assert list(skipped) == ["llamacpp"]
    assert skipped["llamacpp"].startswith("llama.cpp crashed (signal 11, SIGSEGV); its last output: ")


def test_e2e_cli_random_weights(tmp_path, capsys):
    """--random-weights builds the shape without weights; a bad mode or shape is a clear error."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 256,
    }
    (tmp_path / "shape.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    e2e_main(
        [
            "--random-weights",
            str(tmp_path / "shape.json"),
            "--quick",
            "--modes",
            "hydragen,hf",
            "--out",
            str(out),
        ]
    )
    data = json.loads((out / "e2e.json").read_text())
    assert {r["mode"] for r in data["rows"]} == {"hydragen"}  # hf needs real weights: skipped, said so
    assert data["params"]["skipped"] == {"hf": "needs transformers and real weights"}
    cap = capsys.readouterr()
    assert "needs transformers and real weights" in cap.err
    # --quick says, before and around its table, that its numbers are noise.
    assert QUICK_BANNER in cap.err and cap.out.count(QUICK_BANNER) == 2 and data["quick"] is True
    with pytest.raises(ValueError, match="unknown mode 'vllm'"):
        run_e2e(None, 8, [1], 2, ["vllm"], tmp_path)
    from hydragen import LLM

    with pytest.raises(ValueError, match="neither a preset"):
        LLM("no-such-shape", random_weights=True)


def test_random_weights_presets_build_the_published_shapes():
    from hydragen.model.config import ModelConfig
    from hydragen.model.presets import PRESETS

    c = ModelConfig.from_hf(PRESETS["codellama-7b"])
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (32, 32, 32, 128, 4096)
    c = ModelConfig.from_hf(PRESETS["codellama-34b"])
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (64, 8, 128)


def test_random_weights_model_generates(tiny_models):
    from hydragen import LLM, SamplingParams

    llm = LLM(tiny_models["llama"], random_weights=True)
    assert llm.tokenizer is None or llm.model_path == tiny_models["llama"]
    w = llm.model.layers[0].attn_norm
    assert torch.equal(w, torch.ones_like(w))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_decode_rate_is_the_papers_difference_or_nan_when_within_noise():
    assert decode_rate(8, 33, 2.0, 6.0) == pytest.approx(8 * 32 / 4.0)
    assert math.isnan(decode_rate(1, 32, 11.4, 10.9))  # t(T) < t(1): noise, not a rate
    assert math.isnan(decode_rate(8, 32, 70.9, 73.0))  # decode under 5 % of the run


def test_sweep_points_cover_both_figures():
    assert sweep_points(2048, [1, 8], [512, 2048], 8) == [(2048, 1), (2048, 8), (512, 8)]


def test_tree_quick(tiny_models, tmp_path):
    rows = run_tree(
        tiny_models["llama"],
        fewshot=40,
        problem_len=16,
        samples=3,
        problem_counts=[1, 2],
        new_tokens=4,
        out=tmp_path,
    )
    data = json.loads((tmp_path / "tree.json").read_text())["rows"]
    assert len(data) == len(rows) == 7  # 2 counts x 3 modes + the tree's memory-matched point
    matched = [r for r in rows if r["point"] == "memory-matched"]
    assert len(matched) == 1 and matched[0]["mode"] == "tree" and matched[0]["problems"] > 2
    assert matched[0]["kv_tokens_model"] <= kv_tokens_needed("onelevel", 40, 2, 16, 3, 4)
    assert all(r["same_seqs"] == 1.0 for r in rows if r["mode"] != "tree")
    assert all(r["decode_tok_s"] > 0 and r["preemptions"] == 0 for r in rows)
    peak = {(r["mode"], r["problems"]): r["peak_kv_mib"] for r in rows}
    assert peak[("tree", 2)] < peak[("onelevel", 2)] < peak[("nosharing", 2)]
    assert (tmp_path / "tree_throughput_vs_batch.png").read_bytes()[:8] == PNG


def test_tree_onelevel_reads_only_the_fewshot_block_shared(tiny_models):
    """One-level sharing (the scheduler's Sharing(limit=F)): each sample holds its own copy of its problem's
    pages, only the few-shot pages stay shared; full sharing also shares each problem among its samples."""
    from hydragen import LLM, SamplingParams
    from hydragen.engine.scheduler import Sharing

    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096, page_size=8)  # 40 few-shot tokens = 5 pages
    prompts = tree_prompts(llm.config.vocab_size, 40, 2, 16)  # 56 tokens each: 7 pages
    assert prompts[0][:40] == prompts[1][:40] and prompts[0][40] != prompts[1][40]
    eng = llm.engine
    for limit, runs, cut in ((None, [(0, 5, 0, 4), (5, 7, 0, 2), (5, 7, 2, 4)], 7), (40, [(0, 5, 0, 4)], 5)):
        eng.scheduler.sharing = Sharing(limit=limit)
        llm.reset_prefix_cache()
        for ids in prompts:
            eng.add_request(ids, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
        while len(eng.last_plan.work) != 4:
            eng.step()
        assert sorted(eng.batch.shared) == runs
        assert eng.last_plan.cuts == (cut,) * 4
        while eng.has_unfinished():
            eng.step()


def test_floor_counts_model_and_shared_attention_once():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_layers=30,
        vocab_size=49152,
    )
    flops = step_floor_seconds(cfg, 64, 2048, 1.0)
    params = 30 * (576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536) + 49152 * 576
    assert flops == 2 * params * 64 + 4 * 64 * 9 * 2048 * 64 * 30


def test_bench_all_runs_every_benchmark_into_its_own_folder(monkeypatch, tmp_path):
    import sys
    import types

    from hydragen import cli
    from hydragen.cli import bench

    calls = []
    fake = {}
    for name in bench.BENCHMARKS:
        mod = types.ModuleType(f"fake_bench_{name}")
        mod.main = lambda argv, name=name: calls.append((name, argv))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        fake[name] = mod.__name__
    monkeypatch.setattr(bench, "BENCHMARKS", fake)
    assert cli.main(["bench", "all", "--quick", "--out", str(tmp_path)]) == 0
    assert calls == [(n, ["--out", f"{tmp_path}/{n}", "--quick"]) for n in fake]


def test_llamacpp_peer_shares_the_prompt_cells(tmp_path):
    """Only where llama-cpp-python is installed (it builds from source; CI does not install it)."""
    pytest.importorskip("llama_cpp")
    from hydragen.bench.e2e.decode_throughput import synthetic_prompt
    from hydragen.bench.peers import llamacpp_peer

    assert llamacpp_peer.unavailable(None, False) is None
    assert llamacpp_peer.unavailable(None, True) == "needs real GGUF weights"
    peer = llamacpp_peer.Peer(None, 32, 4, 3)
    prompt = synthetic_prompt(peer.vocab, 32)
    alone = peer.generate(prompt, 1, 4)
    together = peer.generate(prompt, 3, 4)
    assert len(together) == 3 and all(len(t) == 4 for t in together)
    assert together[0][:2] == alone[0][:2]  # greedy from the same shared prompt cells
    rows = run_e2e(None, 16, [1, 2], 3, ["llamacpp"], tmp_path)
    assert [(r["mode"], r["n"]) for r in rows] == [("llamacpp", 1), ("llamacpp", 2)]


class _ChainRecorder:
    """llama-cpp-python's sampler calls, recorded: what sampler_chain builds, without llama.cpp."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name.removeprefix("llama_sampler_"), *args)) or name


@pytest.mark.parametrize(
    "settings, stages",
    [
        (None, None),
        ({"temperature": 0.0, "top_p": 0.9}, None),  # greedy
        (
            {"temperature": 0.8, "top_p": 0.95},
            [("init_temp", 0.8), ("init_top_p", 0.95, 1), ("init_dist", 0)],
        ),
        ({"temperature": 1.0}, [("init_dist", 0)]),  # nothing changes the distribution: a plain draw
        (
            {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3},
            [
                ("init_temp", 0.7),
                ("init_min_p", 0.05, 1),
                ("init_top_k", 40),
                ("init_top_p", 0.9, 1),
                ("init_dist", 3),
            ],
        ),
        (
            {"temperature": 0.8, "top_k": 2**32 + 5},
            [("init_temp", 0.8), ("init_dist", 0)],
        ),  # top_k >= vocab: off
    ],
)
def test_llamacpp_peer_samples_from_hydragens_distribution(settings, stages):
    """The peer's chain applies the temperature first, then min_p, top_k and top_p, in hydragen's (and vLLM's)
    order; settings that change nothing add no stage (a top_k of the whole vocabulary or more too, which a C
    int would wrap); temperature 0 is greedy (no chain)."""
    from hydragen.bench.peers.llamacpp_peer import sampler_chain

    fake = _ChainRecorder()
    chain = sampler_chain(fake, settings, vocab=1000)
    if stages is None:
        assert chain is None and fake.calls == []
        return
    made = [c for c in fake.calls if c[0].startswith("init_")]
    added = [c for c in fake.calls if c[0] == "chain_add"]
    assert made == stages
    assert [c[2] for c in added] == [f"llama_sampler_{s[0]}" for s in stages]  # each stage, in order


@pytest.mark.parametrize(
    "probs, settings",
    [
        ([0.6, 0.1] + [0.01] * 30, {"top_p": 0.8, "min_p": 0.05}),  # min_p after top_p would keep token 1
        ([0.9, 0.04] + [0.001] * 60, {"top_p": 0.95, "min_p": 0.04}),
        (None, {"temperature": 0.8, "top_p": 0.95}),
        (None, {"temperature": 0.8, "top_k": 40, "top_p": 0.95}),
        (None, {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "min_p": 0.02}),
    ],
)
def test_llamacpp_peers_chain_keeps_the_tokens_hydragen_keeps(probs, settings):
    """llama.cpp's own samplers, run by the peer's chain on a row of logits, keep exactly the tokens
    hydragen's distribution keeps (where llama-cpp-python is installed; no model needed)."""
    L = pytest.importorskip("llama_cpp")
    import ctypes

    import numpy as np

    from hydragen.bench.peers.llamacpp_peer import sampler_chain

    logits = list(np.log(probs)) if probs else list(np.random.default_rng(0).normal(size=200) * 2)
    settings = {"temperature": 1.0, **settings}
    chain = sampler_chain(L, settings, vocab=len(logits))
    row = (L.llama_token_data * len(logits))(
        *[L.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)]
    )
    cur = L.llama_token_data_array(row, len(logits), -1, False)
    L.llama_sampler_apply(chain, ctypes.byref(cur))
    kept = sorted(row[i].id for i in range(cur.size))
    L.llama_sampler_free(chain)
    defined = reference(torch.tensor(logits), settings["temperature"], settings.get("top_k", 0),
                        settings.get("top_p", 1.0), settings.get("min_p", 0.0))  # fmt: skip
    assert kept == torch.nonzero(defined).flatten().tolist()


def test_llamacpp_peer_draws_each_sequence_on_its_own():
    """A flat distribution: the sampled peer leaves greedy's tokens, each of n sequences of one prompt draws
    its own first token, and a seed reproduces a run (where llama-cpp-python is installed)."""
    pytest.importorskip("llama_cpp")
    from hydragen.bench.e2e.decode_throughput import synthetic_prompt
    from hydragen.bench.peers import llamacpp_peer

    flat = {"temperature": 1.5, "seed": 7}
    greedy = llamacpp_peer.Peer(None, 32, 6, 8)
    prompt = synthetic_prompt(greedy.vocab, 32)
    sampled = llamacpp_peer.Peer(None, 32, 6, 8, sampling=flat).generate(prompt, 8, 6)
    assert sampled != greedy.generate(prompt, 8, 6)
    assert len({s[0] for s in sampled}) > 1  # not one draw shared by every sequence
    assert llamacpp_peer.Peer(None, 32, 6, 8, sampling=flat).generate(prompt, 8, 6) == sampled


def test_bench_e2e_gives_its_sampling_to_the_llamacpp_peer(monkeypatch):
    """e2e's llama.cpp runs sample with the settings its hydragen runs use (the peer is built in its own
    process: what it is built with is what that process is handed)."""
    from hydragen.bench.e2e import decode_throughput as e2e
    from hydragen.bench.peers import llamacpp_peer

    class Built(Exception):
        pass

    def peer_process(name, make, *args, sampling=None, **kwargs):
        assert (name, make) == ("llama.cpp", llamacpp_peer.Peer)
        raise Built(dict(sampling))

    monkeypatch.setattr(llamacpp_peer, "unavailable", lambda model, random: None)
    monkeypatch.setattr(e2e, "PeerProcess", peer_process)
    monkeypatch.setattr(e2e, "ENGINE_SAMPLING", {"temperature": 0.7, "top_p": 0.9, "top_k": 0})
    with pytest.raises(Built) as built:
        e2e._runner("llamacpp", None, [(32, 2)], 4, False, "cpu", "float32", 4)
    assert built.value.args[0] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0}


def test_llamacpp_peer_with_top_k_1_picks_what_greedy_picks():
    """A sampled chain that keeps one token draws the argmax: the chain reads each sequence's own logits
    (where llama-cpp-python is installed)."""
    pytest.importorskip("llama_cpp")
    from hydragen.bench.e2e.decode_throughput import synthetic_prompt
    from hydragen.bench.peers import llamacpp_peer

    greedy = llamacpp_peer.Peer(None, 32, 6, 3)
    one = llamacpp_peer.Peer(None, 32, 6, 3, sampling={"temperature": 0.8, "top_k": 1, "seed": 5})
    prompts = [synthetic_prompt(greedy.vocab, 32, seed=s) for s in (1, 2, 3)]
    assert one.generate_prompts(prompts, 6) == greedy.generate_prompts(prompts, 6)
    assert one.generate(prompts[0], 3, 6) == greedy.generate(prompts[0], 3, 6)


def test_llamacpp_peer_keeps_distinct_prompts_apart():
    """Distinct prompts are sequences of their own: each continues as it would alone (where llama-cpp-python
    is installed)."""
    pytest.importorskip("llama_cpp")
    from hydragen.bench.e2e.decode_throughput import synthetic_prompt
    from hydragen.bench.peers import llamacpp_peer

    peer = llamacpp_peer.Peer(None, 32, 4, 3, cells=3 * (32 + 4) + 64)
    prompts = [synthetic_prompt(peer.vocab, 32, seed=s) for s in (1, 2, 3)]
    together = peer.generate_prompts(prompts, 4)
    assert len(together) == 3 and all(len(t) == 4 for t in together)
    alone = [peer.generate(p, 1, 4)[0] for p in prompts]
    assert [t[:2] for t in together] == [a[:2] for a in alone]
    assert len({tuple(t) for t in together}) > 1  # not one sequence read three times


def test_cost_rule_quick(tmp_path):
    from hydragen import cli
    from hydragen.engine.sharing import sharing_pays

    argv = ["bench", "cost-rule", "--quick", "--threshold", "2048", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "cost_rule.json").read_text())
    assert len(data["rows"]) == 4
    for r in data["rows"]:
        assert r["shared_ms"] > 0 and r["private_ms"] > 0
        assert r["speedup"] == pytest.approx(r["private_ms"] / r["shared_ms"])
        assert r["rule_shares"] == sharing_pays(r["holders"], r["node_tokens"], 2048)
        assert r["rule_right"] == (r["rule_shares"] == (r["speedup"] >= 1))
    assert (tmp_path / "cost_rule_tail16.png").read_bytes()[:8] == PNG
    # The rule itself: (h - 1) x (tokens - 16) against the threshold; 0 turns it off.
    assert sharing_pays(2, 2064, 2048) and not sharing_pays(2, 2063, 2048)
    assert sharing_pays(129, 32, 2048) and not sharing_pays(128, 32, 2048)
    assert sharing_pays(2, 1, 0)


def test_cost_rule_fit_recovers_a_known_rule():
    """fit_rule finds constants whose picks are all right when the grid follows a rule it can express."""
    from hydragen.bench.attention.cost_rule import fit_rule

    def faster_shared(h, t):
        return (h - 1) * (t - 32) >= 512

    rows = [
        dict(holders=h, node_tokens=t, shared_ms=1.0 if faster_shared(h, t) else 3.0,
             private_ms=2.0)
        for h in (2, 4, 8, 16, 64) for t in (16, 32, 64, 128, 256, 1024)
    ]  # fmt: skip
    merge, reads, lost = fit_rule(rows)
    assert lost == 0.0
    assert all(
        ((r["holders"] - 1) * (r["node_tokens"] - merge) >= reads)
        == faster_shared(r["holders"], r["node_tokens"])
        for r in rows
    )


def test_versus_tables_and_plot_from_saved_results(tmp_path):
    """bench versus: the tables and the plot come from the best of each tree's rounds."""
    from hydragen.bench.e2e import versus

    args = {"ns": [1, 4], "prompt_len": 64, "new_tokens": 4}

    def run(scale):
        r = {f"e2e/{s}/{n}": scale * n for s in versus.SAMPLINGS for n in args["ns"]}
        r |= {"prefill/uncached_one": 1.0, "prefill/cached_64": 1.5 * scale, "tree/step_s": scale}
        return r | {"tree/ops_per_step": 100 * scale, "tree/dispatch_share": 0.1 * scale}

    rounds = {"old": [run(2.0), run(3.0)], "new": [run(1.0), run(1.5)]}
    best = versus.best_of(rounds)
    assert best["old"]["tree/step_s"] == 2.0 and best["new"]["tree/dispatch_share"] == 0.1
    md = versus.tables({"rounds": rounds, "best": best}, args)
    assert "| default | 4 | 8.00 | 4.00 | 2.00x |" in md
    assert "| prefill cached_64 / uncached_one, new | 1.50 | |" in md
    path = versus.plots({"rounds": rounds, "best": best, "params": args}, tmp_path)[0]
    assert path.read_bytes()[:8] == PNG
    assert versus._is_compute("aten::addmm") and versus._is_compute("hydragen::step_attention")
    assert not versus._is_compute("aten::copy_")
