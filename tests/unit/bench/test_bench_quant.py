"""``hydragen bench quant --quick``: every part runs and writes its tables, JSON and plots (the numbers of a
quick run are noise; the full run's are in docs/quantization.md)."""

from __future__ import annotations

import json

import pytest

from hydragen.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="hydragen's C++ ops are unavailable")
PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_quant_quick(tmp_path, monkeypatch):
    from hydragen import cli
    from hydragen.bench.quant.decode import MODES

    monkeypatch.setenv("HYDRAGEN_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=320,
                max_position_embeddings=512,
            )
        )
    )
    out = tmp_path / "out"
    assert cli.main(["bench", "quant", "--quick", "--real-size", f"{config}:Q4_K_M", "--out", str(out)]) == 0
    data = json.loads((out / "quant.json").read_text())
    assert data["quick"] is True and data["commit"]
    ours = [r for r in data["kernels"] if r["kernel"] == "hydragen"]
    formats = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"}
    assert {r["format"] for r in ours} == formats
    int8 = {r["format"] for r in data["kernels"] if r["kernel"] == "hydragen, int8 activations"}
    assert int8 == {"Q4_1", "Q8_0", "Q4_K", "Q6_K"}
    assert all(r["GB/s"] > 0 and r["GFLOP/s"] > 0 for r in data["kernels"])
    models = [r["model"] for r in data["accuracy"] if r["reference"] == "float32 dequantized"]
    assert models[:3] == [
        "hydragen, 15-bit activations, float16 KV cache (default)",
        "hydragen, 15-bit activations, float32 KV cache",
        "hydragen, int8 activations, float16 KV cache",
    ]
    for r in data["accuracy"]:
        assert 0 <= r["top-1 agreement (all positions)"] <= 1 and r["KL mean (all positions)"] >= -1e-9
    engines = {r["mode"] for r in data["decode"]}
    assert set(MODES) - {"llamacpp"} <= engines
    assert all("vs llama.cpp, paired" in r for r in data["decode"])
    # the table says whether the peer ran (CI has no llama-cpp-python): its ratios are n/a otherwise
    ran = "llamacpp" in engines
    assert ("llamacpp" in data["runs"]["decode"]["params"]["engines"]) == ran
    assert ("llama.cpp did not run here" in (out / "quant-decode.md").read_text()) != ran
    # n completions of one prompt, and n distinct prompts of one completion each, for every engine
    points = {(r["mode"], r["n"], r["prompts"]) for r in data["decode"]}
    assert all({(n, k) for m, n, k in points if m == mode} == {(1, 1), (4, 1), (4, 4)} for mode in engines)
    assert [r["model"] for r in data["memory"]] == ["embedded SmolLM2-135M Q4_1", f"{config}:Q4_K_M"]
    assert all(r["file MB"] > 0 and r["runtime MB"] > 0 for r in data["memory"])
    for r in data["memory"]:  # the peak holds the packed weights at least, over hydragen imported
        assert r["peak during load MB"] - r["imported MB"] >= 0.9 * r["file MB"]
        assert r["peak / file"] == pytest.approx((r["peak during load MB"] - r["imported MB"]) / r["file MB"])
    assert {r["n"] for r in data["real"]} == {1, 16}
    for kind in ("kernels_bandwidth", "kernels_gflops", "decode", "real"):
        name = f"quant_{kind}.png"
        assert (out / name).read_bytes()[:8] == PNG
    assert "QUICK RUN" in (out / "quant.md").read_text()
    assert set(data["runs"]) == {"kernels", "accuracy", "decode", "memory", "real"}


def test_bench_quant_parts_run_alone_and_combine(tmp_path):
    """A part measured in its own run joins the results already in the folder; a quick run never mixes
    with a full one's."""
    from hydragen import cli

    out = tmp_path / "out"
    full = {"machine": "m", "commit": "c", "quick": False, "params": {}, "rows": [{"model": "x"}]}
    (out).mkdir()
    (out / "quant-kernels.json").write_text(json.dumps(full))
    (out / "quant-kernels.md").write_text("## full kernel table\n")
    assert cli.main(["bench", "quant", "--quick", "--parts", "memory", "--out", str(out)]) == 0
    data = json.loads((out / "quant.json").read_text())
    assert data["memory"][0]["model"] == "embedded SmolLM2-135M Q4_1" and set(data["runs"]) == {"memory"}
    (out / "quant-accuracy.json").write_text(json.dumps(full | {"quick": True}))
    (out / "quant-accuracy.md").write_text("## quick accuracy table\n")
    assert cli.main(["bench", "quant", "--quick", "--parts", "memory", "--out", str(out)]) == 0
    data = json.loads((out / "quant.json").read_text())
    assert set(data["runs"]) == {"memory", "accuracy"}
    md = (out / "quant.md").read_text()
    assert "quick accuracy table" in md and "full kernel table" not in md


