"""What the CLI's commands share: flag checks, sampling settings, loading the model, tensor parallelism."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

# SamplingParams field -> the flag that sets it, so a bad value is reported as the user typed it.
SAMPLING_FLAGS = {
    "n": "-n",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "max_tokens": "--max-tokens",
    "stop": "--stop",
    "seed": "--seed",
}


class UsageError(Exception):
    """A bad command line value, reported as ``error: ...`` with exit code 2 (as argparse does)."""


def flag_named(message: str) -> str:
    """Rewrite a SamplingParams error so it names the CLI flag (``--top-p``, not ``SamplingParams.top_p``)."""
    for field, flag in SAMPLING_FLAGS.items():
        message = re.sub(rf"(?:\bSamplingParams\.|^){field}\b", flag, message)
    return message


CLI_SAMPLING_DEFAULTS = {"top_p": 0.95, "top_k": 0, "min_p": 0.0}  # temperature: per subcommand


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None, **fields):
    """SamplingParams from the flags: a flag left unset takes the model's default (``model_defaults``: its
    generation_config.json or GGUF metadata, as ``LLM.generation_defaults`` read them), else the CLI's."""
    from hydragen import SamplingParams

    defaults = {**CLI_SAMPLING_DEFAULTS, "temperature": args.default_temperature, **(model_defaults or {})}
    chosen = {f: getattr(args, f) if getattr(args, f) is not None else d for f, d in defaults.items()}
    try:
        return SamplingParams(seed=args.seed, **chosen, **fields)
    except ValueError as e:
        raise UsageError(flag_named(str(e))) from None


def constraint(args: argparse.Namespace):
    """``generate``'s output constraint (--json-schema / --regex / --choice), or None."""
    from hydragen import StructuredOutputsParams

    given = {
        "--json-schema": args.json_schema,
        "--regex": args.regex,
        "--choice": args.choice,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if not named:
        return None
    if len(named) > 1:
        raise UsageError(f"give at most one output constraint, got {' and '.join(named)}")
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{") and Path(schema).is_file():
            schema = Path(schema).read_text()
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise UsageError(f"--json-schema: {e} (give a JSON Schema or a file holding one)") from None
    try:
        return StructuredOutputsParams(regex=args.regex, choice=args.choice)
    except ValueError as e:
        raise UsageError(f"{named[0]}: {e}") from None


def resolve_random_weights(args: argparse.Namespace) -> None:
    """--random-weights SHAPE:SCHEME becomes --model: its random-weights GGUF (model/gguf_write.py), written
    once into hydragen's cache with llama-quantize's type mix and the embedded model's tokenizer, so text
    prompts work and every command (tensor or data parallel too) loads it like a downloaded file."""
    spec = getattr(args, "random_weights", None)
    if spec is None:
        return
    if args.model is not None:
        raise UsageError("give either --model or --random-weights, not both")
    shape, _, scheme = spec.rpartition(":")
    if not shape or not scheme:
        raise UsageError(
            f"--random-weights needs SHAPE:SCHEME (e.g. llama-3.1-8b:Q4_K_M), got {spec!r}: the random file "
            "carries a tokenizer; a bare random shape without one is for the Python API and `hydragen bench`"
        )
    from hydragen.model.gguf_write import random_gguf_file

    try:
        args.model = str(random_gguf_file(spec))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise UsageError(f"--random-weights {spec!r}: {e}") from None


def apply_machine_flags(args: argparse.Namespace) -> None:
    """Flags checked before the (slow) model load."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be at least 2 tokens, got {args.max_model_len}")


def engine_config_of(args: argparse.Namespace, **overrides):
    """The engine settings the flags give (``EngineConfig``), checked before anything loads: a bad value is
    a usage error naming its flag. The CLI's own defaults: the cores other programs leave free (threads
    "auto"), and torchrun's number of ranks under torchrun (--random-weights has become --model already)."""
    from hydragen.engine.config_flags import EngineFlagError, engine_config

    cli_defaults = {"tensor_parallel_size": tp_size(args)}
    if args.threads is None:
        cli_defaults["threads"] = "auto"
    try:
        return engine_config(args, **cli_defaults, **overrides)
    except EngineFlagError as e:
        raise UsageError(str(e)) from None


def load_llm(args: argparse.Namespace, config):
    """(LLM, seconds it took, context length in force): the model of ``config`` plus --max-model-len checked
    against it."""
    from hydragen import LLM

    t0 = time.perf_counter()
    llm = LLM(**config.options())
    load_s = time.perf_counter() - t0
    context = llm.config.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > context:
            raise UsageError(
                f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens"
            )
        context = args.max_model_len
    return llm, load_s, context


def tp_size(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, defaulting to the number of ranks when torchrun started this process."""
    from hydragen.tp.group import torchrun_env

    env = torchrun_env()
    size = args.tensor_parallel_size
    if size is None:
        return env.world if env is not None else 1
    if size < 1:
        raise UsageError(f"--tensor-parallel-size must be at least 1, got {size}")
    if env is not None and size != env.world:
        raise UsageError(
            f"--tensor-parallel-size {size} does not match the {env.world} ranks torchrun started"
        )
    return size


def torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun, ranks 1..N-1 follow rank 0 instead of running the command (None on rank 0, or
    without torchrun)."""
    from hydragen.tp.group import torchrun_env

    env = torchrun_env()
    if env is None or env.rank == 0 or args.command not in ("generate", "serve", "chat"):
        return None
    config = engine_config_of(args)
    from hydragen.model.loader import resolve_device, resolve_dtype
    from hydragen.tp.launcher import run_torchrun_worker

    return run_torchrun_worker(
        config.model, resolve_device(config.device), resolve_dtype(config.dtype), dequantize=config.dequantize
    )


def kv_for(context: int | None, n: int) -> int | None:
    """KV cache for --max-model-len: room for the prompt once plus n full contexts, twice over (the decode
    tail block is rebuilt while the old one is still held). None: the engine's default."""
    return None if context is None else 2 * (n + 1) * (context + 1) + 1024
