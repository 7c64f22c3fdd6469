"""The model families hydragen runs: one line each. A family is one module in ``model/families/``."""

from __future__ import annotations

from hydragen.model.families import llama, mistral, phi3, qwen2, qwen3
from hydragen.model.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
)


def supported_hf() -> list[str]:
    return [a for f in FAMILIES for a in f.hf_architectures]


def supported_gguf() -> list[str]:
    return [f.gguf_architecture for f in FAMILIES if f.gguf_architecture]


def family_for_hf(architecture: str) -> Family:
    """The family of a Hugging Face ``architectures`` name; ValueError listing the supported ones."""
    for f in FAMILIES:
        if architecture in f.hf_architectures:
            return f
    raise ValueError(
        f"unsupported model architecture {architecture!r}; hydragen supports {', '.join(supported_hf())}"
    )


def family_named(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown model family {name!r}; hydragen has {', '.join(f.name for f in FAMILIES)}")


def family_for_gguf(architecture: str) -> Family | None:
    """The family of a GGUF's ``general.architecture``, or None when hydragen has none for it."""
    for f in FAMILIES:
        if f.gguf_architecture == architecture:
            return f
    return None
