"""Batched sampling: greedy, temperature, min_p, top_k, top_p and logprobs, reproducible per sequence.

Each sequence draws one uniform per step from a hash of (its seed, its step), so a sequence's samples
depend only on its own seed and history, never on which other sequences share the batch: seeded runs
reproduce exactly with sharing on or off and at any batch size, and the n samples of one prompt (seeds
derived from (seed, index)) differ. Every draw is an inverse CDF over the kept tokens taken in ascending
token id. Rows without truncation use the whole vocabulary's CDF; rows with min_p / top_k / top_p use
the exact candidate method of :mod:`hydragen.engine.truncation`, which never sorts the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydragen.engine.truncation import block_maxima, pad_to_blocks, sample_truncated, top_values
from hydragen.native import build as native_build

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


_SEED_SALT = 0x5BD1E995  # arbitrary odd constants: keep 0 inputs away from mix32's fixed point 0
_STEP_SALT = 0x27D4EB2F
SMALL_BATCH = 64  # up to this many rows, the uniforms are hashed with Python ints


def _uniform_bits_int(seed: int, step: int) -> int:
    """Sampler.uniform_bits for one row, on Python ints (the tensor version's int64 arithmetic, whose
    wrap-around the masks make exact)."""
    mixed = _mix32_int((seed ^ _SEED_SALT) & _M32) ^ ((step * 0xC2B2AE3D + _STEP_SALT) & _M32)
    return _mix32_int(mixed) >> 8


def derive_seed(seed: int, index: int) -> int:
    """Seed (32-bit) of sample ``index`` of a request seeded with ``seed`` (any Python int)."""
    folded = _mix32_int((seed ^ _SEED_SALT) & _M32) ^ _mix32_int(((seed >> 32) ^ _STEP_SALT) & _M32)
    return _mix32_int(folded ^ ((index * 0x9E3779B1 + _STEP_SALT) & _M32))


@dataclass
class SampleOutput:
    """Sampled tokens and, when asked for, log-probabilities under the raw (untempered) logits."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] of the sampled tokens
    top_ids: torch.Tensor | None = None  # [B, n] most likely tokens, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, n]


