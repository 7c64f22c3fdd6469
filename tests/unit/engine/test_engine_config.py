"""One frozen, validated EngineConfig; the CLI's engine flags are made from its fields."""

from __future__ import annotations

import dataclasses

import pytest

from hydragen import LLM
from hydragen.cli.parser import build_parser
from hydragen.engine.config import EngineConfig
from hydragen.engine.config_flags import engine_config, engine_flags, flag_of
from hydragen.errors import ConfigError

FLAGGED = [f for f in dataclasses.fields(EngineConfig) if f.metadata["cli"]]


def parse(command: str, *flags: str):
    extra = ["hi"] if command == "generate" else []
    return build_parser().parse_args([command, *extra, *flags])


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_setting_has_its_flag_on_every_command(command):
    """A field added to EngineConfig gets its flag on serve, generate and chat, with the field's help line."""
    actions = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices[command]._actions}
    for f in FLAGGED:
        assert f.name in actions, f"{command} has no flag for EngineConfig.{f.name}"
        assert flag_of(f) in actions[f.name].option_strings
        assert actions[f.name].help
    assert engine_config(parse(command)) == EngineConfig()  # no flag typed: the fields' own defaults


def test_flags_give_the_config_and_a_config_gives_its_flags_back():
    """What a data-parallel front hands its replicas: the config, turned into flags, parses to the same."""
    typed = [
        "--model", "m.gguf", "--dtype", "bfloat16", "--page-size", "4", "--no-sharing", "--no-jump-forward",
        "--prefill-chunk", "64", "--max-wait-steps", "0", "--tool-format", "hermes", "--threads", "auto",
        "--literal-json-schema", "--kv-cache-tokens", "4096", "--attention", "torch",
        "--min-shared-reads", "0",
    ]  # fmt: skip
    config = engine_config(parse("serve", *typed))
    want = EngineConfig(
        model="m.gguf", dtype="bfloat16", page_size=4, prefix_sharing=False, jump_forward=False,
        prefill_chunk=64, max_wait_steps=0, tool_format="hermes", threads="auto", literal_json_schema=True,
        kv_cache_tokens=4096, attention="torch", min_shared_reads=0,
    )  # fmt: skip
    assert config == want
    assert engine_config(parse("serve", *engine_flags(config))) == config
    assert "--page-size" not in engine_flags(config, skip=("page_size",))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--page-size", "0"], "--page-size must be a positive integer, got 0"),
        (["--max-num-seqs", "-1"], "--max-num-seqs must be a positive integer"),
        (["--threads", "0"], "--threads must be a positive integer or 'auto'"),
        (["--device", "tpu"], "--device must be 'cpu' or 'cuda'"),
        (["--dtype", "float16", "--kv-cache-dtype", "float32"], "--kv-cache-dtype='float32' needs float32"),
    ],
)
def test_a_bad_flag_is_an_error_naming_it(flags, message):
    with pytest.raises(ValueError) as e:
        engine_config(parse("serve", *flags))
    assert message in str(e.value)


def test_every_value_is_checked_once_with_its_name():
    for name, value in [
        ("page_size", 0), ("prefill_budget", 0), ("kv_cache_tokens", 0), ("max_wait_steps", -1),
        ("min_shared_reads", 1.5), ("prefix_sharing", "yes"), ("dtype", "float64"), ("attention", "flash"),
        ("tool_format", "xml"), ("threads", True), ("tensor_parallel_size", 0),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            EngineConfig(**{name: value})
        assert e.value.name == name and name in str(e.value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().page_size = 4  # type: ignore[misc]
    assert EngineConfig().replace(page_size=4).page_size == 4


def test_llm_refuses_an_unknown_setting_before_loading_anything():
    with pytest.raises(TypeError, match="unknown engine setting.*prefil_chunk.*known: .*prefill_chunk"):
        LLM(prefil_chunk=4)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        LLM(page_size=0)


def test_llm_keeps_its_settings(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_tokens=1024, page_size=4, prefill_chunk=32, max_wait_steps=3)
    config = llm.engine_config
    assert (config.page_size, config.prefill_chunk, config.max_wait_steps) == (4, 32, 3)
    sched = llm.engine.scheduler
    assert (sched.page_size, sched.prefill_chunk, sched.max_wait_steps) == (4, 32, 3)
    assert LLM.from_config(config).engine_config == config
