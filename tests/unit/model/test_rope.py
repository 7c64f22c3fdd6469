"""RoPE: tables looked up once per forward, rotation bit-identical to the plain rotate-half formula."""

from __future__ import annotations

import pytest
import torch

from hydragen.model.rope import Rotary, apply_rotary, inverse_frequencies


def rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The textbook formula, with the negation on x as transformers writes it."""
    freqs = torch.outer(torch.arange(int(positions.max()) + 1, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos()[positions].unsqueeze(1).to(x.dtype)
    sin = emb.sin()[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA3])
def test_rotation_is_bit_identical_to_the_formula(dtype, scaling):
    gen = torch.Generator().manual_seed(0)
    head_dim, theta = 20, 10000.0
    rotary = Rotary(head_dim, theta, scaling, 600, "cpu")
    positions = torch.randint(0, 600, (37,), generator=gen)
    x = torch.randn(37, 3, head_dim, generator=gen).to(dtype)
    cos, sin = rotary.tables(positions, dtype)
    expected = rotate_half_reference(x, positions, inverse_frequencies(head_dim, theta, scaling))
    assert torch.equal(apply_rotary(x, cos, sin), expected)


def test_forward_looks_tables_up_once(tiny_models, monkeypatch):
    from hydragen.model.loader import load_model

    net, cfg, _ = load_model(tiny_models["llama3_mqa"], torch.device("cpu"), torch.float32)
    assert cfg.num_layers > 1
    calls = []
    original = Rotary.tables
    monkeypatch.setattr(Rotary, "tables", lambda self, *a: calls.append(1) or original(self, *a))

    def attend(layer, q, k, v):
        return q

    net(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), attend)
    assert len(calls) == 1


YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # Qwen3's long-context form
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "truncate": False,
    },
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48, "attention_factor": 1.3},
]


@pytest.mark.parametrize("scaling", YARN)
def test_yarn_matches_transformers(scaling):
    """Frequencies and the cos/sin factor as transformers computes them, for each way a config spells YaRN."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hydragen.model.rope import attention_factor

    head_dim, theta = 32, 10000.0
    cfg = Qwen3Config(
        hidden_size=64, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=512,
        rope_parameters={"rope_theta": theta, **scaling},
    )  # fmt: skip
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.allclose(inverse_frequencies(head_dim, theta, scaling), want_freq, rtol=1e-6, atol=0)
    assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    rotary = Rotary(head_dim, theta, scaling, 512, "cpu")
    cos, _ = rotary.tables(torch.tensor([0]), torch.float32)
    assert torch.allclose(cos, torch.full_like(cos, want_factor))  # position 0: cos 1, times the factor


def test_yarn_model_greedy_matches_transformers(tmp_path):
    """A tiny Qwen3 with YaRN scaling, on a prompt past the original context: transformers' greedy tokens."""
    import json

    import transformers

    from hydragen import LLM, SamplingParams

    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_theta": 10000.0, **YARN[0]},
    )  # fmt: skip
    torch.manual_seed(7)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(90)]  # past the original 64 positions
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    llm = LLM(str(tmp_path), kv_cache_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0, len(prompt) :].tolist()