def test_bench_quant_refuses_bad_parts(capsys):
    from hydragen import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "quant", "--parts", "kernels,speed"])
    assert "unknown part 'speed'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "quant", "--parts", "real"])
    assert "needs --real-size" in capsys.readouterr().err


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    """Round by round, so a phase that slows both engines of a round cancels, and one engine's outlier round
    counts once: here the two best rates give 100 / 120 = 0.83x, where two rounds of three say 1.05x."""
    from hydragen.bench.quant.decode import paired_ratio

    assert paired_ratio([100.0, 60.0, 62.0], [95.0, 57.0, 120.0]) == pytest.approx(60.0 / 57.0)
    assert paired_ratio([100.0, 60.0], [80.0, 60.0]) == pytest.approx((1.0 + 1.25) / 2)
    assert paired_ratio([100.0, 60.0], [0.0, 60.0]) == pytest.approx(1.0)  # a failed peer round is left out
    assert paired_ratio([100.0], []) != paired_ratio([100.0], [])  # NaN: no peer


def test_bench_quant_points_and_engines_are_checked(capsys):
    from hydragen import cli
    from hydragen.bench.quant.decode import _point
    from hydragen.bench.quant.suite import _engines, _points

    assert _points("1:512, 8:64") == ((1, 512), (8, 64))
    assert _points("8:512:distinct,1:64") == ((8, 512, True), (1, 64))
    assert _point((8, 512, True)) == (8, 512, True) and _point((1, 512, True)) == (1, 512, False)
    assert _engines("hydragen,llamacpp") == ("hydragen", "llamacpp")
    with pytest.raises(SystemExit):
        cli.main(["bench", "quant", "--parts", "decode", "--points", "1:512,8"])
    assert "'8' is not COMPLETIONS:PROMPT_TOKENS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "quant", "--parts", "decode", "--points", "8:512:shared"])
    assert "'8:512:shared' is not COMPLETIONS:PROMPT_TOKENS[:distinct]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "quant", "--parts", "decode", "--engines", "hydragen,vllm"])
    assert "unknown engine 'vllm'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mode", "act_bits", "kv_dtype"),
    [("hydragen", 15, "float16"), ("hydragen-kv32", 15, "float32"), ("hydragen-int8", 8, "float16")],
)
def test_each_engine_of_the_decode_table_runs_what_its_label_says(mode, act_bits, kv_dtype):
    import torch

    from hydragen.bench.quant.decode import MODE_LABELS, _engine
    from hydragen.model.linear import PackedProjection

    llm = _engine(None, mode, 256)
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedProjection)]
    assert packed and {m.act_bits for m in packed} == {act_bits}
    assert llm.engine.pool.k.dtype == getattr(torch, kv_dtype)
    assert mode in MODE_LABELS


