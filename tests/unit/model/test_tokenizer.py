"""Tokenizer wrapper: parity with transformers' GGUF tokenizer, the on-disk conversion cache, HF dirs."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping

import pytest

from hydragen.model.default_model import default_model_path
from hydragen.model.tokenizer import _save_cache, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines ",
    "Ünïcödé – 日本語 🙂",
    "x = [1, 2, 3]  # code",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hydragen-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYDRAGEN_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def cold(cache):
    """The embedded model's tokenizer, loaded with an empty cache (so converted from the GGUF)."""
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _ref_chat_ids(ref, conversation, add_generation_prompt=True) -> list[int]:
    out = ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def test_encode_decode_match_transformers(cold, ref) -> None:
    tok = cold
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_model_facts(cold) -> None:
    tok = cold
    im_end, im_start = tok.encode("<|im_end|><|im_start|>")
    assert im_end in tok.eos_token_ids and tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == im_start == 1
    assert tok.encode("Hi")[0] != tok.bos_token_id  # SmolLM2 adds no BOS (GGUF add_bos_token = false)
    assert tok.vocab_size == 49152 and tok.has_chat_template


def test_chat_template_matches_transformers(cold, ref) -> None:
    tok = cold
    for conv in (CHAT, CHAT[1:2]):
        assert tok.apply_chat_template(conv) == _ref_chat_ids(ref, conv)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == _ref_chat_ids(ref, CHAT, False)
    assert tok.decode(tok.apply_chat_template(CHAT[1:2]), skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "conversation,match",
    [
        ([], "non-empty"),
        ("hi", "non-empty"),
        (["hi"], "message 0 must be a dict"),
        ([{"role": "user"}], "'content'"),
        ([{"role": "user", "content": 3}], "'content'"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 .*'role'"),
    ],
)
def test_chat_template_validates_messages(cold, conversation, match) -> None:
    with pytest.raises(ValueError, match=match):
        cold.apply_chat_template(conversation)


def test_warm_load_hits_cache(cold, cache, monkeypatch, capsys) -> None:
    """The second load reads the cached tokenizer.json: the GGUF vocabulary is not read or converted again
    (which is what takes 10-20 s), and nothing says it is being built."""
    import hydragen.model.gguf

    tok = cold
    entries = list((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    capsys.readouterr()

    def converted_again(*args, **kwargs):
        raise AssertionError("the warm load converted the GGUF vocabulary again")

    monkeypatch.setattr(hydragen.model.gguf, "read_gguf_metadata", converted_again)
    warm = load_tokenizer(default_model_path())
    assert "building the tokenizer cache" not in capsys.readouterr().err
    assert warm.eos_token_ids == tok.eos_token_ids and warm.bos_token_id == tok.bos_token_id
    assert all(warm.encode(t) == tok.encode(t) for t in TEXTS)
    assert warm.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_cache_key_holds_the_converters_versions(monkeypatch, tmp_path) -> None:
    """A tokenizer converted by another transformers (or tokenizers, or gguf) is not reused: each version
    has its own cache entry. The same file and versions keep theirs."""
    import hydragen.model.tokenizer as tokenizer_module

    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    installed = dict.fromkeys(("transformers", "tokenizers", "gguf"), "1.0")
    monkeypatch.setattr(tokenizer_module, "package_version", lambda name: installed[name])
    before = tokenizer_module._cache_dir(gguf_file)
    assert tokenizer_module._cache_dir(gguf_file) == before
    for name in ("transformers", "tokenizers", "gguf"):
        installed[name] = "2.0"
        assert tokenizer_module._cache_dir(gguf_file) != before, name
        installed[name] = "1.0"
    assert tokenizer_module._cache_dir(gguf_file) == before


def test_unwritable_cache_is_skipped(ref, tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    _save_cache(ref, [], blocker / "tokenizers" / "x")  # mkdir under a file fails: must not raise
    assert blocker.is_file()


def test_hf_directory(ref, tmp_path) -> None:
    ref.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.vocab_size == len(ref)
    assert all(tok.encode(t) == ref.encode(t) for t in TEXTS)
    assert tok.apply_chat_template(CHAT) == _ref_chat_ids(ref, CHAT)

    shutil.copytree(tmp_path / "hf", tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()
    plain = load_tokenizer(tmp_path / "plain")
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(CHAT)


def test_missing_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


def test_threads_may_share_one_tokenizer(cold) -> None:
    """The server tokenizes on worker threads while the engine thread detokenizes: every thread gets the
    single-threaded results (a fast tokenizer shared as is fails with "Already borrowed")."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [t * 40 for t in TEXTS if t] + ["a long prompt " * 500]
    want = [(cold.encode(t), cold.decode(cold.encode(t)), cold.apply_chat_template(CHAT)) for t in texts]

    def work(i: int):
        return [(cold.encode(t), cold.decode(cold.encode(t)), cold.apply_chat_template(CHAT)) for t in texts]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(32)))
    assert all(r == want for r in results)
