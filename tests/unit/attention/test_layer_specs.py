"""Per-layer attention specs and per-layer-group page tables (``attention/layer_spec.py``,
``kv/layout.py``; docs/design.md, "The formats the next issues extend"): a model says how each layer
attends and which KV page group it is in; a table page comes with a page of every group; a step builds
one attention metadata per layer kind (group, spec), and each layer writes and reads its group's pages with
its spec's metadata and scale, on every path (per-op, the one-call layer stack, tensor parallelism's wire).

Groups are checked for real: the fake engine's model in several groups (every group's pages checked and
written like the table's, through sharing, forks, preemption and the prefix cache) and real models whose
layers are spread over groups giving the one-group model's tokens and log-probabilities bit for bit.

The scale is computed everywhere today, so it is checked for real: against transformers with each layer's
``scaling`` set (the per-op path) and bit for bit between the one-call layer stack and the per-op path. A
window, a soft-cap and sinks are the format only until the model-families and MoE issues put them into
the kernels: a model declaring one is refused by name, never run with full attention.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.attention.layer_spec import AttentionSpec, LayerSpecs, model_layer_specs
from hydragen.engine import model_runner
from hydragen.engine.model_runner import ModelRunner
from hydragen.engine.packing import pack
from hydragen.engine.step_plan import StepPlan, Work
from hydragen.errors import ConfigError
from hydragen.kv.layout import KVLayout, model_kv_layout
from hydragen.kv.pool import OutOfPages, PagePool
from hydragen.model.config import ModelConfig
from hydragen.tp import commands
from tests.helpers.fake_engine import expected_output, fake_engine, run
from tests.unit.model.test_quant_model import TINY

GREEDY = dict(temperature=0, ignore_eos=True)


def test_a_model_s_distinct_specs_in_order_of_first_use():
    a, b, c = AttentionSpec(0.125), AttentionSpec(0.25), AttentionSpec(0.125, soft_cap=30.0)
    specs = LayerSpecs.per_layer([a, b, a, c, b])
    assert specs.specs == (a, b, c) and specs.of_layer == (0, 1, 0, 2, 1) and len(specs) == 5
    assert a.mask_key == c.mask_key != AttentionSpec(0.125, window=8).mask_key
    plain = LayerSpecs.uniform(3, 64)
    assert plain.specs == (AttentionSpec(0.125),) and plain.of_layer == (0, 0, 0)


def test_bad_specs_are_named():
    for kwargs, match in [
        (dict(scale=0.0), "scale must be > 0"),
        (dict(scale=0.1, window=0), "window must be >= 1"),
        (dict(scale=0.1, soft_cap=-1.0), "soft-cap must be > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            AttentionSpec(**kwargs)
    with pytest.raises(ValueError, match="at least one layer"):
        LayerSpecs.per_layer([])
    cfg = SimpleNamespace(num_layers=3, head_dim=16, layer_specs=(AttentionSpec(0.25),) * 2)
    with pytest.raises(ValueError, match="declares 2 layer specs for 3 layers"):
        model_layer_specs(cfg)
    assert model_layer_specs(SimpleNamespace(num_layers=2, head_dim=16)) == LayerSpecs.uniform(2, 16)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (AttentionSpec(0.25, window=4), "layer 1 attends through a sliding window of 4 tokens"),
        (AttentionSpec(0.25, soft_cap=50.0), "layer 1 soft-caps its attention scores at 50.0"),
        (AttentionSpec(0.25, sinks=True), "layer 1 has attention sinks"),
    ],
)
def test_what_the_kernels_do_not_compute_yet_is_refused_by_name(spec, why):
    specs = LayerSpecs.per_layer([AttentionSpec(0.25), spec, AttentionSpec(0.25)])
    assert specs.unsupported() == why
    cfg = SimpleNamespace(num_layers=3, head_dim=16, layer_specs=specs_tuple(specs))
    with pytest.raises(ConfigError, match=f"cannot run exactly yet: {why}"):
        ModelRunner(None, cfg, None, "cpu")
    with pytest.raises(ValueError, match=why):
        pack(StepPlan(), 4, "cpu", specs)


def specs_tuple(specs: LayerSpecs) -> tuple[AttentionSpec, ...]:
    return tuple(specs.specs[i] for i in specs.of_layer)


def test_a_step_packs_one_metadata_per_distinct_spec():
    """Specs that see the same keys share one metadata object (built once); each layer finds its own."""
    seq = SimpleNamespace()
    plan = StepPlan(work=(Work(seq, (0, 1), 0, tuple(range(5)), 1),))
    a, b = AttentionSpec(0.5), AttentionSpec(0.25)
    specs = LayerSpecs.per_layer([a, b, b, a])
    batch, _ = pack(plan, 4, "cpu", specs)
    assert len(batch.metas) == 2 and batch.metas[0] is batch.metas[1] is batch.meta
    assert [batch.layer_meta(specs, i) for i in range(4)] == [batch.meta] * 4
    one, _ = pack(plan, 4, "cpu")
    assert len(one.metas) == 1 and one.meta.unit_list == batch.meta.unit_list


def test_the_tensor_parallel_wire_carries_every_distinct_metadata():
    """Rank 0 sends each distinct metadata once and which one each spec reads; the other ranks rebuild the
    same batch (distinct metadata stay distinct, shared ones shared)."""
    seq = SimpleNamespace()
    plan = StepPlan(work=(Work(seq, (0, 1, 2), 0, tuple(range(20)), 1), Work(seq, (3,), 0, (1, 2, 3), 1)))
    batch, _ = pack(plan, 8, "cpu", LayerSpecs.per_layer([AttentionSpec(0.5), AttentionSpec(0.25)]))
    other = pack(StepPlan(work=(Work(seq, (5,), 0, (4, 4, 4, 4), 1),)), 8, "cpu")[0].meta
    other = dataclasses.replace(other, num_tokens=batch.meta.num_tokens)  # a second mask, as a window gives
    for metas in [batch.metas, (batch.meta, other, batch.meta)]:
        sent = dataclasses.replace(batch, metas=metas)
        got = commands.unpack_step(commands.pack_step(sent), torch.device("cpu"))
        assert len(got.metas) == len(metas)
        for i, m in enumerate(metas):
            assert got.metas[i].unit_list == m.unit_list and got.metas[i].segment_list == m.segment_list
            assert torch.equal(got.metas[i].pieces, m.pieces) and got.metas[i].num_parts == m.num_parts
            for j in range(i):
                assert (got.metas[i] is got.metas[j]) == (metas[i] is metas[j])
        assert torch.equal(got.slots, batch.slots) and got.num_prefill_tokens == batch.num_prefill_tokens


def test_every_layer_reads_its_spec_s_metadata_through_the_fake_engine():
    """Three layers, two specs: every step (shared runs, prefill chunks, decodes, forks) is packed with the
    specs and each layer's metadata is checked to read exactly its tokens' contexts."""
    specs = [AttentionSpec(0.5), AttentionSpec(0.25), AttentionSpec(0.5)]
    engine = fake_engine(64, 4, layer_specs=specs, prefill_chunk=8)
    assert engine.runner.specs.of_layer == (0, 1, 0)
    prompts = [list(range(1, 19)), list(range(1, 15)) + [40, 41], [7, 3, 9]]
    reqs = [engine.add_request(p, SamplingParams(n=2, max_tokens=10, **GREEDY)) for p in prompts]
    run(engine)
    assert not engine.runner.violations and engine.runner.forwards > 3
    for prompt, req in zip(prompts, reqs, strict=True):
        want = expected_output(prompt, {}, 10, True)
        assert [s.generated for s in req.seqs] == [want, want]
    engine.kv.check([])


QUANT_TINY = {**TINY, "num_hidden_layers": 3}  # the quantized-model tests' tiny Llama, one layer more


def declare(monkeypatch, scales: list[float] | None = None, groups: tuple[int, ...] = ()) -> None:
    """Models loaded from now on declare one spec per layer with these scales, in these KV groups (as a
    model family's module will)."""
    real = ModelConfig.from_hf.__func__

    def from_hf(cls, hf):
        cfg = real(cls, hf)
        specs = tuple(AttentionSpec(x) for x in scales) if scales else ()
        return dataclasses.replace(cfg, layer_specs=specs, kv_groups=groups)

    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(from_hf))