def test_engines_that_would_not_fit_together_are_refused_before_loading(monkeypatch, tmp_path):
    """The decode and real parts keep every engine loaded for the alternating rounds: the real part's four
    engines of the 8B Q4_K_M file would need ~25 GiB with their KV caches. Engines whose weights and caches
    would not fit in 90 % of the available memory are refused before anything loads, naming --engines; a
    llama.cpp peer that cannot run is not counted; the real part takes --engines too."""
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.bench.quant import decode
    from hydragen.bench.quant import suite as bench

    def load(*args):
        raise RuntimeError("loading")

    monkeypatch.setattr(decode, "_engine", load)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(decode, "_available_bytes", lambda: 4 * 4096)  # room for three copies, not four
    monkeypatch.setattr(decode, "_gguf_sizes", lambda path: (1024, 0))  # no KV cache
    four = ("hydragen", "hydragen-kv32", "hydragen-int8", "hydragen-4k")
    with pytest.raises(SystemExit, match=r"4 engines of model.gguf .* pass fewer with --engines"):
        decode.decode_rows(model, [(1, 8)], 2, 1, four)
    monkeypatch.setattr(llamacpp_peer, "unavailable", lambda path, random: "not installed")
    with pytest.raises(RuntimeError, match="loading"):  # the peer is skipped: three engines fit
        decode.decode_rows(model, [(1, 8)], 2, 1, ("llamacpp", "hydragen", "hydragen-kv32", "hydragen-int8"))
    # two engines' weights fit, not with their caches: 12 + 64 KV tokens x 512 elements x 2 bytes each
    monkeypatch.setattr(decode, "_gguf_sizes", lambda path: (1024, 512))
    with pytest.raises(SystemExit, match="with their KV caches"):
        decode.decode_rows(model, [(1, 8)], 1, 1, ("hydragen", "hydragen-int8"))
    args = bench.argparse.Namespace(real_size="tiny:Q8_0", real_tokens=2, rounds=1, engines=("hydragen",),
                                    temperature=0.8, top_p=0.95, top_k=0, min_p=0.0)  # fmt: skip
    seen = []
    monkeypatch.setattr(bench, "_real_file", lambda spec: model)
    monkeypatch.setattr(bench, "decode_rows", lambda *a: seen.append(a[4]) or [])
    bench._real(args, quick=False)
    assert seen == [("hydragen",)]


@pytest.mark.parametrize(
    "flags, settings",
    [
        ([], {"temperature": 0.8, "top_p": 0.95}),  # the settings
        (
            ["--top-k", "40", "--min-p", "0.05"],
            {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05},
        ),
        (["--temperature", "0", "--top-p", "1"], {"temperature": 0.0}),  # greedy, both
    ],
)
def test_both_engines_of_the_decode_table_sample_alike(monkeypatch, tmp_path, flags, settings):
    """hydragen's runs and llama.cpp's sampler chain get the same settings from the command line: a peer
    picking greedily while hydragen samples would leave its sampling out of one side of the ratio."""
    from hydragen.bench.e2e import decode_throughput as e2e
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.bench.quant import decode
    from hydragen.bench.quant import suite as bench

    seen = {}

    class Loaded(Exception):
        pass

    def peer_process(name, make, *args, sampling=None, **kwargs):  # what the peer's process builds
        assert make is llamacpp_peer.Peer
        seen.update(peer=dict(sampling), hydragen=dict(e2e.ENGINE_SAMPLING))
        raise Loaded  # stop before any engine runs

    model = tmp_path / "model.gguf"
    model.write_bytes(b"\0")
    monkeypatch.setattr(e2e, "ENGINE_SAMPLING", dict(e2e.ENGINE_SAMPLING))  # put back afterwards
    monkeypatch.setattr(llamacpp_peer, "unavailable", lambda path, random: None)
    monkeypatch.setattr(decode, "PeerProcess", peer_process)
    monkeypatch.setattr(decode, "_check_memory", lambda *args: None)
    argv = ["--parts", "decode", "--model", str(model), "--engines", "llamacpp", "--out", str(tmp_path)]
    with pytest.raises(Loaded):
        bench.main(argv + flags)
    assert seen == {"peer": settings, "hydragen": settings}


@pytest.fixture
def segfaulting_llamacpp(monkeypatch):
    """llama.cpp as a peer that builds and then dies of SIGSEGV in its own process (as llama-cpp-python built
    with the AMX path does in llama_decode), after $CRASHING_PEER_CALLS calls; no llama.cpp needed."""
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.bench.quant import accuracy as quant_accuracy
    from tests.helpers.crashing_peer import SegfaultingPeer

    monkeypatch.setattr(llamacpp_peer, "unavailable", lambda path, random: None)
    monkeypatch.setattr(llamacpp_peer, "Peer", SegfaultingPeer)
    monkeypatch.setattr(quant_accuracy, "LlamaCppLogits", SegfaultingPeer)
    return monkeypatch


