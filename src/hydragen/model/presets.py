"""Model shapes by name, for random-weight benchmarks: throughput does not depend on weight values, so a
CodeLlama-13B-shaped model can be measured without downloading CodeLlama-13B."""

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