def test_per_layer_scales_match_transformers(tiny_models, monkeypatch):
    """The per-op path (a float model) with a different scale in each layer gives transformers' greedy
    tokens and log-probabilities with each attention module's ``scaling`` set the same way."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hd = hf.config.hidden_size // hf.config.num_attention_heads
    scales = [hd**-0.5 * 2.5, hd**-0.5 * 0.3]
    for layer, s in zip(hf.model.layers, scales, strict=True):
        layer.self_attn.scaling = s
    prompts = [[5, 9, 2, 7, 7, 3, 8], list(range(10, 40))]
    want_tokens, want_lp = [], []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        tokens = out.sequences[0, len(p) :].tolist()
        want_tokens.append(tokens)
        want_lp.append(
            [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]
        )
    got = {}
    for name, layer_scales in [("declared", scales), ("plain", [hd**-0.5] * 2)]:
        declare(monkeypatch, layer_scales)
        llm = LLM(path, kv_cache_tokens=512)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, logprobs=0, **GREEDY), use_tqdm=False)
        got[name] = []
        for o in outs:
            c = o.outputs[0]
            got[name].append((c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))
    for (tokens, lps), want_t, want_l in zip(got["declared"], want_tokens, want_lp, strict=True):
        assert tokens == want_t
        assert max(abs(a - b) for a, b in zip(lps, want_l, strict=True)) < 1e-4
    # The scales matter: the same model with the default scale gives other log-probabilities.
    assert any(
        max(abs(a - b) for a, b in zip(d[1], p[1], strict=True)) > 1e-2
        for d, p in zip(got["declared"], got["plain"], strict=True)
    )


def test_the_one_call_layer_stack_takes_a_metadata_and_scale_per_layer(tmp_path, monkeypatch):
    """A quantized model runs every layer in one C++ call: with a scale per layer, and with the step's
    metadata given as distinct objects per spec (as a window will give), its tokens and log-probabilities
    equal the per-op path's bit for bit, and differ from the model's with its default scale."""
    monkeypatch.setenv("HYDRAGEN_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QUANT_TINY))
    real_pack = model_runner.pack

    def distinct_pack(plan, page_size, device, specs=None, group_pages=None):  # a metadata object per spec
        batch, starts = real_pack(plan, page_size, device, specs, group_pages)
        return dataclasses.replace(batch, metas=tuple(dataclasses.replace(m) for m in batch.metas)), starts

    stacked = []
    real_stack = model_runner.stack_layers
    monkeypatch.setattr(model_runner, "stack_layers", lambda *a: stacked.append(a[4]) or real_stack(*a))
    shared = list(range(5, 60))
    prompts = [shared + [61, 62], shared + [70], [9, 8, 7]]
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.95, seed=3, max_tokens=8, ignore_eos=True, logprobs=2
    )
    hd = QUANT_TINY["head_dim"]
    got = {}
    for name, scales, fused, packer in [
        ("fused", [hd**-0.5 * 3, hd**-0.5 * 0.5, hd**-0.5 * 3], "1", distinct_pack),
        ("per-op", [hd**-0.5 * 3, hd**-0.5 * 0.5, hd**-0.5 * 3], "0", distinct_pack),
        ("plain", [hd**-0.5] * 3, "1", real_pack),
    ]:
        declare(monkeypatch, scales)
        monkeypatch.setattr(model_runner, "pack", packer)
        monkeypatch.setenv("HYDRAGEN_FUSED_LAYERS", fused)
        llm = LLM(f"{config}:Q8_0", random_weights=True, kv_cache_tokens=1024)
        stacked.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[name] = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
        if fused == "1" and packer is distinct_pack:  # the op really got two metadata objects a step
            assert stacked and all(len(m) == 2 and m[0] is not m[1] for m in stacked)
    assert got["fused"] == got["per-op"]
    assert got["fused"] != got["plain"]


# ---- per-layer-group page tables -------------------------------------------------------------------------


def test_a_layout_numbers_its_groups_and_rows():
    layout = KVLayout((0, 1, 1, 0, 1))
    assert layout.groups == 2 and layout.rows == 3 and layout.row_of_layer == (0, 0, 1, 1, 2)
    assert KVLayout.single(4).row_of_layer == (0, 1, 2, 3) and KVLayout.single(4).rows == 4
    assert KVLayout((1, 0)).groups == 2  # any numbering with a layer in each group
    for bad in [(), (0, 2), (-1, 0)]:
        with pytest.raises(ValueError):
            KVLayout(bad)
    windowed = KVLayout((1, 0, 1), (None, 8))
    assert windowed.released == {1: 8}
    assert KVLayout((0, 1), (8, None)).released == {}  # group 0 slides: its pages are the tables'
    with pytest.raises(ValueError, match="2 group windows for 3"):
        KVLayout((0, 1, 2), (None, 4))
    with pytest.raises(ValueError, match="KV groups for 2 of 3 layers"):
        model_kv_layout(SimpleNamespace(num_layers=3, kv_groups=(0, 1)))
    specs = model_layer_specs(SimpleNamespace(num_layers=3, head_dim=16, kv_groups=(0, 1, 0)))
    assert specs.groups == (0, 1) and specs.of_layer == (0, 1, 0) and specs.specs[0] == specs.specs[1]


def test_a_table_page_comes_with_a_page_of_every_group():
    """The pool takes and frees a page of each group with each table page, from one allocator: its counts
    are in table pages, its tensors have a row per layer of the largest group, copies reach every group."""
    pool = PagePool(3, 6, 2, 1, 1, torch.float32, "cpu", KVLayout((0, 1, 0)))
    assert pool.k.shape == (2, 6 * 2 * 2, 1, 1) and pool.free_pages == 6 and pool.num_pages == 6
    a = pool.take(2)
    b = pool.take(3)
    assert pool.free_pages == 1 and pool.used_pages == 5
    every = a + b + list(pool.in_group(a, 1)) + list(pool.in_group(b, 1))
    assert len(set(every)) == 10 and all(0 <= p < 12 for p in every)
    with pytest.raises(OutOfPages):
        pool.take(2)
    pool.k[:, :] = torch.arange(24.0).view(1, 24, 1, 1) + torch.tensor([0.0, 100.0]).view(2, 1, 1, 1)
    src, dst = a[0] * 2 + 1, b[2] * 2  # a slot of table page a[0] into one of b[2]: in both groups
    pool.copy_slots(torch.tensor([dst]), torch.tensor([src]))
    for g in (0, 1):
        s_src = pool.in_group([a[0]], g)[0] * 2 + 1
        s_dst = pool.in_group([b[2]], g)[0] * 2
        assert torch.equal(pool.k[:, s_dst], pool.k[:, s_src])
    pool.release(a)
    pool.free(a)
    assert pool.free_pages == 3 and pool.in_group(a, 1) == (-1, -1)
    assert pool.take(3) and pool.free_pages == 0


@pytest.mark.parametrize("groups", [(0, 1), (0, 1, 1, 0)])
def test_every_group_s_pages_hold_the_context_through_the_fake_engine(groups):
    """A model in several KV groups: every forward checks each group's pages hold each item's context and
    each layer's metadata reads it there; with the prefix cache across waves, shared prefixes, forks and a
    pool small enough to preempt, outputs are the fake model's and no page of any group leaks."""
    specs = [AttentionSpec(0.5), AttentionSpec(0.25), AttentionSpec(0.5), AttentionSpec(0.5)][: len(groups)]
    engine = fake_engine(14, 4, layer_specs=specs, kv_groups=groups, prefill_chunk=8, max_wait_steps=4)
    assert engine.pool.groups == 2 and engine.kv.capacity == 14
    prompts = [list(range(1, 19)), list(range(1, 15)) + [40, 41], [7, 3, 9]]
    for _wave in range(2):  # the second wave meets the first's pages in the prefix cache
        reqs = [engine.add_request(p, SamplingParams(n=2, max_tokens=10, **GREEDY)) for p in prompts]
        run(engine)
        assert not engine.runner.violations
        for prompt, req in zip(prompts, reqs, strict=True):
            want = expected_output(prompt, {}, 10, True)
            assert [s.generated for s in req.seqs] == [want, want]
        engine.kv.check([])
    assert engine.stats.preemptions > 0 and engine.stats.cache_hit_tokens > 0


