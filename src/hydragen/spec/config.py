"""``speculative_config``: vLLM's dict of speculative-decoding settings, checked once into a frozen value.

``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` and the CLI's
``--speculative-config '{"method": "ngram", ...}'`` take the same keys as vLLM. None (the default) is off.
Unknown keys and bad values are a ``ConfigError`` naming the key, never a silent default. This module
imports nothing heavy: the CLI's parser is built from the engine config, which holds one of these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from hydragen.errors import ConfigError

METHODS = ("ngram", "suffix")
NAME = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model: drafts proposed from the sequence's own context (``ngram``,
    prompt lookup) and verified in the same packed forward as everyone's work.

    ``num_speculative_tokens``: most drafts verified per sequence and step. ``prompt_lookup_min`` /
    ``prompt_lookup_max``: the n-gram lengths looked up, the longest that occurs winning. ``use_siblings``:
    with n > 1, a request's other samples are searched too. ``cost_rule``: speculate only where the expected
    accepted tokens pay for the extra rows at the step's size (off: always verify every draft found, for
    measurements)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    use_siblings: bool = True
    cost_rule: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(NAME, f"speculative_config method must be one of {', '.join(METHODS)}, got "
                              f"{self.method!r}")  # fmt: skip
        if self.method == "suffix":
            raise ConfigError(NAME, "speculative_config method 'suffix' is not built yet; use 'ngram'")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(
                    NAME, f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        if self.num_speculative_tokens > 32:
            raise ConfigError(NAME, f"speculative_config num_speculative_tokens must be at most 32, got "
                              f"{self.num_speculative_tokens}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(NAME, f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is "
                              f"above prompt_lookup_max ({self.prompt_lookup_max})")  # fmt: skip
        for name in ("use_siblings", "cost_rule"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(NAME, f"speculative_config {name} must be true or false, got "
                                  f"{getattr(self, name)!r}")  # fmt: skip

    def __str__(self) -> str:
        """The JSON the CLI flag takes back (a data-parallel front hands its replicas the same settings)."""
        return json.dumps(asdict(self), separators=(",", ":"))


def speculative_config(value) -> SpeculativeConfig | None:
    """``value`` as a checked config: None, a dict of vLLM's keys, its JSON text, or a config already."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(NAME, f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(
            NAME, f"speculative_config must be a dict (or its JSON), got {type(value).__name__}"
        )
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(NAME, f"speculative_config has unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}")  # fmt: skip
    if "method" not in value:
        raise ConfigError(NAME, "speculative_config needs a method ('ngram')")
    return SpeculativeConfig(**value)
