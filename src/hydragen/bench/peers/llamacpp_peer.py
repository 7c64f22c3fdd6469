"""llama.cpp as an end-to-end peer, through llama-cpp-python's low-level API, set up as llama.cpp's own
``batched`` example: the prompt is evaluated once for sequence 0, its KV cells are shared with every other
sequence (``llama_memory_seq_cp`` on a unified KV cache tags cells, it copies nothing), then all n
sequences decode together, one llama_decode per step.

llama.cpp runs the GGUF's quantized weights (Q4_1 for the embedded model) with an f16 KV cache: the
comparison is engine against engine on the same file, not kernel against kernel.

Tokens are drawn as the batched example draws them, with a llama.cpp sampler chain per sequence and step
(``llama_sampler_sample`` on that sequence's logits), built from the settings hydragen runs with
(``sampling``, in SamplingParams' terms): the same distribution, so both engines pay for the same sampling.
Temperature 0 (or no settings) picks greedily from the logits.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from collections.abc import Mapping

import numpy as np
import torch


def unavailable(model, random_weights: bool) -> str | None:
    """Why the peer cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    if random_weights:
        return "needs real GGUF weights"
    from hydragen.model.loader import resolve_model_path

    if resolve_model_path(model).suffix != ".gguf":
        return "needs a .gguf model"
    return None


def sampler_chain(L, sampling: Mapping | None, vocab: int | None = None):
    """A llama.cpp sampler chain drawing from the distribution hydragen's SamplingParams define, or None for
    greedy (no settings, or temperature 0). In hydragen's (and vLLM's) order (engine/truncation.py): the
    temperature, then on the tempered probabilities min_p, top_k, and top_p over what those two kept, then a
    seeded draw. Settings that change nothing add no stage (a top_k of the whole ``vocab`` or more included).
    """
    if not sampling:
        return None
    settings = dict(sampling)
    temperature = float(settings.get("temperature", 1.0))  # SamplingParams' default
    if temperature == 0:
        return None
    top_k = int(settings.get("top_k") or 0)
    if vocab is not None and top_k >= vocab:
        top_k = 0  # keeps every token, as hydragen reads it (and a C int would wrap a huge one)
    stages = [
        (temperature != 1.0, lambda: L.llama_sampler_init_temp(temperature)),
        ((min_p := float(settings.get("min_p") or 0.0)) > 0, lambda: L.llama_sampler_init_min_p(min_p, 1)),
        (top_k > 0, lambda: L.llama_sampler_init_top_k(top_k)),
        ((top_p := float(settings.get("top_p", 1.0))) < 1.0, lambda: L.llama_sampler_init_top_p(top_p, 1)),
        (True, lambda: L.llama_sampler_init_dist(int(settings.get("seed") or 0))),
    ]
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for wanted, make in stages:
        if wanted:
            L.llama_sampler_chain_add(chain, make())  # the chain owns each stage from here
    return chain


