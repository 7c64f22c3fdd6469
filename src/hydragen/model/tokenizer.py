"""Tokenizer: a thin wrapper over a transformers fast tokenizer, loadable from a HF directory or a GGUF file.

Converting a GGUF vocab through transformers costs ~10-20 s, so the converted tokenizer is cached on disk
(keyed by the file's name, size and mtime, and by the versions of the packages that convert it) and later
loads read the cached tokenizer.json in well under 1 s.
The cache lives in hydragen's cache folder, ``tokenizers/`` (``$HYDRAGEN_CACHE_DIR``, else the older
``$HYDRAGEN_CACHE``, else ``~/.cache/hydragen``: the compiled ops and random-weights files live there too);
the one slow build says so on stderr, with the folder.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from hydragen.errors import ParamError
from hydragen.model.errors import ModelFileError, first_line

_META = "hydragen_tokenizer.json"  # extra eos ids from the GGUF metadata, kept beside the cached tokenizer
_META_FORMAT = 1  # raise when _META's content changes: old cache entries are then built again
CONVERTERS = ("transformers", "tokenizers", "gguf")  # the packages a GGUF vocab's conversion runs


class Tokenizer:
    """The few tokenizer operations the engine needs, with every end-of-sequence id gathered in one set.

    Safe to call from any number of threads: a fast tokenizer is not (concurrent calls fail with "Already
    borrowed"), so each thread works on its own copy, made on its first call from a pristine one. The
    server's request threads then never wait for the engine thread, nor it for them.
    """

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int | None] = ()) -> None:
        self._first = hf_tokenizer  # the loading thread's copy
        self._owner = threading.get_ident()
        self._pristine = copy.deepcopy(hf_tokenizer)  # never used to encode: what other threads copy
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        eos = {int(i) for i in extra_eos_ids if i is not None}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self._eos = frozenset(eos)

    @property
    def _tok(self) -> Any:
        """This thread's fast tokenizer."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            if threading.get_ident() == self._owner:
                tok = self._first
            else:
                with self._copy_lock:
                    tok = copy.deepcopy(self._pristine)
            self._local.tok = tok
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Render with the model's template, then tokenize without adding specials (the template has them).
        ``tools``: function definitions for a template that renders them (Hugging Face's convention).
        ``chat_template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``), as vLLM's
        request field; names the rendering itself uses are refused (``check_template_kwargs``)."""
        extra = check_template_kwargs(chat_template_kwargs)
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("conversation must be a non-empty list of {'role': str, 'content': str} dicts")
        for i, msg in enumerate(conversation):
            if not isinstance(msg, dict):
                raise ValueError(f"message {i} must be a dict, got {type(msg).__name__}")
            for key in ("role", "content"):
                if not isinstance(value := msg.get(key), str):
                    raise ValueError(f"message {i} needs a string {key!r} (got {type(value).__name__})")
        from jinja2 import TemplateError

        try:
            text = self._tok.apply_chat_template(
                list(conversation),
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except TemplateError as e:  # e.g. templates that raise on non-alternating roles
            raise ValueError(f"the chat template rejected the conversation: {e}") from e
        return self.encode(text, add_special_tokens=False)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Size including added tokens (may differ from the model's embedding rows)."""
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def backend_tokenizer(self) -> Any:
        """This thread's ``tokenizers.Tokenizer`` (the Rust one ``decode`` runs), or None."""
        return getattr(self._tok, "backend_tokenizer", None)

    @property
    def clean_up_tokenization_spaces(self) -> bool:
        """Whether ``decode`` rewrites the Rust tokenizer's text (" ." to "." and the like)."""
        return bool(getattr(self._tok, "clean_up_tokenization_spaces", False))


# What a chat template gets from the rendering itself, or what Hugging Face's apply_chat_template reads as
# its own arguments: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def check_template_kwargs(kwargs) -> dict:
    """``chat_template_kwargs`` as the template gets them ({} for None), or ParamError naming the key at
    fault: a dict of string keys, none of them reserved (``RESERVED_TEMPLATE_KWARGS``)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ParamError(
            "chat_template_kwargs", "chat_template_kwargs must be an object of template variables"
        )
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ParamError(
                "chat_template_kwargs", f"chat_template_kwargs key {key!r} is not a variable name"
            )
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ParamError(
                f"chat_template_kwargs.{key}",
                f"chat_template_kwargs cannot set {key!r}: the rendering sets it itself",
            )
    return dict(kwargs)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _json_eos(path: Path) -> list[int]:
    try:
        return _ids(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        return []


def _cache_dir(gguf_path: Path) -> Path:
    """The cache entry of ``gguf_path``'s converted tokenizer: keyed by the file (name, size, mtime) and by
    what converts it, so another version of a converter builds its own entry instead of reusing this one."""
    from hydragen.native.build import cache_dir  # the one folder of every hydragen cache

    st = gguf_path.stat()
    parts = [gguf_path.name, str(st.st_size), str(st.st_mtime_ns), *_converter_versions()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{gguf_path.stem}-{key}"


def _converter_versions() -> list[str]:
    """What the conversion depends on besides the file: transformers converts the vocab, reading it with
    gguf; tokenizers builds and writes the tokenizer; hydragen writes its own file of extra eos ids."""
    return [f"{name}={_installed(name)}" for name in CONVERTERS] + [f"hydragen-meta={_META_FORMAT}"]


def _installed(name: str) -> str:
    try:
        return package_version(name)
    except PackageNotFoundError:  # imported from a path without package metadata: its version is unknown
        return "unknown"


def _save_cache(hf_tokenizer: Any, extra_eos: list[int], target: Path) -> str | None:
    """Write to a temp dir and rename it into place, so readers never see half a tokenizer.

    Returns why the cache could not be written (read-only or full disk), or None. Losing a race to another
    process writing the same entry is not a failure.
    """
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=target.parent)
        hf_tokenizer.save_pretrained(tmp)
        Path(tmp, _META).write_text(json.dumps({"extra_eos_token_ids": extra_eos}))
        os.rename(tmp, target)
        tmp = None
    except OSError as e:
        if not (target / _META).is_file():
            return first_line(e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return None


def _say(message: str) -> None:
    print(f"hydragen: {message}", file=sys.stderr, flush=True)


def _load_gguf(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    cached = _cache_dir(path)
    if (cached / _META).is_file():
        try:
            extra = json.loads((cached / _META).read_text())["extra_eos_token_ids"]
            return Tokenizer(AutoTokenizer.from_pretrained(str(cached), local_files_only=True), extra)
        except Exception:  # a damaged cache entry must not break loading; rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
    from hydragen.model.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    extra = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(k) is not None
    ]
    from hydragen.native.build import CACHE_ENV

    _say(
        f"building the tokenizer cache for {path.name}, once (10-20 s): {cached} "
        f"(set {CACHE_ENV} to keep it elsewhere)"
    )
    start = time.perf_counter()
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises many types for a vocab it cannot convert
        raise ModelFileError(path, f"cannot build a tokenizer from its metadata ({first_line(e)})") from None
    failed = _save_cache(tok, extra, cached)
    took = time.perf_counter() - start
    if failed:
        _say(
            f"tokenizer built in {took:.0f} s, but the cache could not be written ({failed}): "
            "every load will build it again"
        )
    else:
        _say(f"tokenizer cache built in {took:.0f} s; later loads take about a second")
    return Tokenizer(tok, extra)


def has_tokenizer_files(model_path: Path) -> bool:
    """Whether the model has a tokenizer (a .gguf always does; a directory may hold none)."""
    return model_path.suffix == ".gguf" or any(
        (model_path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """Tokenizer for a HF model directory (tokenizer.json; eos ids also from config/generation_config)
    or a .gguf file (converted once, then cached)."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a Hugging Face model dir")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a damaged tokenizer.json / tokenizer_config.json, in any of several ways
        raise ModelFileError(path, f"its tokenizer files cannot be loaded ({first_line(e)})") from None
    return Tokenizer(tok, _json_eos(path / "config.json") + _json_eos(path / "generation_config.json"))