def test_a_llamacpp_crash_in_a_later_round_leaves_its_rounds_out(segfaulting_llamacpp):
    """The peer crashes in the second round, after a warm-up and a round that answered: the rounds go on for
    hydragen, llama.cpp has no row (nor a ratio), and the reason names the peer, the signal and where."""
    import math

    from hydragen.bench.quant.decode import decode_rows

    segfaulting_llamacpp.setenv("CRASHING_PEER_CALLS", "3")  # the warm-up, then t(1) and t(T) of round 1
    skipped: dict[str, str] = {}
    rows = decode_rows(None, [(1, 8)], 3, 2, ("llamacpp", "hydragen"), {"temperature": 0}, skipped)
    assert [r["mode"] for r in rows] == ["hydragen"] and math.isnan(rows[0]["vs llama.cpp"])
    assert skipped["llamacpp"].startswith("llama.cpp crashed (signal 11, SIGSEGV); its last output: ")
    assert "generate: about to crash" in skipped["llamacpp"]


def test_bench_quant_goes_on_when_llamacpp_crashes(segfaulting_llamacpp, tmp_path):
    """The decode part reports the crash in its table and finishes without llama.cpp's rows."""
    from hydragen import cli

    out = tmp_path / "out"
    argv = ["bench", "quant", "--quick", "--parts", "decode", "--engines", "hydragen,llamacpp"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert {r["mode"] for r in json.loads((out / "quant.json").read_text())["decode"]} == {"hydragen"}
    decode = (out / "quant-decode.md").read_text()
    assert "llama.cpp did not run here (llama.cpp crashed (signal 11, SIGSEGV); its last output: " in decode
    assert "generate: about to crash" in decode and "'vs llama.cpp' is n/a" in decode


def test_the_accuracy_part_goes_on_when_llamacpp_crashes(segfaulting_llamacpp):
    """The accuracy part always runs llama.cpp (--engines cannot keep it out): a crash gives no llama.cpp
    outputs and the reason, which its table's notes give."""
    from hydragen.bench.quant import accuracy as quant_accuracy
    from hydragen.bench.quant import suite as bench
    from hydragen.model.default_model import default_model_path

    said = []
    got, why = quant_accuracy.llamacpp_reference(default_model_path(), [[1, 2, 3]], 2, said.append)
    assert got is None and why.startswith("llama.cpp crashed (signal 11, SIGSEGV); its last output: ")
    assert "logits: about to crash" in why and said[-1].endswith("the rows against llama.cpp are left out")

    def run(model, count, tokens, progress, skipped):  # the part, its llama.cpp step as above
        skipped["llamacpp"] = why
        return []

    segfaulting_llamacpp.setattr(quant_accuracy, "run", run)
    _, _, notes = bench._accuracy(bench.argparse.Namespace(model=None, prompts=2), quick=True)
    assert f"llama.cpp did not run here ({why}): no rows against it." in notes


def test_the_memory_check_reads_the_models_shape_from_its_gguf():
    """Weight elements and the K/V elements a cached token stores come from the GGUF header: the embedded
    SmolLM2-135M has 30 layers of 3 KV heads of 64 dims and ~135M weights."""
    from hydragen.bench.quant.decode import _gguf_sizes
    from hydragen.model.default_model import default_model_path

    elements, per_token = _gguf_sizes(default_model_path())
    assert per_token == 2 * 30 * 3 * 64
    assert 130e6 < elements < 140e6


def test_the_decode_plots_name_the_sampling_they_ran_with():
    """A plot read alone says how both engines sampled; results from before the peer sampled say greedy."""
    from hydragen.bench.quant.plots import _plot_words

    assert _plot_words({"params": {}}) == "llama.cpp greedy"
    assert _plot_words({"params": {"sampling": {"temperature": 0.0}}}) == "both greedy"
    sampled = {"params": {"sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 40}}}
    assert _plot_words(sampled) == "both at temperature 0.8, top_p 0.95, top_k 40"


def test_the_decode_plots_x_label_names_the_points_it_shows():
    from hydragen.bench.quant.plots import _points_label

    rows = [
        {"n": n, "prompt": p, "prompts": k}
        for n, p, k in ((1, 512, 1), (8, 512, 1), (64, 2048, 1), (8, 512, 8))
    ]
    assert _points_label(rows) == "completions n of one prompt (n = 1, 8: 512 tokens; 64: 2,048 tokens)"
    assert _points_label([{"n": 4, "prompt": 64}]) == "completions n of one prompt (n = 4: 64 tokens)"
