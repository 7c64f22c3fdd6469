"""Helpers for structured-output tests: a tiny random model that uses the embedded SmolLM2 tokenizer (a
real 49152-token BPE vocabulary, so jump-forward meets real token boundaries), and output checks."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import torch


def save_random_model(arch: str, tok, dest: Path, eos_ids: list[int], **shape) -> str:
    """A random ``arch`` (e.g. "LlamaForCausalLM") sized to ``tok``'s vocabulary, saved with ``tok``
    beside it; ``shape`` overrides the small default sizes."""
    import transformers

    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        tie_word_embeddings=True,
        **{**sizes, **shape},
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # peaky logits, as the other tiny models
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return str(dest)


def tiny_bpe_model(dest: Path) -> str:
    """A 2-layer random Llama with the embedded model's tokenizer and chat template beside it."""
    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer

    if (dest / "config.json").exists():
        return str(dest)
    tok = load_tokenizer(default_model_path())._tok
    return save_random_model(
        "LlamaForCausalLM",
        tok,
        dest,
        [tok.eos_token_id],
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=2048,
    )


def assert_valid(text: str, schema, where: str) -> None:
    """``text`` parses as JSON and validates against ``schema`` (jsonschema's own validator)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"{where}: not JSON ({e}): {text!r}") from None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{where}: does not validate ({e.message}): {text!r}") from None
