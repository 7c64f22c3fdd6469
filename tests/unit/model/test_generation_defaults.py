"""A model's own sampling defaults (generation_config.json, GGUF general.sampling.*) fill unset fields."""

from __future__ import annotations

import argparse
import json
import shutil

import gguf
import numpy as np
import pytest

from hydragen import LLM, SamplingParams
from hydragen.model.generation_defaults import read_generation_defaults

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _with_generation_config(tiny_dir: str, dest, **fields):
    shutil.copytree(tiny_dir, dest)
    gen = dest / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **fields}))
    return dest


def test_read_from_a_hugging_face_directory(tiny_models, tmp_path):
    path = _with_generation_config(
        tiny_models["llama"], tmp_path / "m", temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1
    )
    found = read_generation_defaults(path)
    assert found.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert isinstance(found.values["top_k"], int)
    assert found.ignored == ("repetition_penalty",)
    assert "temperature=0.6" in found.describe() and "repetition_penalty" in found.describe()
    (path / "generation_config.json").write_text("{not json")
    assert not read_generation_defaults(path)  # a broken file costs the defaults, not the load
    assert not read_generation_defaults(tmp_path / "nowhere")


def test_read_from_gguf_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 0.5)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_generation_defaults(path).values == {"temperature": 0.25, "top_k": 40, "top_p": 0.5}


def test_the_loaders_parse_of_a_gguf_header_serves_the_defaults(tmp_path, monkeypatch):
    """Loading a GGUF parses its header once: the sampling defaults (and the tokenizer) read the metadata
    the loader kept, where a second parse cost 0.66 s on the embedded model; a changed file is parsed
    again."""
    import os

    from hydragen.model import gguf as hydragen_gguf

    path = tmp_path / "m.gguf"

    def write(temp: float) -> None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_float32("general.sampling.temp", temp)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    from hydragen.model.loader import resolve_model_path

    parses = []
    real = hydragen_gguf.open_gguf
    monkeypatch.setattr(hydragen_gguf, "open_gguf", lambda p: parses.append(p) or real(p))
    embedded = resolve_model_path(None)
    hydragen_gguf.open_gguf_tensors(embedded)  # the loader's parse
    read_generation_defaults(embedded)
    assert len(parses) == 1
    write(0.25)
    assert read_generation_defaults(path).values == {"temperature": 0.25}
    assert read_generation_defaults(path).values == {"temperature": 0.25}
    assert len(parses) == 2
    write(0.5)
    os.utime(path, ns=(1, 1))  # a rewrite within the clock's resolution still changes the key
    assert read_generation_defaults(path).values == {"temperature": 0.5}
    assert len(parses) == 3


def test_llm_applies_them_when_no_params_are_given(tiny_models, tmp_path, capsys):
    """temperature 0 in generation_config.json: a call without SamplingParams decodes greedily, whatever the
    seed would draw; generation_config="hydragen" keeps SamplingParams' own defaults."""
    path = _with_generation_config(tiny_models["llama"], tmp_path / "m", temperature=0.0, top_k=5)
    llm = LLM(str(path), kv_cache_tokens=1024)
    assert "temperature=0.0, top_k=5" in capsys.readouterr().err
    assert llm.get_default_sampling_params().temperature == 0.0
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    defaulted = llm.generate(PROMPTS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in defaulted] == [o.outputs[0].token_ids[:16] for o in greedy]
    plain = LLM(str(path), kv_cache_tokens=1024, generation_config="hydragen")
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(path), generation_config="vllm")


def test_cli_flags_left_unset_take_the_model_defaults():
    from hydragen.cli.common import sampling_params

    args = argparse.Namespace(
        temperature=None, top_p=0.5, top_k=None, min_p=None, seed=3, default_temperature=0.7
    )
    assert sampling_params(args).temperature == 0.7  # the subcommand's own default
    params = sampling_params(args, {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, max_tokens=4)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.5, 20, 0.0)
