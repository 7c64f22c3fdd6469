"""Shared fixtures: tiny random checkpoints of each family, saved with save_pretrained (exact oracles)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

# A shell starts background jobs with SIGINT ignored (`make test &`, CI runners), and an ignored signal stays
# ignored in every program the tests start: their Ctrl-C tests would then see nothing. Run as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run in Triton's CPU interpreter; Triton reads this when it is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# LongRoPE factor lists in the range of Phi-3's: short ones near 1, long ones growing to tens (cut to the
# tiny models' rotary dims / 2).
PHI_SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1]
PHI_LONG = [1.0, 1.3, 2.0, 3.5, 6.0, 11.0, 19.0, 32.0]

TINY = {
    "llama": dict(
        arch="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    # MQA, explicit head_dim != hidden/heads, tied embeddings, Llama-3 RoPE scaling in the old config layout.
    "llama3_mqa": dict(
        arch="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=20,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        old_rope=dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": dict(
        arch="MistralForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        sliding_window=None,
    ),
    # Mistral 7B v0.1's sliding window, shrunk: prompts and replies run several windows long.
    "mistral_window": dict(
        arch="MistralForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=6,
    ),
    "qwen2": dict(
        arch="Qwen2ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # QK-norm over an explicit head size larger than hidden / heads, as Qwen3's real shapes have.
    "qwen3": dict(
        arch="Qwen3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, GQA, LongRoPE in the old config layout with a context past the
    # original length: the long factors rotate every position, and every prompt of
    # the tests is longer than the original 4 tokens, so transformers uses them too.
    "phi3": dict(
        arch="Phi3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=4,
        pad_token_id=0,
        tie_word_embeddings=False,
        old_rope=dict(
            rope_theta=10000.0,
            rope_scaling={"type": "longrope", "short_factor": PHI_SHORT[:8], "long_factor": PHI_LONG[:8]},
        ),
    ),
    # Phi-3-mini-4k's shape: a sliding window (8 here, 2,047 there) shorter than a context equal to LongRoPE's
    # original length (64 here, 4,096 there): the short factors, attention factor 1, every layer attending
    # through the window over prompts and replies several windows long.
    "phi3_window": dict(
        arch="Phi3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        original_max_position_embeddings=64,
        sliding_window=8,
        pad_token_id=0,
        old_rope=dict(
            rope_theta=10000.0,
            rope_scaling={"type": "longrope", "short_factor": PHI_SHORT[:8], "long_factor": PHI_LONG[:8]},
        ),
    ),
    # Phi-4-mini: partial rotary (0.75: RoPE on 12 of each head's 16 dims), GQA, tied embeddings, LongRoPE
    # in the new config layout, long factors (a context past the original length).
    "phi4_mini": dict(
        arch="Phi3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=4,
        partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": PHI_SHORT[:6], "long_factor": PHI_LONG[:6]},
        pad_token_id=0,
        tie_word_embeddings=True,
    ),
    # Gemma 2: sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar != head_dim, soft-capped scores
    # and logits, windows on alternate layers (wider than the tests' contexts: windowed = full attention).
    "gemma2": dict(
        arch="Gemma2ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=64,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        max_position_embeddings=512,
        random_norms=True,
        embed_std=0.02,
    ),
    # Gemma 3 (text): Gemma 2's layer with QK-norm over head_dim > hidden / heads, two local layers to one
    # global, local layers on their own RoPE base and global ones on rope_theta with linear scaling.
    "gemma3": dict(
        arch="Gemma3ForCausalLM",
        config_class="Gemma3TextConfig",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=64,
        sliding_window_pattern=3,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        max_position_embeddings=512,
        random_norms=True,
        embed_std=0.02,
    ),
}


def _save_tiny(name: str, root) -> str:
    return save_tiny(TINY[name], root / name)


def save_tiny(spec: dict, path) -> str:
    """A random checkpoint of ``spec`` (a ``TINY`` entry) saved at ``path``. ``config_class`` names the
    config when it is not the architecture's ("Gemma3TextConfig"); ``random_norms`` draws the norm weights
    too (Gemma stores w of x * (1 + w): zeros by default, which would hide a norm taken for another);
    ``embed_std`` the embeddings' (Gemma's scaled, tied embeddings at 0.15 make a model repeat its input)."""
    import transformers

    spec = dict(spec)
    arch = spec.pop("arch")
    old_rope = spec.pop("old_rope", None)
    random_norms = spec.pop("random_norms", False)
    embed_std = spec.pop("embed_std", 0.15)
    config_cls = getattr(transformers, spec.pop("config_class", arch.replace("ForCausalLM", "Config")))
    cfg = config_cls(bos_token_id=1, eos_token_id=2, **spec)
    torch.manual_seed(1234)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # larger weights than the default init give peaky, well-separated logits
        for p in model.parameters():
            if p is model.get_input_embeddings().weight:
                p.normal_(0, embed_std)
            elif p.dim() == 2:
                p.normal_(0, 0.15)
            elif random_norms:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    if old_rope is not None:  # rewrite the config in the old (rope_theta + rope_scaling) layout
        cfg_path = Path(path) / "config.json"
        d = json.loads(cfg_path.read_text())
        d.pop("rope_parameters", None)
        d.update(old_rope)
        cfg_path.write_text(json.dumps(d))
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def share_every_common_node():
    """Tests run at tiny sizes, where the cost rule would copy every shared prefix into private tails
    and leave the shared path untested: share everything held by two sequences (``min_shared_reads=0``).
    ``test_cost_rule`` checks the rule at its real default."""
    from hydragen.engine import engine

    saved, engine.DEFAULT_MIN_SHARED_READS = engine.DEFAULT_MIN_SHARED_READS, 0
    yield saved  # the real default
    engine.DEFAULT_MIN_SHARED_READS = saved


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: _save_tiny(name, root) for name in TINY}


@pytest.fixture(scope="session")
def embedded_llm():
    """The embedded model as users get it: its Q4_1/Q8_0 blocks kept quantized, a float16 KV cache."""
    from hydragen import LLM

    return LLM(kv_cache_tokens=32768)


@pytest.fixture(scope="session")
def embedded_llm_kv32():
    """The embedded model kept quantized, with a float32 KV cache (``kv_cache_dtype="float32"``)."""
    from hydragen import LLM

    return LLM(kv_cache_tokens=32768, kv_cache_dtype="float32")


@pytest.fixture(scope="session")
def embedded_llm_fp32():
    """The embedded model dequantized to float32 at load: the engine's exact-math reference."""
    from hydragen import LLM

    return LLM(kv_cache_tokens=32768, dequantize=True)


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own load of the embedded GGUF (it un-permutes q/k itself): the model oracle."""
    from transformers import AutoModelForCausalLM

    from hydragen.model.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.fixture(scope="session")
def reasoning_models(tmp_path_factory):
    """Tiny reasoning models (tests/helpers/reasoning_helpers.py): "qwen3" (the reply opens <think>) and
    "r1" (the generation prompt does)."""
    from tests.helpers.reasoning_helpers import tiny_reasoning_model

    root = tmp_path_factory.mktemp("reasoning")
    return {kind: tiny_reasoning_model(kind, root / kind) for kind in ("qwen3", "r1")}
