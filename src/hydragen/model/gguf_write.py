"""Writing Llama GGUF files: a model of any shape in any supported type, with random or given weights.

Two users: the tests (a tiny model in each scheme, checked against the float model) and
``--random-weights PRESET:SCHEME`` (a model of a real shape, e.g. Llama-3.1-8B as Q4_K_M, written block by
block without ever holding the model in memory, then loaded like any downloaded file, by hydragen and by
llama.cpp). Each tensor's type is the one llama-quantize picks for the scheme (``scheme_type``: its
rules for Llama models and the schemes listed in ``SCHEMES``, without an importance matrix), and q/k rows
are stored in llama.cpp's permuted order, so the files are laid out as ``convert_hf_to_gguf.py`` +
``llama-quantize`` lay them out (the quantized values are not llama-quantize's: gguf_quantize.py rounds
more plainly).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np

from hydragen.model.config import ModelConfig
from hydragen.model.gguf_quantize import quantize, random_blocks

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


def scheme_type(scheme: str, name: str, cols: int, layers: int, tied: bool, gqa: int = 1) -> Q:
    """The GGUF type llama-quantize gives tensor ``name`` (a GGUF name, rows of ``cols`` weights) of a Llama
    model of ``layers`` blocks with ``gqa`` query heads per key/value head, for ``scheme``, without an
    importance matrix (llama.cpp's src/llama-quant.cpp, llama_tensor_get_type):

    * norms stay F32; F32, F16 and BF16 files hold every matrix in their type;
    * the output matrix (the embedding too when the two are tied) is Q6_K in every quantized scheme but
      Q8_0 (Q8_0 when its rows do not split into the scheme's blocks);
    * Q4_K_M: Q6_K for attn_v and ffn_down in the first and last eighth of the layers and every third
      between; Q4_K_S: Q5_K for attn_v in layers 0-3 and ffn_down in the first eighth; Q2_K: Q3_K for
      ffn_down and attn_output, and attn_v Q3_K (Q4_K with 4 or more query heads per KV head);
    * a 70B shape (80 layers, grouped KV heads) takes Q5_K for an attn_v that would be Q3_K or Q4_K;
    * a 256-weight type on rows of another length falls back (Q4_K to Q5_0, ...), and to F16 if that does
      not fit either.
    """
    base, _ = SCHEMES[scheme]
    if name.endswith("norm.weight"):
        return Q.F32
    if base in (Q.F32, Q.F16, Q.BF16):
        return base
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    qtype = base
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if not _fits(base, cols):
            qtype = Q.Q8_0
        elif base != Q.Q8_0:
            qtype = Q.Q6_K
    elif name.endswith("attn_v.weight"):
        if scheme == "Q2_K":
            qtype = Q.Q4_K if gqa >= 4 else Q.Q3_K
        elif scheme == "Q4_K_M" and _more_bits(layer, layers):
            qtype = Q.Q6_K
        elif scheme == "Q4_K_S" and layer < 4:
            qtype = Q.Q5_K
        if layers == 80 and gqa > 1 and qtype in (Q.Q3_K, Q.Q4_K):  # llama.cpp's LLM_TYPE_70B
            qtype = Q.Q5_K
    elif name.endswith("ffn_down.weight"):
        if scheme == "Q2_K":
            qtype = Q.Q3_K
        elif scheme == "Q4_K_M" and _more_bits(layer, layers):
            qtype = Q.Q6_K
        elif scheme == "Q4_K_S" and layer < layers // 8:
            qtype = Q.Q5_K
    elif name.endswith("attn_output.weight") and scheme == "Q2_K":
        qtype = Q.Q3_K
    if not _fits(qtype, cols):
        qtype = _FALLBACK.get(qtype, qtype)
        if not _fits(qtype, cols):
            qtype = Q.F16
    return qtype


def model_types(scheme: str, cfg: ModelConfig) -> dict[str, Q]:
    """Every tensor's type in a ``scheme`` file of shape ``cfg`` (GGUF name -> type), as ``scheme_type``."""
    gqa = cfg.num_heads // cfg.num_kv_heads
    return {
        n: scheme_type(scheme, n, s[-1], cfg.num_layers, cfg.tie_word_embeddings, gqa)
        for n, s in tensor_shapes(cfg)
    }


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF q/k row order -> llama.cpp's (the inverse of gguf.unpermute_qk)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, HF-layout shape) of every tensor of a Llama model, in file order."""
    c = cfg
    q, kv, h, inter = (
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    yield "token_embd.weight", (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (h,)
        yield p + "attn_q.weight", (q, h)
        yield p + "attn_k.weight", (kv, h)
        yield p + "attn_v.weight", (kv, h)
        yield p + "attn_output.weight", (h, q)
        yield p + "ffn_norm.weight", (h,)
        yield p + "ffn_gate.weight", (inter, h)
        yield p + "ffn_up.weight", (inter, h)
        yield p + "ffn_down.weight", (h, inter)
    yield "output_norm.weight", (h,)
    if not c.tie_word_embeddings:
        yield "output.weight", (c.vocab_size, h)


# make(GGUF name, HF shape, GGUF type) -> the tensor's bytes (uint8 [rows, row_bytes]) or float32 values
TensorMaker = Callable[[str, tuple[int, ...], Q], np.ndarray]


def write_llama_gguf(
    path: str | Path, cfg: ModelConfig, scheme: str, make: TensorMaker, name: str = ""
) -> Path:
    """Write a Llama GGUF of shape ``cfg``: every tensor's type from ``scheme_type``, its data from ``make``,
    one tensor at a time (a multi-gigabyte file never sits in memory). The tokenizer is the embedded
    model's, cut or padded to the vocabulary."""
    path = Path(path)
    base, ftype = SCHEMES[scheme]
    w = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(w, cfg, ftype, name or path.stem)
    shapes = list(tensor_shapes(cfg))
    types = model_types(scheme, cfg)
    for n, shape in shapes:
        qtype = types[n]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * shape[-1] // block * size
        w.add_tensor_info(n, list(shape), np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for n, shape in shapes:
        w.write_tensor_data(np.ascontiguousarray(make(n, shape, types[n])))
    w.close()
    return path


def float_maker(weights: dict[str, np.ndarray], cfg: ModelConfig) -> TensorMaker:
    """Tensors from HF-layout float arrays keyed by GGUF name: quantized to the scheme's types, q/k rows
    permuted as llama.cpp stores them."""
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}

    def make(name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        w = np.asarray(weights[name], dtype=np.float32).reshape(shape)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in heads:
            w = _permute(w, heads[kind])
        if qtype == Q.F32:
            return w
        return quantize(w.reshape(-1, shape[-1]), qtype)

    return make


def random_maker(seed: int = 0, std: float = 0.02) -> TensorMaker:
    """Random blocks of every type (norms 1): the right bytes for throughput, random values."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        return random_blocks(qtype, shape[0], shape[1], std, rng)

    return make


def _add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, ftype: int, name: str) -> None:
    c = cfg
    w.add_name(name)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, c.vocab_size)


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
        write_llama_gguf(partial, cfg, scheme, random_maker(), f"random {name} {scheme}")
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    size = path.stat().st_size / 1e9
    print(f"hydragen: wrote {size:.2f} GB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path
