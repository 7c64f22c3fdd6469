"""The embedded SmolLM2-135M-Instruct GGUF: same greedy tokens as transformers (dequantized to float32),
chat, sampling, stops, and what sharing and batching change (float32, and quantized as users run it).

The CLI on this model is tested in test_cli.py and test_chat_tty.py; the quantized model's agreement with
the float32 one is measured by `hydragen bench quant` (docs/quantization.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hydragen import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


def test_greedy_matches_transformers_on_gguf(embedded_llm_fp32, hf_gguf_model):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    outs = embedded_llm_fp32.chat(convs, params, use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        # An explicit mask: the prompt contains <|im_end|> (id 2), which is also this GGUF's pad token,
        # and generate() would otherwise mask those prompt tokens out as padding.
        ref = hf_gguf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
        ref = ref[0, ids.shape[1] :].tolist()
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert "Paris" in outs[0].outputs[0].text


def test_chat_stops_at_eos_and_shares_system_prompt(embedded_llm):
    convs = [[{"role": "user", "content": q}] for q in ("Name three primary colors.", "Name a large ocean.")]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    outs = embedded_llm.chat(convs[:1], greedy, use_tqdm=False)
    before = embedded_llm.engine.stats.cache_hit_tokens
    outs += embedded_llm.chat(convs[1:], greedy, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.text and "<|im_end|>" not in c.text
        assert c.token_ids[-1] in embedded_llm.tokenizer.eos_token_ids
    # Both conversations start with the template's default system prompt: the second finds it cached.
    assert embedded_llm.engine.stats.cache_hit_tokens > before


def test_seeded_sampling_is_reproducible(embedded_llm):
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, max_tokens=16, seed=11)
    a = embedded_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = embedded_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({c.text for c in a.outputs}) > 1


def test_stop_string_is_cut_from_text(embedded_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = embedded_llm.generate("The alphabet goes: A, B, C,", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text.strip().split()[2]
    out = embedded_llm.generate(
        "The alphabet goes: A, B, C,",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_prompt_longer_than_context_is_rejected(embedded_llm):
    with pytest.raises(ValueError, match="context"):
        embedded_llm.generate([[5] * 9000], SamplingParams())


def test_every_completion_has_its_text_when_samples_finish_together(embedded_llm):
    """Regression: samples finishing in the same step as the request's last one must still get text."""
    params = SamplingParams(n=8, temperature=0.7, top_p=0.95, max_tokens=24, seed=1)
    out = embedded_llm.chat(
        [{"role": "user", "content": "Write a haiku about sharing."}], params, use_tqdm=False
    )
    for c in out[0].outputs:
        expected = embedded_llm.tokenizer.decode(
            c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        )
        assert c.text == expected and c.text


@pytest.mark.parametrize(
    ("llm", "tokens", "drift"),
    [
        ("embedded_llm_fp32", 1.0, 1e-4),
        # The kernels round activations to 15-bit integers per 32 values: a 1e-6 difference from attention
        # (batch, sharing) can move one value across a rounding step of max|x| / 16191. Measured on 48
        # prompts (this test's modes): every token identical, worst log-probability drift 0.0068. The
        # model as users run it (a float16 KV cache: its rounding is the same whatever the batch) and with
        # a float32 cache.
        ("embedded_llm", 1.0, 0.02),
        ("embedded_llm_kv32", 1.0, 0.02),
    ],
)
def test_logprobs_agree_with_sharing_on_and_off_alone_batched_and_warm(request, llm, tokens, drift):
    """The logit-level check tiny peaky models cannot make: on the real model, sharing, batching and a
    warm cache change only rounding. Measured drift in float32 is ~1e-5 in log-probability (`hydragen bench
    exactness`); a wrong merge, mask or position shows up as 1e-2 or more in float32, and as many
    changed tokens in the quantized model."""
    from hydragen.bench.e2e.sharing_exactness import compare, make_prompts, run_mode
    from hydragen.engine.engine import EngineCore

    llm = request.getfixturevalue(llm)
    prompts = make_prompts(6, seed=0)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    off = copy.copy(llm)  # the same weights, an engine with sharing off
    e = llm.engine
    kv_dtype = str(e.pool.k.dtype).removeprefix("torch.")
    config = e.config.replace(prefix_sharing=False, kv_cache_tokens=8192, kv_cache_dtype=kv_dtype)
    off.engine = EngineCore(e.model, e.cfg, e.tokenizer, config)
    reference = run_mode(off, prompts, "off-alone", params)
    runs = {
        "off-batched": run_mode(off, prompts, "off-batched", params),
        "on-batched": run_mode(llm, prompts, "on-batched", params),
        "on-warm": run_mode(llm, prompts, "on-warm", params),
    }
    assert llm.engine.stats.cache_hit_tokens > 0  # the shared path really ran
    for mode, got in runs.items():
        identical, worst = compare(got, reference)
        assert identical >= tokens, mode
        assert worst < drift, (mode, worst)
    # the comparison really compared something: every position carries the chosen token and its top 5
    assert all(len(lp) >= 5 for _, lps in reference for lp in lps)
