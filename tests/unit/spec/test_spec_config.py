"""``speculative_config``: vLLM's keys, checked once, with an error naming what is wrong; the CLI flag."""

from __future__ import annotations

import pytest

from hydragen.engine.config import EngineConfig
from hydragen.engine.config_flags import engine_flags
from hydragen.errors import ConfigError
from hydragen.spec.config import SpeculativeConfig, speculative_config


def test_off_by_default_and_vllm_s_dict_or_its_json():
    assert EngineConfig().speculative_config is None
    want = SpeculativeConfig("ngram", 3, 1, 5)
    for value in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5},
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}',
        want,
    ):
        assert EngineConfig(speculative_config=value).speculative_config == want


@pytest.mark.parametrize(
    "value, says",
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "ngram", "num_speculative_tokens": 64}, "at most 32"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "is above prompt_lookup_max"),
        ({"method": "ngram", "draft_model": "x"}, "unknown key(s) draft_model"),
        ({"method": "ngram", "use_siblings": "yes"}, "use_siblings must be true or false"),
        ({"method": "suffix"}, "not built yet"),
        ("{not json", "not valid JSON"),
        (["ngram"], "must be a dict"),
    ],
)
def test_bad_settings_are_refused_naming_the_problem(value, says):
    with pytest.raises(ConfigError, match="speculative_config") as e:
        speculative_config(value)
    assert says in str(e.value)


def test_the_cli_flag_round_trips():
    """A data-parallel front hands its replicas the same settings as flags: the JSON comes back equal."""
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    flags = engine_flags(config)
    i = flags.index("--speculative-config")
    assert EngineConfig(speculative_config=flags[i + 1]).speculative_config == config.speculative_config


def test_tensor_parallelism_is_refused_by_name():
    from hydragen.engine.parts import build_speculator

    config = EngineConfig(tensor_parallel_size=2, speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 is not built yet"):
        build_speculator(config, runner=None)
