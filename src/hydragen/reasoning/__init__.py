"""Reasoning models: ``<think>...</think>`` told apart from the answer (``reasoning_content``), and where a
reply starts (inside its reasoning or not), which output constraints read to start after the reasoning."""

from hydragen.reasoning.formats import (
    CONTENT,
    OPENING,
    REASONING,
    REASONING_PARSERS,
    ReasoningFormat,
    detect_reasoning,
    resolve_reasoning,
)
from hydragen.reasoning.splitter import ReasoningSplitter, split_reasoning

__all__ = [
    "CONTENT",
    "OPENING",
    "REASONING",
    "REASONING_PARSERS",
    "ReasoningFormat",
    "ReasoningSplitter",
    "detect_reasoning",
    "resolve_reasoning",
    "split_reasoning",
]