def test_layers_in_several_groups_give_the_one_group_model_s_outputs(tiny_models, monkeypatch):
    """The tiny llama with its two layers in two KV groups (the per-op path): with a shared prefix, forks,
    a second wave from the prefix cache and a pool that preempts, every token and log-probability equals
    the one-group model's on the C++ step attention, and every token (log-probabilities within 1e-5: its
    sums follow the slot runs, which split where the pages do) on the torch twin."""
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.95, seed=5, max_tokens=10, ignore_eos=True, logprobs=2
    )
    shared = list(range(5, 50))
    prompts = [shared + [61, 62], shared + [70], [9, 8, 7]]
    got = {}
    for attention in ("auto", "torch"):
        for groups in [(), (0, 1)]:
            declare(monkeypatch, groups=groups)
            llm = LLM(tiny_models["llama"], kv_cache_tokens=104, page_size=8, attention=attention)
            assert llm.engine.pool.groups == (2 if groups else 1)
            outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
            got[attention, groups] = [(c.token_ids, c.logprobs) for w in outs for o in w for c in o.outputs]
            assert llm.engine.stats.preemptions > 0
        one, two = got[attention, ()], got[attention, (0, 1)]
        if attention == "auto":  # the C++ op: bit for bit
            assert one == two
        else:  # the torch twin sums a token's keys by slot run, and runs split where pages do: tokens equal
            assert [t for t, _ in one] == [t for t, _ in two]
            gaps = [
                abs(x[t] - y[t])
                for (_, a), (_, b) in zip(one, two, strict=True)
                for x, y in zip(a, b, strict=True)
                for t in x
            ]
            assert max(gaps) < 1e-5


