"""The accuracy part of ``hydragen bench quant``: how far computing in a GGUF's own format moves the model
from the same file dequantized to float32, over 128 chat prompts.

Compared: hydragen as it runs by default (15-bit activations, a float16 KV cache), with a float32 KV cache,
and with int8 activations (llama.cpp's choice), each against the float32-dequantized model
(``LLM(dequantize=True)``, float32 K/V) and, where ``llama-cpp-python`` is installed, against llama.cpp's
logits on the same file; and llama.cpp against the float32-dequantized model. llama.cpp runs in a process of
its own (bench/peers/peer_process.py): if it crashes, its rows are left out and the part goes on. The
logits of every prompt position come from one forward without the engine's cache, with K/V rounded to the
engine's cache dtype, as the cache would hold them.

Per prompt, every model fed the same prompt tokens: KL(reference || model) of the
next-token distribution at every prompt position and at the last one (the first generated token), and
whether the most likely token agrees. Then 32 greedy tokens from each model: the fraction of prompts whose
whole continuation is the reference's, and how many leading tokens agree on average.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hydragen.bench.core.stats import percentile

TOPICS = [
    "owls",
    "volcanoes",
    "the moon",
    "bread",
    "chess",
    "rainbows",
    "bicycles",
    "honey bees",
    "glaciers",
    "the violin",
    "tea",
    "lighthouses",
    "octopuses",
    "the printing press",
    "deserts",
    "coral reefs",
    "electricity",
    "paper",
    "the Roman Empire",
    "sleep",
    "maps",
    "comets",
    "gardening",
    "the internet",
    "penguins",
    "clocks",
    "rivers",
    "photosynthesis",
    "trains",
    "mushrooms",
    "the ocean",
    "friendship",
]
TEMPLATES = [
    "Explain {} in two sentences.",
    "Write a short poem about {}.",
    "What are three facts about {}?",
    "Give a beginner one piece of advice about {}.",
]


def chat_prompts(tokenizer, count: int = 128) -> list[list[int]]:
    """``count`` chat prompts (topics x templates, through the model's chat template) as token ids."""
    texts = [t.format(topic) for t in TEMPLATES for topic in TOPICS][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts]


@contextlib.contextmanager
def env_setting(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the previous value (or none) after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def llm_with_act_bits(model, bits: int, kv_tokens: int, kv_cache_dtype: str = "auto"):
    """An LLM whose quantized projections quantize activations to ``bits`` (15 or 8) bits."""
    from hydragen import LLM

    with env_setting("HYDRAGEN_QUANT_ACT_BITS", str(bits)):  # read when the projections are built
        return LLM(model, kv_cache_tokens=kv_tokens, kv_cache_dtype=kv_cache_dtype)


def plain_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one prompt's own tokens (no KV cache): runs a model outside the engine."""
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(g, 1).transpose(0, 1),
        v.repeat_interleave(g, 1).transpose(0, 1),
        is_causal=True,
    )
    return out.transpose(0, 1)


def model_logits(llm) -> Callable[[list[int]], torch.Tensor]:
    """Logits [T, V] (float32) of hydragen's model at every position of a prompt, K/V rounded to the dtype
    of the engine's cache."""
    kv = llm.engine.pool.k.dtype

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return plain_attention(layer, q, k.to(kv).to(k.dtype), v.to(kv).to(v.dtype))

    def run(ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids)
        net = llm.model
        return net.logits(net(t, torch.arange(len(ids)), attention)).float()

    return run


class LlamaCppLogits:
    """llama.cpp's logits at every position of a prompt (llama-cpp-python's ``Llama``, every row kept), built
    in the peer's process."""

    def __init__(self, path) -> None:
        import llama_cpp

        self.path = path
        self.model = llama_cpp.Llama(
            str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=torch.get_num_threads()
        )

    def __call__(self, ids: list[int]) -> np.ndarray:
        self.model.reset()
        self.model.eval(ids)
        return np.array(self.model.scores[: len(ids)], dtype=np.float32)


def llamacpp_outputs(logits: LlamaCppLogits, prompts: list[list[int]], tokens: int):
    """(llama.cpp's logits of each prompt, its greedy continuations), in the peer's process."""
    return [logits(p) for p in prompts], greedy_llamacpp(logits.path, prompts, tokens)


def llamacpp_reference(path, prompts: list[list[int]], tokens: int, progress: Callable[[str], None]):
    """(llama.cpp's (logits of each prompt, greedy continuations), None), or (None, why it did not run): not
    installed, or crashed (it runs in a process of its own, so the part goes on without it)."""
    from hydragen.bench.peers import llamacpp_peer
    from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess

    why = llamacpp_peer.unavailable(path, False)
    if why is not None:
        return None, why
    progress("accuracy: llama.cpp")
    try:
        with PeerProcess("llama.cpp", LlamaCppLogits, path) as peer:
            logits, greedy = peer.call(llamacpp_outputs, prompts, tokens)
    except PeerCrashed as e:
        progress(f"accuracy: {e}; the rows against llama.cpp are left out")
        return None, str(e)
    return ([torch.from_numpy(x) for x in logits], greedy), None


def greedy_llm(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from hydragen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_llamacpp(path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from hydragen.bench.peers.llamacpp_peer import Peer

    peer = Peer(path, max(len(p) for p in prompts), tokens, 1)
    return [peer.generate(p, 1, tokens)[0] for p in prompts]


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """KL(reference || other) per position and top-1 agreement, over all positions and the last one."""
    p, q = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = (reference.argmax(-1) == other.argmax(-1)).double()
    return {
        "kl_all": float(kl.mean()),
        "kl_last": float(kl[-1]),
        "top1_all": float(agree.mean()),
        "top1_last": float(agree[-1]),
    }


def continuation_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(fraction of identical continuations, mean number of leading tokens that agree)."""
    same, lead = 0, []
    for a, b in zip(reference, other, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        lead.append(n)
    return same / len(reference), float(np.mean(lead))


def run(
    model, count: int, tokens: int, progress: Callable[[str], None], skipped: dict | None = None
) -> list[dict]:
    """Rows: each hydragen engine (activation width, KV cache) against the float32 reference and llama.cpp,
    and llama.cpp against the float32 reference (see the module docstring). ``skipped`` gets why llama.cpp
    did not run (not installed, or crashed)."""
    from hydragen import LLM

    reference = LLM(model, dequantize=True, kv_cache_tokens=16384)
    prompts = chat_prompts(reference.tokenizer, count)
    progress(f"accuracy: {len(prompts)} prompts, float32 reference")
    float32 = ([model_logits(reference)(p) for p in prompts], greedy_llm(reference, prompts, tokens))
    path = reference.model_path
    del reference
    llamacpp, why = llamacpp_reference(path, prompts, tokens, progress)
    if why is not None and skipped is not None:
        skipped["llamacpp"] = why
    rows = []
    engines = (
        (15, "auto", "hydragen, 15-bit activations, float16 KV cache (default)"),
        (15, "float32", "hydragen, 15-bit activations, float32 KV cache"),
        (8, "auto", "hydragen, int8 activations, float16 KV cache"),
    )
    for bits, kv_dtype, name in engines:
        llm = llm_with_act_bits(model, bits, 16384, kv_cache_dtype=kv_dtype)
        progress(f"accuracy: {name}")
        run_logits = model_logits(llm)
        got = ([run_logits(p) for p in prompts], greedy_llm(llm, prompts, tokens))
        rows.append(_row(name, "float32 dequantized", float32, got, tokens))
        if llamacpp is not None:
            rows.append(_row(name, "llama.cpp", llamacpp, got, tokens))
        del llm, got
    if llamacpp is not None:
        rows.append(_row("llama.cpp", "float32 dequantized", float32, llamacpp, tokens))
    return rows


def _row(name: str, ref_name: str, reference: tuple, got: tuple, tokens: int) -> dict:
    """``reference`` and ``got``: (logits per prompt, greedy continuation per prompt)."""
    per = [compare(r, g) for r, g in zip(reference[0], got[0], strict=True)]
    same, lead = continuation_agreement(reference[1], got[1])
    kl_last = np.array([x["kl_last"] for x in per])
    return {
        "model": name,
        "reference": ref_name,
        "prompts": len(per),
        "KL mean (all positions)": float(np.mean([x["kl_all"] for x in per])),
        "KL mean (next token)": float(kl_last.mean()),
        "KL p99 (next token)": percentile(kl_last, 99),
        "top-1 agreement (all positions)": float(np.mean([x["top1_all"] for x in per])),
        "top-1 agreement (next token)": float(np.mean([x["top1_last"] for x in per])),
        f"identical {tokens}-token greedy continuations": same,
        "mean agreeing greedy tokens": lead,
    }
