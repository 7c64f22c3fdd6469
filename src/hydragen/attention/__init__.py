"""Exact shared-prefix (Hydragen) attention: partials over key blocks merged through their LSE."""

from hydragen.attention.merge import merge_into, merge_partials
from hydragen.attention.primitives import partial_attention
from hydragen.attention.reference import reference_attention
from hydragen.attention.shared_prefix import shared_prefix_attention

__all__ = [
    "merge_into",
    "merge_partials",
    "partial_attention",
    "reference_attention",
    "shared_prefix_attention",
]
