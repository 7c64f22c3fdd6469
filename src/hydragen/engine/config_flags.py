"""The engine's command-line flags, made from ``EngineConfig``'s fields (as vLLM's ``EngineArgs`` does).

``serve``, ``generate`` and ``chat`` all take them: a new engine setting gets its flag here without being
written again, with its help line, choices and default from the field. Every flag's argparse default is
None, so a config holds the field's own default unless the user typed the flag; ``engine_config`` builds
the config (a bad value is a usage error naming the flag) and ``engine_flags`` turns a config back into the
flags that give another process the same settings (a data-parallel front's replicas).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import Field, fields

from hydragen.engine.config import EngineConfig
from hydragen.errors import ConfigError


class EngineFlagError(ValueError):
    """A bad engine flag value; the message names the flag as the user typed it."""


def flag_of(f: Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _cli_fields() -> list[Field]:
    return [f for f in fields(EngineConfig) if f.metadata.get("cli")]


def _threads(value: str) -> int | str:
    """--threads N or --threads auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of threads or 'auto', got {value!r}") from None


def _value_type(f: Field):
    if f.name == "threads":
        return _threads
    return int if "int" in str(f.type) else str


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Every engine setting's flag, in an ``engine`` group of ``parser``'s help."""
    group = parser.add_argument_group("engine settings (the fields of hydragen.engine.config.EngineConfig)")
    for f in _cli_fields():
        options = dict(f.metadata["argparse"])
        help_text = f.metadata["flag_help"]
        if isinstance(f.default, bool):  # a flag that turns the setting to what it is not by default
            flip = dict(action="store_const", const=not f.default, default=None, help=help_text)
            group.add_argument(flag_of(f), dest=f.name, **flip)
            continue
        if f.default is not None and "(default" not in help_text:
            help_text += f" (default {f.default})"
        group.add_argument(
            flag_of(f), dest=f.name, type=_value_type(f), default=None, help=help_text, **options
        )


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The engine config of the parsed flags (unset flags keep the field's default), with ``overrides``
    (what the command decided itself: the resolved model path, a thread count, a KV budget)."""
    given = ((f.name, getattr(args, f.name, None)) for f in _cli_fields())
    options = {name: value for name, value in given if value is not None}
    options.update(overrides)
    try:
        return EngineConfig(**options)
    except ConfigError as e:
        field = next((f for f in fields(EngineConfig) if f.name == e.name), None)
        flag = flag_of(field) if field is not None and field.metadata.get("cli") else e.name
        raise EngineFlagError(re.sub(rf"^{e.name}\b", flag, str(e))) from None


def engine_flags(config: EngineConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags that give another process ``config``'s settings (those that differ from the defaults), but for
    the fields named in ``skip``."""
    out: list[str] = []
    for f in _cli_fields():
        value = getattr(config, f.name)
        if f.name in skip or value == f.default or value is None:
            continue
        if isinstance(f.default, bool):
            out.append(flag_of(f))
        else:
            out += [flag_of(f), str(value)]
    return out