class Sampler:
    """Samples one token per row; keeps two vocabulary-wide work buffers between calls, because fresh
    buffers of that size are fresh pages from the OS on every step (costlier than the softmax itself).

    On CPU a sampling step without logprobs is one C++ call (``native/csrc/sampling.cpp``: sample_step),
    the same arithmetic as the tensor code below, which stays as its twin (``native=False``) and serves
    every other case.
    """

    def __init__(self, native: bool = True) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._off: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.native = native

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A [rows, V] buffer shaped like ``like``; grown, never shrunk, so batch sizes can vary."""
        buf = self._buffers.get(name)
        fits = buf is not None and buf.shape[0] >= like.shape[0] and buf.shape[1:] == like.shape[1:]
        if not fits or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self._buffers[name] = buf
        return buf[: like.shape[0]]

    def _off_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """top_k 0, top_p 1 and min_p 0 for ``rows`` rows (kept per batch size: the op only reads them)."""
        off = self._off.get(rows)
        if off is None:
            zeros = torch.zeros(rows)
            off = self._off[rows] = (zeros.long(), zeros + 1, zeros)
        return off

    def _softmax(self, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """softmax(logits / scale) in the "probs" buffer (valid until the next call)."""
        if not bool((scale == 1).all()):
            logits = torch.div(logits, scale.unsqueeze(1), out=self._buffer("scratch", logits))
        return torch.ops.aten._softmax.out(logits, -1, False, out=self._buffer("probs", logits))

    def uniform_bits(self, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """[B] int64 in [0, 2**24): the 24 random bits of each row's uniform for this step."""
        # Offsets before each mix: mix32(0) == 0, so without them seed 0 at step 0 would draw u ~ 0
        # (always the lowest-id token with any probability).
        if seeds.numel() <= SMALL_BATCH and seeds.device.type == "cpu":  # a dozen tensor ops cost more
            bits = [_uniform_bits_int(a, b) for a, b in zip(seeds.tolist(), steps.tolist(), strict=True)]
            return torch.tensor(bits, dtype=torch.long)
        return mix32(mix32((seeds ^ _SEED_SALT) & _M32) ^ (steps * 0xC2B2AE3D + _STEP_SALT & _M32)) >> 8

    def uniforms(self, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """[B] uniforms strictly inside (0, 1) (24 bits, exact in fp32) from seeds and step counters."""
        return (self.uniform_bits(seeds, steps).float() + 0.5) * (1.0 / 16777216.0)

    def __call__(
        self,
        logits,
        temperature,
        top_k,
        top_p,
        seeds,
        steps,
        any_random: bool,
        any_top_k: bool,
        any_top_p: bool,
        min_p: torch.Tensor | None = None,
        any_min_p: bool = False,
    ) -> torch.Tensor:
        """logits [B, V] fp32; per-row tensors [B]. Returns sampled token ids [B] (int64)."""
        return self.sample(
            logits,
            temperature,
            top_k,
            top_p,
            seeds,
            steps,
            any_random,
            any_top_k,
            any_top_p,
            min_p,
            any_min_p,
        ).tokens

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
        any_random: bool,
        any_top_k: bool,
        any_top_p: bool,
        min_p: torch.Tensor | None = None,
        any_min_p: bool = False,
        num_logprobs: int | None = None,
    ) -> SampleOutput:
        """Like ``__call__``; with ``num_logprobs`` (0 = the sampled token's only) also logprobs.

        Temperature 0 is greedy (argmax). The flags say whether any row is random / uses top_k / top_p /
        min_p, so a batch that uses none of them skips their work.
        """
        native = self.native and _op_dtypes(temperature, top_k, top_p, min_p)
        if any_random and num_logprobs is None and native:
            op = _sample_step_op(logits)
            if op is not None:
                # A feature no row uses is off for every row, as in the tensor code below.
                no_top_k, no_top_p, no_min_p = self._off_rows(logits.shape[0])
                return SampleOutput(
                    op(
                        logits,
                        temperature.contiguous(),
                        top_k.contiguous() if any_top_k else no_top_k,
                        top_p.contiguous() if any_top_p else no_top_p,
                        min_p.contiguous() if any_min_p and min_p is not None else no_min_p,
                        self.uniform_bits(seeds, steps).contiguous(),
                        self._buffer("scratch", logits),
                        self._buffer("probs", logits),
                    )
                )
        batch, vocab = logits.shape
        random_rows = temperature > 0
        tokens = torch.empty(batch, dtype=torch.long, device=logits.device) if any_random else _argmax(logits)
        probs = maxima = None
        if any_random or num_logprobs is not None:
            # Greedy rows get temperature 1 here, which is what their logprobs need.
            scale = torch.where(random_rows, temperature, torch.ones_like(temperature))
            probs = pad_to_blocks(self._softmax(logits, scale))
        if any_random:
            greedy = _rows_where(~random_rows)
            if greedy.numel():
                tokens[greedy] = _argmax(logits[greedy])
            truncated = torch.zeros_like(random_rows)
            if any_top_p:
                truncated |= top_p < 1
            if any_top_k:
                truncated |= (top_k > 0) & (top_k < vocab)
            if any_min_p and min_p is not None:
                truncated |= min_p > 0
            bits = self.uniform_bits(seeds, steps)
            plain = random_rows & ~truncated
            if bool(plain.any()):
                rows = None if bool(plain.all()) else _rows_where(plain)  # None: all rows, no copies
                plain_probs = _take(probs, rows)[:, :vocab]
                cdf = torch.cumsum(plain_probs, -1, out=self._buffer("scratch", plain_probs))
                tokens[plain] = self._draw_plain(cdf, _take(bits, rows))
            cut = random_rows & truncated
            if bool(cut.any()):
                rows = None if bool(cut.all()) else _rows_where(cut)
                cut_probs = _take(probs, rows)
                cut_maxima = block_maxima(cut_probs)
                if rows is None:
                    maxima = cut_maxima
                tokens[cut] = sample_truncated(
                    cut_probs,
                    cut_maxima,
                    vocab,
                    _take(top_k, rows) if any_top_k else None,
                    _take(top_p, rows) if any_top_p else torch.ones_like(_take(top_p, rows)),
                    _take(min_p, rows) if any_min_p and min_p is not None else None,
                    _take(bits, rows),
                )
        if num_logprobs is None:
            return SampleOutput(tokens)
        prob_max = maxima.amax(-1) if maxima is not None else probs.amax(-1)
        return self._with_logprobs(logits, prob_max, temperature, tokens, num_logprobs)

    @staticmethod
    def _draw_plain(cdf: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """Inverse CDF over the whole vocabulary in token order (the fp32 CDF, accumulated in double)."""
        total = cdf[:, -1]
        u = (bits.float() + 0.5) * (1.0 / 16777216.0)
        # Strictly below the total, so the search lands on a token with nonzero probability.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)

    def _with_logprobs(
        self,
        logits: torch.Tensor,
        prob_max: torch.Tensor,
        temperature: torch.Tensor,
        tokens: torch.Tensor,
        n: int,
    ) -> SampleOutput:
        """Logprobs of the raw logits without a log_softmax over the batch.

        A row's log-normaliser is max(logits) - log(max(softmax(logits))): softmax gives the top token
        exp(0) / sum. Rows sampled at temperature 1 (and greedy rows) reuse the sampler's softmax; other
        rows pay one more. The top n come from the n blocks with the best maxima, not a full topk.
        """
        padded = pad_to_blocks(logits, float("-inf"))
        maxima = block_maxima(padded)
        prob_max = prob_max.clone()
        other = (temperature != 0) & (temperature != 1)
        if bool(other.any()):
            rows = None if bool(other.all()) else _rows_where(other)
            untempered = self._softmax(_take(logits, rows), torch.ones_like(_take(temperature, rows)))
            prob_max[other] = untempered.amax(-1)
        lse = maxima.amax(-1) - prob_max.log()
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        if n == 0:
            return SampleOutput(tokens, chosen)
        values, ids = top_values(padded, n, maxima)
        return SampleOutput(tokens, chosen, ids, values - lse.unsqueeze(1))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens; a row with a NaN logit (a broken model or input) has no most likely token and gets -1,
    an impossible token the model runner reports as that request's error (as the sampled rows do)."""
    return torch.where(torch.isnan(logits).any(-1), -1, logits.argmax(-1))


def _op_dtypes(temperature, top_k, top_p, min_p) -> bool:
    """Whether the per-row tensors have the dtypes the op computes in (what the model runner builds); others
    take the tensor code, which computes in theirs."""
    floats = (temperature, top_p) + (() if min_p is None else (min_p,))
    return all(t.dtype == torch.float32 for t in floats) and top_k.dtype == torch.long


def _sample_step_op(logits: torch.Tensor):
    """The C++ sampling step when it serves these logits (CPU, fp32, dense rows) and builds; else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return None
    return native_build.sample_step_op()


def _rows_where(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero().squeeze(1)


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]
