"""Broken Hugging Face model directories: each is one ModelFileError naming the file and the problem. And
which weight files of a directory are read: a sharded checkpoint's index decides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hydragen import LLM, SamplingParams
from hydragen.model import loader
from hydragen.model.errors import ModelFileError


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], path)
    return path


def _expect(model, where, match: str) -> None:
    with pytest.raises(ModelFileError, match=match) as info:
        LLM(model, kv_cache_tokens=1024)
    message = str(info.value)
    assert message.startswith(f"{where}: ") and "\n" not in message, message


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text('{"hidden_size": 64,,}')
    _expect(model_dir, model_dir / "config.json", r"is not valid JSON \(.* line 1, column")


def test_config_missing_field(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_attention_heads"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    _expect(model_dir, model_dir / "config.json", "lacks the field 'num_attention_heads'")


def test_config_unsupported_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    _expect(model_dir, model_dir / "config.json", "unsupported model architecture 'GPT2LMHeadModel'")


def test_no_config_and_no_weights(model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    _expect(tmp_path / "empty", tmp_path / "empty", "needs a config.json")
    (model_dir / "model.safetensors").unlink()
    _expect(model_dir, model_dir, r"no \*.safetensors or pytorch_model\*.bin weights")


def test_truncated_and_corrupt_safetensors(model_dir):
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _expect(model_dir, weights, "unreadable weights file, truncated or corrupt")
    weights.write_bytes(b"\x00" * 64)
    _expect(model_dir, weights, "unreadable weights file, truncated or corrupt")


def test_weights_that_do_not_match_the_config(model_dir):
    from safetensors.torch import load_file, save_file

    weights = model_dir / "model.safetensors"
    sd = load_file(weights)
    good = dict(sd)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, weights)
    _expect(model_dir, model_dir, "lack the tensor 'model.layers.1.mlp.up_proj.weight'")
    good["model.norm.weight"] = good["model.norm.weight"][:10].clone()
    save_file(good, weights)
    _expect(model_dir, model_dir, "a tensor's shape does not match the config")


def test_broken_tokenizer_file(model_dir):
    (model_dir / "tokenizer.json").write_text("{not json")
    _expect(model_dir, model_dir, "its tokenizer files cannot be loaded")


class _FakeHFTokenizer:
    """Stands in for transformers' slow GGUF vocab conversion (the real one takes 10-20 s)."""

    eos_token_id = 2
    bos_token_id = 1
    chat_template = None

    def save_pretrained(self, folder) -> None:
        (Path(folder) / "tokenizer.json").write_text("{}")


def test_tokenizer_cache_build_says_what_and_where(monkeypatch, tmp_path, capsys):
    import transformers

    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _FakeHFTokenizer())
    monkeypatch.setenv("HYDRAGEN_CACHE", str(tmp_path / "cache"))
    load_tokenizer(default_model_path())
    err = capsys.readouterr().err
    assert "building the tokenizer cache for SmolLM2-135M-Instruct.Q4_1.gguf, once" in err
    assert str(tmp_path / "cache" / "tokenizers") in err and "HYDRAGEN_CACHE" in err
    assert "tokenizer cache built in" in err
    load_tokenizer(default_model_path())  # cached: silent
    assert capsys.readouterr().err == ""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HYDRAGEN_CACHE", str(blocker))  # a cache folder that cannot be created
    load_tokenizer(default_model_path())
    assert "the cache could not be written" in capsys.readouterr().err


def _files_read(monkeypatch) -> list[str]:
    """The names of the weight files the loader reads from now on, in order."""
    read: list[str] = []
    real = loader._load_weights_file

    def load(path: Path):
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(loader, "_load_weights_file", load)
    return read


def _mistral_consolidated(directory: Path) -> None:
    """What Mistral's repositories ship beside the Hugging Face shards: the weights again, Mistral's names."""
    import torch
    from safetensors.torch import save_file

    save_file({"layers.0.attention.wq.weight": torch.ones(64, 64)}, directory / "consolidated.safetensors")


def test_a_sharded_checkpoint_reads_only_the_files_its_index_names(tiny_models, tmp_path, monkeypatch):
    import transformers

    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(f.name for f in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    _mistral_consolidated(sharded)
    read = _files_read(monkeypatch)
    prompt, greedy = [[5, 17, 99, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(sharded, kv_cache_tokens=1024).generate(prompt, greedy, use_tqdm=False)
    assert sorted(read) == shards  # each shard once, the consolidated file never
    want = LLM(tiny_models["llama"], kv_cache_tokens=1024).generate(prompt, greedy, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids

    (sharded / shards[-1]).unlink()
    _expect(sharded, sharded / "model.safetensors.index.json", f"names weight files .*{shards[-1]}")


def test_consolidated_weights_are_left_out_beside_hugging_face_ones(model_dir, monkeypatch):
    """No index: the Hugging Face files are read, and a consolidated file alone is still read."""
    _mistral_consolidated(model_dir)
    read = _files_read(monkeypatch)
    LLM(model_dir, kv_cache_tokens=1024)
    assert read == ["model.safetensors"]
    assert loader.weight_files(model_dir) == [model_dir / "model.safetensors"]
    (model_dir / "model.safetensors").unlink()
    assert loader.weight_files(model_dir) == [model_dir / "consolidated.safetensors"]
