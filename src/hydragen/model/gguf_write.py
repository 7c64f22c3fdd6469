"""Writing GGUF files of any registered family: a model of any shape in any supported type, with random or
given weights.

Two users: the tests (a tiny model in each scheme, checked against the float model) and
``--random-weights PRESET:SCHEME`` (a model of a real shape, e.g. Llama-3.1-8B or Qwen3-8B as Q4_K_M,
written block by block without ever holding the model in memory, then loaded like any downloaded file, by
hydragen and by llama.cpp). The layout is the family's (``Family.gguf_tensors``: llama.cpp's architecture
and tensor names, q/k rows permuted only where the family says so, its extra tensors such as Qwen3's
``attn_q_norm``; ``Family.gguf_metadata``: its extra keys), the same maps the reader reads files by. Each
tensor's type is the one llama-quantize picks for the scheme (``scheme_type``: its rules, by tensor
category as llama.cpp's src/llama-quant.cpp assigns them, for the schemes listed in ``SCHEMES``, without an
importance matrix), so the files are laid out as ``convert_hf_to_gguf.py`` + ``llama-quantize`` lay them
out (the quantized values are not llama-quantize's: gguf_quantize.py rounds more plainly).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from hydragen.model.config import ModelConfig
from hydragen.model.family import Family
from hydragen.model.gguf_quantize import quantize, random_blocks
from hydragen.model.registry import family_named

Q = gguf.GGMLQuantizationType
# name -> (default type, llama.cpp's ftype id for general.file_type)
SCHEMES: dict[str, tuple[Q, int]] = {
    "F32": (Q.F32, 0),
    "F16": (Q.F16, 1),
    "BF16": (Q.BF16, 32),
    "Q4_0": (Q.Q4_0, 2),
    "Q4_1": (Q.Q4_1, 3),
    "Q5_0": (Q.Q5_0, 8),
    "Q5_1": (Q.Q5_1, 9),
    "Q8_0": (Q.Q8_0, 7),
    "Q2_K": (Q.Q2_K, 10),
    "Q3_K_S": (Q.Q3_K, 11),
    "Q4_K_S": (Q.Q4_K, 14),
    "Q4_K_M": (Q.Q4_K, 15),
    "Q5_K_S": (Q.Q5_K, 16),
    "Q6_K": (Q.Q6_K, 18),
}
# A 256-weight type on rows of another length falls back as llama-quantize does.
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fits(qtype: Q, cols: int) -> bool:
    return cols % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def _category(name: str) -> str:
    """llama-quantize's category of a tensor, from its name alone (tensor_get_category): a fused
    ``attn_qkv`` counts as ``attn_v``, whatever the architecture."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, category in (
        ("attn_qkv.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return category
    return "other"


def writer_family(cfg: ModelConfig) -> Family:
    """The family whose GGUF layout a model of ``cfg`` is written in (its own, or the one it converts to)."""
    family = family_named(cfg.family)
    if family.gguf_architecture is None:
        if not family.gguf_family:
            raise ValueError(f"family {family.name} has no GGUF form")
        family = family_named(family.gguf_family)
    return family


def scheme_type(
    scheme: str,
    name: str,
    cols: int,
    layers: int,
    tied: bool,
    gqa: int = 1,
    *,
    family: Family | None = None,
    ndim: int = 2,
) -> Q:
    """The GGUF type llama-quantize gives tensor ``name`` (a GGUF name, ``ndim`` dimensions, rows of ``cols``
    weights) of a model of ``family`` (default Llama) with ``layers`` blocks and ``gqa`` query heads per
    key/value head, for ``scheme``, without an importance matrix (llama.cpp's src/llama-quant.cpp,
    llama_tensor_get_type). The rules go by tensor category, not by architecture, except for the 70B shape:

    * vectors (norms, QK-norms, biases) stay F32, as convert_hf_to_gguf.py writes them and llama-quantize
      leaves them; F32, F16 and BF16 files hold every matrix in their type;
    * the output matrix (the embedding too when the two are tied) is Q6_K in every quantized scheme but
      Q8_0 (Q8_0 when its rows do not split into the scheme's blocks);
    * Q4_K_M: Q6_K for attn_v (or a fused attn_qkv) and ffn_down in the first and last eighth of the layers
      and every third between; Q4_K_S: Q5_K for attn_v in layers 0-3 and ffn_down in the first eighth; Q2_K:
      Q3_K for ffn_down and attn_output, and attn_v Q3_K (Q4_K with 4 or more query heads per KV head);
    * a shape llama.cpp types 70B (``Family.gguf_quant_70b``: Llama's 80 layers with grouped KV heads,
      Qwen2's 80 layers; never Qwen3) takes Q5_K for an attn_v that would be Q3_K or Q4_K;
    * a 256-weight type on rows of another length falls back (Q4_K to Q5_0, ...), and to F16 if that does
      not fit either.
    """
    base, _ = SCHEMES[scheme]
    if ndim < 2 or not name.endswith(".weight") or name.endswith("_norm.weight"):
        return Q.F32
    if base in (Q.F32, Q.F16, Q.BF16):
        return base
    family = family or family_named("llama")
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    category = _category(name)
    qtype = base
    if category == "output" or (tied and category == "token_embd"):
        if not _fits(base, cols):
            qtype = Q.Q8_0
        elif base != Q.Q8_0:
            qtype = Q.Q6_K
    elif category == "attn_v":
        if scheme == "Q2_K":
            qtype = Q.Q4_K if gqa >= 4 else Q.Q3_K
        elif scheme == "Q4_K_M" and _more_bits(layer, layers):
            qtype = Q.Q6_K
        elif scheme == "Q4_K_S" and layer < 4:
            qtype = Q.Q5_K
        if family.gguf_quant_70b(layers, gqa) and qtype in (Q.Q3_K, Q.Q4_K):
            qtype = Q.Q5_K
    elif category == "ffn_down":
        if scheme == "Q2_K":
            qtype = Q.Q3_K
        elif scheme == "Q4_K_M" and _more_bits(layer, layers):
            qtype = Q.Q6_K
        elif scheme == "Q4_K_S" and layer < layers // 8:
            qtype = Q.Q5_K
    elif category == "attn_output" and scheme == "Q2_K":
        qtype = Q.Q3_K
    if not _fits(qtype, cols):
        qtype = _FALLBACK.get(qtype, qtype)
        if not _fits(qtype, cols):
            qtype = Q.F16
    return qtype


def model_types(scheme: str, cfg: ModelConfig) -> dict[str, Q]:
    """Every tensor's type in a ``scheme`` file of shape ``cfg`` (GGUF name -> type), as ``scheme_type``."""
    gqa = cfg.num_heads // cfg.num_kv_heads
    family = writer_family(cfg)
    return {
        n: scheme_type(
            scheme, n, s[-1], cfg.num_layers, cfg.tie_word_embeddings, gqa, family=family, ndim=len(s)
        )
        for n, s in tensor_shapes(cfg)
    }


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF q/k row order -> llama.cpp's (the inverse of gguf.unpermute_qk)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, HF-layout shape) of every tensor of a model of shape ``cfg``, in file order."""
    for name, _, shape in writer_family(cfg).gguf_tensors(cfg):
        yield name, shape


# make(GGUF name, HF shape, GGUF type) -> the tensor's bytes (uint8 [rows, row_bytes]) or float32 values
TensorMaker = Callable[[str, tuple[int, ...], Q], np.ndarray]


def write_gguf(path: str | Path, cfg: ModelConfig, scheme: str, make: TensorMaker, name: str = "") -> Path:
    """Write a GGUF of shape ``cfg`` in its family's layout: every tensor's type from ``scheme_type``, its
    data from ``make``, one tensor at a time (a multi-gigabyte file never sits in memory). The tokenizer is
    the embedded model's, cut or padded to the vocabulary."""
    path = Path(path)
    _, ftype = SCHEMES[scheme]
    family = writer_family(cfg)
    w = gguf.GGUFWriter(str(path), family.gguf_architecture)
    _add_metadata(w, cfg, family, ftype, name or path.stem)
    extra = {n: np.asarray(v, np.float32) for n, v in family.gguf_extra_tensors(cfg).items()}
    shapes = list(tensor_shapes(cfg))
    types = model_types(scheme, cfg)
    for n, values in extra.items():
        w.add_tensor_info(n, list(values.shape), np.dtype(np.float32), values.nbytes, raw_dtype=Q.F32)
    for n, shape in shapes:
        qtype = types[n]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * shape[-1] // block * size
        w.add_tensor_info(n, list(shape), np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for values in extra.values():
        w.write_tensor_data(np.ascontiguousarray(values))
    for n, shape in shapes:
        w.write_tensor_data(np.ascontiguousarray(make(n, shape, types[n])))
    w.close()
    return path


def float_maker(weights: dict[str, np.ndarray], cfg: ModelConfig) -> TensorMaker:
    """Tensors from HF-layout float arrays keyed by GGUF name, holding the values the GGUF holds (a Gemma norm
    as 1 + w): quantized to the scheme's types, q/k rows permuted where the family's llama.cpp files are."""
    permuted = writer_family(cfg).gguf_permuted_qk
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if permuted else {}

    def make(name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        w = np.asarray(weights[name], dtype=np.float32).reshape(shape)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in heads:  # weights and biases alike, as the converter and the reader do
            w = _permute(w, heads[kind])
        if qtype == Q.F32:
            return w
        return quantize(w.reshape(-1, shape[-1]), qtype)

    return make


def checkpoint_maker(state_dict: dict[str, Any], cfg: ModelConfig) -> TensorMaker:
    """Tensors from a Hugging Face checkpoint's state dict (HF names and values, torch or numpy), as
    convert_hf_to_gguf.py writes them: each GGUF tensor is the HF tensor the reader maps it to
    (``Family.hf_name``), norms plus the family's ``hf_norm_offset`` (llama.cpp stores Gemma's 1 + w)."""
    family = writer_family(cfg)
    offset = family_named(cfg.family).hf_norm_offset
    weights = {}
    for g, hf, shape in family.gguf_tensors(cfg):
        t = state_dict[hf]
        w = (t.detach().float().numpy() if hasattr(t, "detach") else np.asarray(t, np.float32)).reshape(shape)
        weights[g] = w + offset if len(shape) == 1 and g.endswith(".weight") else w
    return float_maker(weights, cfg)


def random_maker(seed: int = 0, std: float = 0.02) -> TensorMaker:
    """Random blocks of every type (norms 1, biases 0): the right bytes for throughput, random values."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        if len(shape) == 1:
            return (np.zeros if name.endswith(".bias") else np.ones)(shape, np.float32)
        return random_blocks(qtype, shape[0], shape[1], std, rng)

    return make


def _add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, family: Family, ftype: int, name: str) -> None:
    """The keys convert_hf_to_gguf.py writes for every architecture (TextModel.set_gguf_parameters, with
    head_dim given), then the family's own (``Family.gguf_metadata``), then the tokenizer."""
    c = cfg
    w.add_name(name)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    if c.rope_scaling and c.rope_scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(c.rope_scaling["factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    for key, value in family.gguf_metadata(c).items():
        _add_value(w, f"{family.gguf_architecture}.{key}", value)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, c.vocab_size)


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """A metadata value in the type llama.cpp reads it as: int uint32, float float32, lists as arrays."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list | tuple):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF metadata {key!r}: cannot write a {type(value).__name__}")


def _add_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """The embedded model's GPT-2-style BPE, fitted to ``vocab`` tokens: padded with tokens no merge makes,
    or cut with the merges that need a cut token dropped."""
    from hydragen.model.default_model import default_model_path
    from hydragen.model.gguf import open_gguf

    fields = open_gguf(default_model_path()).fields
    get = lambda key: fields[key].contents()  # noqa: E731
    tokens, types, merges = (
        get("tokenizer.ggml.tokens"),
        get("tokenizer.ggml.token_type"),
        get("tokenizer.ggml.merges"),
    )
    if vocab >= len(tokens):
        extra = vocab - len(tokens)
        tokens = tokens + [f"<|hydragen_pad_{i}|>" for i in range(extra)]
        types = types + [int(gguf.TokenType.NORMAL)] * extra
    else:
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [
            m
            for m in merges
            if (parts := m.split(" "))[0] in kept and parts[1] in kept and "".join(parts) in kept
        ]
    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    w.add_unk_token_id(get("tokenizer.ggml.unknown_token_id"))
    w.add_pad_token_id(get("tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(get("tokenizer.chat_template"))


def random_gguf_file(spec: str) -> Path:
    """The random-weights GGUF for ``PRESET:SCHEME`` (``llama-3.1-8b:Q4_K_M``, or a config.json's path and a
    scheme), written once into hydragen's cache (``$HYDRAGEN_CACHE_DIR/random-gguf``) and reused."""
    import hashlib
    import json
    import sys
    import time

    from hydragen.model.presets import config_for_random_weights
    from hydragen.native.build import cache_dir

    shape, _, scheme = spec.rpartition(":")
    scheme = scheme.upper()
    if scheme not in SCHEMES:
        raise ValueError(f"random-weights quantization {scheme!r} is not one of {', '.join(SCHEMES)}")
    hf_cfg, name = config_for_random_weights(shape)
    cfg = ModelConfig.from_hf(hf_cfg)
    # The shape and every tensor's type: a file written under other type rules is not reused.
    types = {n: t.name for n, t in model_types(scheme, cfg).items()}
    key = hashlib.sha256(json.dumps([hf_cfg, types], sort_keys=True).encode()).hexdigest()[:8]
    path = cache_dir() / "random-gguf" / f"{name}-{key}.{scheme}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"hydragen: writing a random-weights {scheme} GGUF of {name}'s shape, once: {path}", file=sys.stderr
    )
    start = time.perf_counter()
    partial = path.with_suffix(f".partial{os.getpid()}")
    try:
        write_gguf(partial, cfg, scheme, random_maker(), f"random {name} {scheme}")
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    size = path.stat().st_size / 1e9
    print(f"hydragen: wrote {size:.2f} GB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path