def test_the_one_call_layer_stack_writes_and_reads_each_group_s_pages(tmp_path, monkeypatch):
    """A quantized model's three layers in two groups (rows 0, 0, 1): the one C++ call writes each layer's
    K/V in its group's pages and row, and gives the one-group model's tokens and log-probabilities."""
    monkeypatch.setenv("HYDRAGEN_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QUANT_TINY))
    shared = list(range(5, 60))
    prompts = [shared + [61, 62], shared + [70], [9, 8, 7]]
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.95, seed=3, max_tokens=8, ignore_eos=True, logprobs=2
    )
    stacked = []
    real_stack = model_runner.stack_layers
    monkeypatch.setattr(model_runner, "stack_layers", lambda *a: stacked.append(a[3]) or real_stack(*a))
    got = {}
    for groups in [(), (0, 1, 0)]:
        declare(monkeypatch, groups=groups)
        llm = LLM(f"{config}:Q8_0", random_weights=True, kv_cache_tokens=1024)
        stacked.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[groups] = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
        assert stacked and all(len(slots) == (2 if groups else 1) for slots in stacked)
        assert llm.engine.pool.k.shape[0] == (2 if groups else 3)
    assert got[()] == got[(0, 1, 0)]


def test_the_tensor_parallel_wire_carries_every_group_s_slots():
    seq = SimpleNamespace()
    plan = StepPlan(work=(Work(seq, (0, 1), 0, tuple(range(12)), 1),))
    specs = LayerSpecs.per_layer([AttentionSpec(0.5)] * 2, [0, 1])
    batch, _ = pack(plan, 8, "cpu", specs, lambda pages, g: tuple(p + 10 * g for p in pages))
    assert batch.group_slots[0].tolist() == [s + 80 for s in batch.slots.tolist()]
    assert batch.metas[0] is not batch.metas[1]
    got = commands.unpack_step(commands.pack_step(batch), torch.device("cpu"))
    assert torch.equal(got.group_slots[0], batch.group_slots[0])
    assert got.metas[1].segment_list == batch.metas[1].segment_list != got.metas[0].segment_list
