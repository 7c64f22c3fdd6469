"""A model's own sampling defaults: what its authors recommend, used for the fields a request leaves unset.

vLLM does the same (its ``--generation-config auto``, the default): Qwen3 ships temperature 0.6, top_p
0.95 and top_k 20 in ``generation_config.json`` and degrades into repetition under greedy decoding, so a
request that names no temperature should get the model's, not 1.0. A Hugging Face directory gives them in
``generation_config.json``; a GGUF in ``general.sampling.*`` metadata (llama.cpp's converter copies them
there). Only the fields hydragen samples with are taken; the rest (repetition_penalty, ...) are reported
as ignored. ``generation_config="hydragen"`` (``--generation-config hydragen``) turns this off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
# GGUF metadata key -> SamplingParams field
GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
}
IGNORED_HF = ("repetition_penalty", "presence_penalty", "frequency_penalty")
IGNORED_GGUF = ("general.sampling.penalty_repeat",)


class GenerationDefaults:
    """The model's defaults (SamplingParams field -> value), where they came from, and what was ignored."""

    def __init__(self, values: dict[str, Any], source: str = "", ignored: tuple[str, ...] = ()):
        self.values, self.source, self.ignored = values, source, ignored

    def __bool__(self) -> bool:
        return bool(self.values)

    def describe(self) -> str:
        """The log line that says what applies, and how to turn it off."""
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        line = (
            f"hydragen: the model's sampling defaults ({self.source}) apply to fields a request leaves "
            f"unset: {shown} (generation_config='hydragen' / --generation-config hydragen turns this off)"
        )
        if self.ignored:
            line += f"; not applied (hydragen has no such setting): {', '.join(self.ignored)}"
        return line


def _number(field: str, value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if field == "top_k" else float(value)


def read_generation_defaults(path: Path) -> GenerationDefaults:
    """The defaults of the model at ``path`` (a GGUF file or a Hugging Face directory); none when it has
    none or they cannot be read (a broken generation_config.json only costs the defaults, not the load)."""
    path = Path(path)
    values: dict[str, Any] = {}
    ignored: list[str] = []
    if path.suffix == ".gguf" and path.is_file():
        from hydragen.model.gguf import read_gguf_metadata

        meta = read_gguf_metadata(path)
        for key, field in GGUF_FIELDS.items():
            if (value := _number(field, meta.get(key))) is not None:
                values[field] = value
        ignored = [k for k in IGNORED_GGUF if k in meta]
        return GenerationDefaults(values, f"GGUF metadata of {path.name}", tuple(ignored))
    gen = path / "generation_config.json"
    if not gen.is_file():
        return GenerationDefaults({})
    try:
        data = json.loads(gen.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return GenerationDefaults({})
    if not isinstance(data, dict):
        return GenerationDefaults({})
    for key, field in HF_FIELDS.items():
        if (value := _number(field, data.get(key))) is not None:
            values[field] = value
    ignored = [k for k in IGNORED_HF if data.get(k) not in (None, 1.0, 0.0)]
    return GenerationDefaults(values, "generation_config.json", tuple(ignored))
