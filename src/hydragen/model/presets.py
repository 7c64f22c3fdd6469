"""Model shapes by name, for random-weight benchmarks: throughput does not depend on weight values, so a
CodeLlama-13B-shaped model can be measured without downloading CodeLlama-13B.

A preset is a Hugging Face config dict; its ``architectures`` name the family (model/registry.py), whose GGUF
layout the random-weights writer (model/gguf_write.py) uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA2 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        _LLAMA2,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Llama 3 shapes (their llama3 RoPE scaling left out: throughput does not depend on it)
    "llama-3.2-1b": dict(
        _LLAMA2,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        _LLAMA2,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "codellama-7b": dict(
        _LLAMA2,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32016,
        max_position_embeddings=16384,
        rope_theta=1000000.0,
    ),
    "codellama-13b": dict(
        _LLAMA2,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32016,
        max_position_embeddings=16384,
        rope_theta=1000000.0,
    ),
    "codellama-34b": dict(
        _LLAMA2,
        hidden_size=8192,
        intermediate_size=22016,
        num_hidden_layers=48,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=16384,
        rope_theta=1000000.0,
    ),
}


# Qwen3 (dense): the shapes of Qwen/Qwen3-8B's and Qwen/Qwen3-1.7B's config.json (Qwen3-8B's checked against
# a verbatim copy of it; Qwen3-1.7B's against its published card: 28 layers, 2048 hidden, 6144 intermediate,
# 16 query / 8 KV heads of 128, tied embeddings, 151,936 tokens).
_QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_act="silu",
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    vocab_size=151936,
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
PRESETS |= {
    "qwen3-8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": dict(
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
}

# Phi-4-mini: microsoft/Phi-4-mini-instruct's config.json shape (partial rotary 0.75: RoPE on 96 of each
# head's 128 dims, tied embeddings); its LongRoPE factor lists are left out, as the Llama 3 presets leave out
# their RoPE scaling: throughput does not depend on them.
PRESETS |= {
    "phi-4-mini": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        hidden_act="silu",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        partial_rotary_factor=0.75,
        vocab_size=200064,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=199999,
        eos_token_id=199999,
        pad_token_id=199999,
    ),
}

# Gemma 3 (text): google/gemma-3-1b-it's config.json and gemma-3-4b-it's text_config (as copied in public
# fine-tunes' configs). Tied embeddings; the 1B's 1,152-wide rows do not split into 256-weight blocks, so its
# Q4_K_M holds Q5_0 (and a Q8_0 embedding) where llama-quantize falls back.
_GEMMA3 = dict(
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    hidden_activation="gelu_pytorch_tanh",
    head_dim=256,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    sliding_window_pattern=6,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=[1, 106],
    pad_token_id=0,
)
PRESETS |= {
    "gemma-3-1b": dict(
        _GEMMA3,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=262144,
        max_position_embeddings=32768,
        sliding_window=512,
        rope_scaling=None,
    ),
    "gemma-3-4b": dict(
        _GEMMA3,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=262208,
        max_position_embeddings=131072,
        sliding_window=1024,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}

# Gemma 2 2B: google/gemma-2-2b's config.json shape (26 layers, 2304 hidden, 9216 intermediate, 8 query / 4 KV
# heads of 256, query_pre_attn_scalar 256, a 4,096 window on alternate layers from layer 0, soft-caps 50 and
# 30, 256,000 tokens, tied), as recalled from the model card's config and matched against AI-Hypercomputer
# maxtext's hf_model_configs.py (gemma2_2b: layers, heads, hidden and intermediate, the rest transformers'
# Gemma2Config defaults) and llama.cpp's gemma2 loader (26 layers: its 2B).
PRESETS |= {
    "gemma-2-2b": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=256000,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    ),
}


# Mistral 7B v0.1: mistralai/Mistral-7B-v0.1's config.json shape, the Mistral with a real 4,096-token window
# in every layer (v0.2 and later dropped it); llama.cpp's converter writes it as a llama GGUF.
PRESETS |= {
    "mistral-7b": dict(
        _LLAMA2,  # its norms, activation, untied head and token ids
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        sliding_window=4096,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        vocab_size=32000,
    ),
}


def config_for_random_weights(spec: str | Path) -> tuple[dict[str, Any], str]:
    """A Hugging Face config dict from a preset name, a config.json file or a model directory.

    Returns (config, display name).
    """
    name = str(spec)
    if name.lower() in PRESETS:
        return dict(PRESETS[name.lower()]), name.lower()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"random-weights config {name!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a config.json file or model directory"
        )
    try:
        return json.loads(path.read_text()), path.parent.name if path.name == "config.json" else path.stem
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
