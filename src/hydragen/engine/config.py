"""One frozen, validated engine configuration: every setting of a model's engine in one place.

``LLM(...)`` keeps its keyword arguments (vLLM style) and builds an ``EngineConfig`` from them; the engine,
the model runner and the scheduler read their settings from it; the CLI's flags for ``serve``, ``generate``
and ``chat`` are made from its fields (``engine/config_flags.py``, as vLLM's ``EngineArgs`` makes its flags),
so a new setting cannot miss its flag, and a data-parallel front hands its replicas the same settings by
turning a config back into flags. Every value is checked here, once, with an error naming the setting;
what needs the machine (is CUDA there, does the model load) is checked where it is used.

This module imports nothing heavy: the CLI builds its parser from it without importing torch.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from hydragen.errors import ConfigError
from hydragen.reasoning.formats import REASONING_PARSERS
from hydragen.spec.config import SpeculativeConfig, speculative_config

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_PAGE_SIZE = 16
ATTENTION = ("auto", "fused", "torch", "triton", "none")
# the names of hydragen.tools.formats.FORMATS (tests/unit/tools/test_tool_formats.py keeps them equal)
TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "mistral_v11", "phi4_mini_json", "generic")
GENERATION_CONFIGS = ("auto", "hydragen")


def setting(
    default, help: str, *, flag: str | None = None, flag_help: str | None = None, cli: bool = True, **argparse
):
    """A field of ``EngineConfig``: its default, one line of help, and how its CLI flag is made (the flag is
    ``--field-name`` unless ``flag`` says otherwise, its help ``help`` unless ``flag_help`` does: a flag that
    turns a setting off says what it does; ``cli=False``: no flag, Python only)."""
    meta = {"help": help, "flag": flag, "flag_help": flag_help or help, "cli": cli, "argparse": argparse}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    # ---- the model --------------------------------------------------------------------------------
    model: str | Path | None = setting(
        None, "a .gguf file or Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    random_weights: bool = setting(
        False,
        "build the model named by `model` (a preset, a config.json or a directory) with random weights",
        cli=False,  # the CLI's --random-weights SHAPE:SCHEME writes a GGUF file instead (cli/common.py)
    )
    device: str = setting("cpu", "cpu or cuda")
    dtype: str = setting("float32", "compute dtype", choices=DTYPE_NAMES)
    dequantize: bool = setting(
        False, "convert GGUF quantized and 16-bit weights to the compute dtype at load (default: keep them)"
    )
    tensor_parallel_size: int = setting(
        1,
        "split the model over N processes (attention heads, MLP columns, vocabulary); hydragen starts them "
        "itself, or, under torchrun, uses its ranks (default 1, or torchrun's number of ranks)",
        metavar="N",
    )
    threads: int | str | None = setting(
        None,
        "CPU threads for torch: a count, or 'auto' for the cores other programs leave free, re-checked as "
        "it runs (Python default: torch's setting; the CLI's default: auto)",
    )
    # ---- the KV cache ----------------------------------------------------------------------------
    kv_cache_tokens: int | None = setting(
        None, "KV cache size in tokens (default: a share of the free memory)", metavar="TOKENS"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's dtype: auto is float16 for a GGUF model kept quantized (as llama.cpp caches it), "
        "else the compute dtype; a 16-bit cache under float32 compute halves the bytes per token",
        choices=("auto", *DTYPE_NAMES),
    )
    page_size: int = setting(
        DEFAULT_PAGE_SIZE, "KV page size in tokens: the unit of allocation, sharing and caching"
    )
    prefix_sharing: bool = setting(
        True,
        "share prefixes (the prefix cache and shared attention); off: every sequence keeps its own copy",
        flag="--no-sharing",
        flag_help="baseline: no prefix cache, no shared attention (every sequence keeps its own KV copy)",
    )
    min_shared_reads: int | None = setting(
        None,
        "the cost rule's threshold: pages shared by h sequences are read once for all of them when "
        "(h - 1) x tokens reaches it (0: share everything held twice; default: the measured value)",
        metavar="TOKENS",
    )
    share_limit: int | None = setting(
        None, "share only the first that many context tokens (the benchmarks' one-level ablation)", cli=False
    )
    # ---- scheduling ---------------------------------------------------------------------------------
    max_num_seqs: int = setting(256, "most sequences running at once")
    prefill_chunk: int = setting(512, "most prompt tokens one sequence computes in a step", metavar="TOKENS")
    prefill_budget: int = setting(
        2048, "most prompt tokens all sequences compute in a step", metavar="TOKENS"
    )
    max_wait_steps: int = setting(
        64, "steps a waiting request may be passed over before it goes first", metavar="STEPS"
    )
    attention: str = setting(
        "auto",
        "attention implementation: auto, fused (the compiled CPU op), torch, triton, none (measurement)",
        choices=ATTENTION,
    )
    speculative_config: SpeculativeConfig | dict | str | None = setting(
        None,
        "speculative decoding without a draft model, as vLLM's dict (or its JSON): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}; '
        "drafts are verified in the step's forward, each row drawn as decoding alone draws it (default: off)",
        metavar="JSON",
    )
    # ---- outputs ---------------------------------------------------------------------------------------
    jump_forward: bool = setting(
        True,
        "structured outputs: append the text a grammar forces in one step (off: sample it token by token)",
        flag="--no-jump-forward",
        flag_help="structured outputs: sample forced text token by token instead of jumping over it",
    )
    literal_json_schema: bool = setting(
        False,
        "read JSON Schemas literally: an object without additionalProperties may get any extra keys "
        "(default: only the properties it names, as vLLM/SGLang with XGrammar)",
    )
    tool_format: str | None = setting(
        None,
        "how tool calls are written (default: detected from the chat template; generic for a template "
        "without tools)",
        choices=TOOL_FORMATS,
    )
    generation_config: str = setting(
        "auto",
        "sampling defaults for fields a request leaves unset: auto (the model's own, from its "
        "generation_config.json or GGUF metadata, as vLLM) or hydragen (temperature 1, no top-p/top-k)",
        choices=GENERATION_CONFIGS,
    )
    reasoning_parser: str = setting(
        "auto",
        "how a reasoning model's <think>...</think> is told apart from its answer (reasoning_content), and "
        "where output constraints start (after it): auto detects it from the chat template and tokenizer; "
        "none: no reasoning parsed",
        choices=REASONING_PARSERS,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        _check_positive(self, "tensor_parallel_size", "page_size", "max_num_seqs", "prefill_chunk")
        _check_positive(self, "prefill_budget")
        _check_optional_positive(self, "kv_cache_tokens", "share_limit")
        for name in ("max_wait_steps", "min_shared_reads"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 0):
                raise ConfigError(name, f"{name} must be a non-negative integer, got {value!r}")
        for name in ("random_weights", "dequantize", "prefix_sharing", "jump_forward", "literal_json_schema"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", f"device must be 'cpu' or 'cuda', got {self.device!r}")
        _check_choice(self, "dtype", DTYPE_NAMES)
        _check_choice(self, "kv_cache_dtype", ("auto", *DTYPE_NAMES))
        if self.kv_cache_dtype not in ("auto", self.dtype) and self.dtype != "float32":
            raise ConfigError(
                "kv_cache_dtype",
                f"kv_cache_dtype={self.kv_cache_dtype!r} needs float32 compute (dtype='float32'); with dtype "
                f"{self.dtype!r} the cache keeps the model's dtype ('auto')",
            )
        _check_choice(self, "attention", ATTENTION)
        if self.attention == "triton" and not triton_available():
            raise ConfigError("attention", "attention='triton' needs the triton package (pip install triton)")
        if self.tool_format is not None:
            _check_choice(self, "tool_format", TOOL_FORMATS)
        _check_choice(self, "generation_config", GENERATION_CONFIGS)
        _check_choice(self, "reasoning_parser", REASONING_PARSERS)
        t = self.threads
        if t is not None and t != "auto" and not (_is_int(t) and t >= 1):
            raise ConfigError("threads", f"threads must be a positive integer or 'auto', got {t!r}")

    def options(self) -> dict:
        """The settings by name: ``LLM(**config.options())`` builds an LLM with exactly these."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes) -> EngineConfig:
        """A copy with some settings changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """The config of ``LLM(**options)``: unknown names are a TypeError listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            names = ", ".join(sorted(known))
            raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; known: {names}")
        return cls(**options)


def triton_available() -> bool:
    """Whether the optional Triton kernels can be used (triton importable; not imported here)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def defaults() -> dict:
    """Every setting's default, by name."""
    return {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (_is_int(value) and value >= 1):
            raise ConfigError(name, f"{name} must be a positive integer, got {value!r}")


def _check_optional_positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            _check_positive(cfg, name)


def _check_choice(cfg: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, f"{name} must be one of {', '.join(choices)}, got {value!r}")
