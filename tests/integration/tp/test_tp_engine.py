"""Tensor parallelism end to end on CPU (gloo, spawned worker processes): the same greedy tokens as TP = 1,
logits within 1e-5, prefix-cache hits and sharing off under TP, a killed worker turning into errors (also
one that dies as the group forms), and no worker left behind after close, exit or Ctrl-C."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.tp import launcher
from hydragen.tp.group import CollectiveError
from tests.helpers.paths import SRC
from tests.helpers.server_helpers import all_gone, process_alive
from tests.helpers.tp_faults import worker_environment

STEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
PROMPTS = [STEM + [30, 31, 32], STEM + [40, 41], STEM, [7, 8, 9, 60, 61]]
GREEDY = SamplingParams(n=2, temperature=0, max_tokens=8)
TP_TIMEOUT = 600  # seconds: the collective timeout the dead-worker tests run under


def _recording(llm: LLM) -> list[torch.Tensor]:
    """Every logits matrix the engine samples from, in order."""
    seen: list[torch.Tensor] = []
    runner = llm.engine.runner
    sample = runner.sample

    def record(logits, seqs, top=None):
        seen.append(logits.clone())
        return sample(logits, seqs, top)

    runner.sample = record
    return seen


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def llama_pair(tiny_models):
    """(TP = 1, TP = 2) engines on the tiny Llama (4 heads, 2 KV heads: one per rank)."""
    one = LLM(tiny_models["llama"], kv_cache_tokens=4096)
    two = LLM(tiny_models["llama"], kv_cache_tokens=4096, tensor_parallel_size=2)
    yield one, two
    two.close()


def assert_same_tokens_and_logits(one: LLM, two: LLM) -> None:
    """``two`` generates ``one``'s greedy tokens, from float32 logits within 1e-5 at every step."""
    logits_one, logits_two = _recording(one), _recording(two)
    want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = two.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert len(logits_two) == len(logits_one) > 1
    for a, b in zip(logits_one, logits_two, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max().item() < 1e-5


def test_tp2_matches_tp1_tokens_and_logits(llama_pair) -> None:
    assert_same_tokens_and_logits(*llama_pair)


def test_every_rank_keeps_a_float16_cache_when_asked(tiny_models) -> None:
    """kv_cache_dtype reaches the workers' pools: rank 1's heads are rounded as rank 0's, so the logits
    equal a single process's with the same cache (a float32 pool on one rank would differ by ~1e-3)."""
    options = dict(kv_cache_tokens=4096, kv_cache_dtype="float16")
    one = LLM(tiny_models["llama"], **options)
    with LLM(tiny_models["llama"], tensor_parallel_size=2, **options) as two:
        assert two.engine.pool.k.dtype == torch.float16
        assert_same_tokens_and_logits(one, two)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_tp2_matches_tp1_on_gemma(tmp_path, name) -> None:
    """Gemma under TP = 2 (4 heads, 2 KV heads: 2 and 1 per rank): sandwich norms after the all-reduce,
    replicated (1 + w) and QK norms, soft-caps and 8-token windows on prompts several windows long, each
    layer's KV group on every rank; Gemma 3 also from a GGUF kept quantized (Q8_0 blocks split by rank)."""
    from tests.conftest import TINY, save_tiny
    from tests.unit.engine.test_engine_tiny import LONG_PROMPTS

    path = save_tiny({**TINY[name], "sliding_window": 8}, tmp_path / name)
    models = [path]
    if name == "gemma3":
        from tests.unit.model.test_gemma import Q, gguf_spec, write_gemma_gguf

        hf_dir = tmp_path / "gguf-source"
        save_tiny(gguf_spec(name), hf_dir)
        q8 = {n: Q.Q8_0 for n in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight")}
        q8 |= {"model.layers.2.self_attn.o_proj.weight": Q.Q8_0}
        write_gemma_gguf(hf_dir, tmp_path / "gemma3-q8.gguf", q8)
        models.append(str(tmp_path / "gemma3-q8.gguf"))
    for model in models:
        one = LLM(model, kv_cache_tokens=4096, page_size=4)
        with LLM(model, kv_cache_tokens=4096, page_size=4, tensor_parallel_size=2) as two:
            logits_one, logits_two = _recording(one), _recording(two)
            params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
            want = one.generate(LONG_PROMPTS, params, use_tqdm=False)
            got = two.generate(LONG_PROMPTS, params, use_tqdm=False)
            assert _tokens(got) == _tokens(want), model
            assert len(logits_two) == len(logits_one) > 1
            # float weights: 1e-5 as every TP check; blocks: each rank quantizes the activations of its own
            # columns of o and down (15 bits, its own scale), ~1e-4 apart
            tolerance = 5e-4 if model.endswith(".gguf") else 1e-5
            for a, b in zip(logits_one, logits_two, strict=True):
                assert (a - b).abs().max().item() < tolerance, model


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_tp2_matches_tp1_on_qwen_from_a_quantized_gguf(tiny_models, tmp_path, name) -> None:
    """Qwen2's q/k/v biases and Qwen3's QK-norm under TP = 2 on a GGUF kept quantized: each rank's q/k/v
    epilogue (its share of the bias, its own heads normalised and rotated) gives one process's tokens."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from hydragen.model.config import ModelConfig
    from hydragen.model.gguf_write import checkpoint_maker, write_gguf

    src = Path(tiny_models[name])
    cfg = ModelConfig.from_hf(json.loads((src / "config.json").read_text()))
    sd = load_file(src / "model.safetensors")
    path = str(write_gguf(tmp_path / f"{name}.gguf", cfg, "Q8_0", checkpoint_maker(sd, cfg)))
    one = LLM(path, kv_cache_tokens=2048)
    with LLM(path, kv_cache_tokens=2048, tensor_parallel_size=2) as two:
        want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _tokens(got) == _tokens(want)


def test_prefix_cache_hits_across_requests_under_tp(llama_pair) -> None:
    one, two = llama_pair
    prompt = STEM + [50, 51, 52, 53]
    first = two.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = two.generate([prompt + [54]], GREEDY, use_tqdm=False)[0]
    page = two.engine.pool.page_size
    # the stem's whole pages are served from the cache every rank holds its heads of (pages cache whole)
    assert again.cached_prompt_tokens == len(STEM) // page * page > 0
    want = one.generate([prompt, prompt + [54]], GREEDY, use_tqdm=False)
    assert _tokens([first, again]) == _tokens(want)
    seeded = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_tokens=6, seed=7)
    assert _tokens(two.generate([prompt], seeded, use_tqdm=False)) == _tokens(
        one.generate([prompt], seeded, use_tqdm=False)
    )


def test_memory_pressure_under_tp_gives_unpressured_tokens(tiny_models) -> None:
    """Two ranks, a small pool and two dozen mixed prompts at once: preemption, eviction and chunked
    prefill all happen, and every request finishes with the tokens of an unpressured single-process run
    (a plan that pointed at evicted pages used to fail a worker, and then every request)."""
    import random

    rng = random.Random(5)
    stems = [[rng.randrange(20, 250) for _ in range(60)] for _ in range(3)]
    prompts = [
        rng.choice(stems)[: rng.randrange(1, 60)]
        + [rng.randrange(20, 250) for _ in range(rng.randrange(1, 30))]
        for _ in range(24)
    ]
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(tiny_models["qwen2"], kv_cache_tokens=65536).generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["qwen2"], kv_cache_tokens=16 * 10, tensor_parallel_size=2) as llm:
        llm.engine.scheduler.prefill_chunk = llm.engine.scheduler.prefill_budget = 32
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats.preemptions > 0
    assert _tokens(got) == _tokens(want)


def test_workers_are_gone_and_the_model_freed_after_close(tiny_models) -> None:
    """close() stops the workers and lets rank 0's shard go at once (a server rebuilding a broken group
    frees the old one before loading the new one: nothing may hold it)."""
    llm = LLM(tiny_models["mistral"], kv_cache_tokens=2048, tensor_parallel_size=2, prefix_sharing=False)
    pids = [p.pid for p in llm.parallel.procs]
    ref = LLM(tiny_models["mistral"], kv_cache_tokens=2048, prefix_sharing=False)
    # Sharing off: each sequence copies the prompt's KV into its own pages, on every rank.
    assert _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == _tokens(
        ref.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    )
    llm.close()
    assert not any(process_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match=r"group is down: the LLM was closed\. .*create a new LLM"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    model = weakref.ref(llm.model)
    del llm
    gc.collect()
    assert model() is None


def test_killed_worker_is_an_error_for_every_request_not_a_hang(tiny_models, monkeypatch) -> None:
    """The dead worker is seen, not waited out: each request fails within a quarter of the collective
    timeout (a hang would last all of it), naming the worker and its signal, and saying that this LLM is
    done (nothing rebuilds its group in place)."""
    monkeypatch.setenv("HYDRAGEN_TP_TIMEOUT", str(TP_TIMEOUT))
    llm = LLM(tiny_models["qwen2"], kv_cache_tokens=2048, tensor_parallel_size=2)
    ref = LLM(tiny_models["qwen2"], kv_cache_tokens=2048)
    # Qwen2: q/k/v biases, tied embeddings, 6 heads and 2 KV heads (3 and 1 per rank).
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(
        ref.generate(PROMPTS, GREEDY, use_tqdm=False)
    )
    (worker,) = llm.parallel.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    start = time.monotonic()
    done = r"worker rank 1 \(pid \d+\) was killed by SIGKILL\. This LLM cannot .* create a new LLM"
    for _ in range(2):
        with pytest.raises(RuntimeError, match=done):
            llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < TP_TIMEOUT / 4
    llm.close()


def test_a_worker_that_dies_as_the_group_forms_is_named_not_the_handshake_it_broke(
    tiny_models, monkeypatch, tmp_path
) -> None:
    """gloo's handshake is not symmetric: a worker can be done joining while rank 0 still reads its side of
    it, and a worker that dies then (killed as it loads its shard, as running out of memory does) fails
    rank 0's join. Here rank 0's join always ends that way: it fails once the worker's sockets are closed.
    The error names the worker and its signal, as for a worker that dies at any other point of its start,
    and the dead worker is reaped."""
    monkeypatch.setenv("HYDRAGEN_TP_TIMEOUT", str(TP_TIMEOUT))
    doomed = tmp_path / "workers-die-at-load"
    doomed.touch()
    kill = {"at": "load", "ranks": [1], "action": "kill", "while_exists": str(doomed)}
    worker_environment(monkeypatch, [kill])
    real_join = launcher.join_group

    def join_that_the_dying_worker_breaks(rank, world, init_method, device):
        group = real_join(rank, world, init_method, device)
        with pytest.raises(CollectiveError):  # returns once the worker (loading, then killed) is gone
            group.all_reduce(torch.zeros(1))
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer")

    monkeypatch.setattr(launcher, "join_group", join_that_the_dying_worker_breaks)
    died = r"^tensor-parallel worker rank 1 \(pid (\d+)\) was killed by SIGKILL while starting$"
    with pytest.raises(RuntimeError, match=died) as failed:
        LLM(tiny_models["llama"], kv_cache_tokens=2048, tensor_parallel_size=2)
    assert "Connection closed by peer" in str(failed.value.__cause__)
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(int(re.match(died, str(failed.value)).group(1)), os.WNOHANG)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "world"), [("llama", 4), ("llama3_mqa", 2), ("llama3_mqa", 4), ("mistral", 4)]
)
def test_more_ranks_and_replicated_kv_heads_match_tp1(tiny_models, name, world) -> None:
    """4 ranks over 2 KV heads (each replicated twice), MQA (one KV head on every rank), 4 ranks over 4."""
    one = LLM(tiny_models[name], kv_cache_tokens=4096)
    with LLM(tiny_models[name], kv_cache_tokens=4096, tensor_parallel_size=world) as split:
        logits_one, logits_split = _recording(one), _recording(split)
        assert _tokens(split.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(
            one.generate(PROMPTS, GREEDY, use_tqdm=False)
        )
    for a, b in zip(logits_one, logits_split, strict=True):
        assert (a - b).abs().max().item() < 1e-5


_SCRIPT = """
import sys, time
from hydragen import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_tokens=2048, tensor_parallel_size=2)
print(" ".join(str(p.pid) for p in llm.parallel.procs), flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
print("generating", flush=True)
while True:
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["exit", "ctrl-c", "sigkill"])
def test_no_worker_outlives_its_program(tiny_models, how) -> None:
    """A program that exits without close(), is stopped with Ctrl-C mid-generation, or is SIGKILLed
    mid-generation (what running out of memory is on a CPU) takes its workers with it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, tiny_models["llama"], how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1, proc.stderr.read()
        if how != "exit":
            assert proc.stdout.readline().strip() == "generating"
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert all_gone(pids, timeout=10)