class Peer:
    """One llama.cpp context sized for the longest prompt and the largest n of the sweep."""

    def __init__(
        self,
        model,
        max_prompt: int,
        max_new: int,
        max_n: int,
        cells: int | None = None,
        sampling: Mapping | None = None,
    ):
        """``cells``: KV cells to hold (default: one prompt shared by ``max_n`` sequences of ``max_new``
        tokens each; distinct prompts need each prompt's cells). ``sampling``: hydragen's settings
        (temperature, top_p, top_k, min_p, seed) for llama.cpp's sampler chain; greedy without."""
        import llama_cpp as L

        from hydragen.model.loader import resolve_model_path

        self.L = L
        L.llama_backend_init()
        L.llama_log_set(_silent, ctypes.c_void_p(0))
        self.model = L.llama_model_load_from_file(
            str(resolve_model_path(model)).encode(), L.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError("llama.cpp could not load the model")
        cp = L.llama_context_default_params()
        cp.n_ctx = cells or max_prompt + max_n * max_new + 64
        cp.n_batch = cp.n_ubatch = min(max(max_prompt, max_n), 2048)
        cp.n_seq_max = max_n
        cp.kv_unified = True  # one cell pool shared by all sequences: the prompt's cells are shared
        cp.n_threads = cp.n_threads_batch = torch.get_num_threads()
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = cp.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, max_n)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.sampler = sampler_chain(L, sampling, self.vocab)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], want: list[bool]) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, w) in enumerate(zip(tokens, positions, seqs, want, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, w
            b.seq_id[i][0] = s
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (KV cache too small?)")

    def _logits(self, rows: int) -> np.ndarray:
        ptr = self.L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(rows, self.vocab))

    def _pick(self, rows: int) -> list[int]:
        """A token from each of the last decode's ``rows`` logits rows (every token of the batch wanted its
        logits)."""
        if self.sampler is None:
            return self._logits(rows).argmax(axis=1).tolist()
        return [int(self.L.llama_sampler_sample(self.sampler, self.ctx, i)) for i in range(rows)]

    def _prefill(self, prompt: list[int], seq: int, draws: int = 1) -> list[int]:
        """The prompt as sequence ``seq``; ``draws`` first tokens from its last logits, one for each sequence
        that will continue it (each drawn on its own, as the batched example does)."""
        for start in range(0, len(prompt), self.n_batch):
            chunk = prompt[start : start + self.n_batch]
            pos = list(range(start, start + len(chunk)))
            self._decode(chunk, pos, [seq] * len(chunk), [p == len(prompt) - 1 for p in pos])
        if self.sampler is None:
            return [int(self._logits(1)[0].argmax())] * draws
        # -1: the last decode's only output row, wherever its token sat in the batch
        return [int(self.L.llama_sampler_sample(self.sampler, self.ctx, -1)) for _ in range(draws)]

    def _continue(self, out: list[list[int]], lengths: list[int], tokens: int) -> list[list[int]]:
        """Sequence s (its prompt ``lengths[s]`` long, its first token in ``out[s]``) to ``tokens`` tokens,
        one llama_decode for all of them a step."""
        n = len(out)
        for step in range(1, tokens):
            positions = [length + step - 1 for length in lengths]
            self._decode([o[-1] for o in out], positions, list(range(n)), [True] * n)
            for o, t in zip(out, self._pick(n), strict=True):
                o.append(int(t))
        return out

    def generate(self, prompt: list[int], n: int, tokens: int) -> list[list[int]]:
        """n completions of one prompt: evaluated once, its cells shared by every sequence."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        firsts = self._prefill(prompt, 0, n)
        mem = L.llama_get_memory(self.ctx)
        for s in range(1, n):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        return self._continue([[t] for t in firsts], [len(prompt)] * n, tokens)

    def generate_prompts(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        """One completion of each prompt, each its own sequence: a server's distinct requests."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        firsts = [self._prefill(prompt, s)[0] for s, prompt in enumerate(prompts)]
        return self._continue([[t] for t in firsts], [len(p) for p in prompts], tokens)

    def __del__(self):
        try:
            if getattr(self, "sampler", None) is not None:  # None too when __init__ failed before it
                self.L.llama_sampler_free(self.sampler)
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.L.llama_model_free(self.model)
        except Exception:
            pass


def timer(peer: Peer, prompt: list[int], n: int, tokens: int) -> float:
    return _timed(lambda: peer.generate(prompt, n, tokens), n, tokens)


def timer_prompts(peer: Peer, prompts: list[list[int]], tokens: int) -> float:
    """``timer`` for one completion of each of several prompts."""
    return _timed(lambda: peer.generate_prompts(prompts, tokens), len(prompts), tokens)


def _timed(generate, sequences: int, tokens: int) -> float:
    """Seconds ``generate`` takes, checking it gave ``sequences`` sequences of ``tokens`` tokens."""
    t0 = time.perf_counter()
    out = generate()
    elapsed = time.perf_counter() - t0
    assert len(out) == sequences and all(len(o) == tokens for o in out)
    return elapsed


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _silent(level, text, user_data) -> None:
    """llama.cpp logs every load to stderr; the benchmark prints its own progress."""
