"""Refusing at ``add_request`` a request the engine could never finish, with an error naming the parameter.

Checked before anything is queued, so a bad request costs nobody else a step: token ids outside the
vocabulary, a prompt as long as the context, or one sequence too big for the whole KV cache.
"""

from __future__ import annotations

from hydragen.engine.sampling_params import SamplingParams
from hydragen.errors import ParamError


def first_bad_token(token_ids, vocab: int) -> object | None:
    """The first entry that is not a token id in [0, vocab) (bools are not ids), or None."""
    return next(
        (t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None
    )


def check_request(prompt_ids: object, params: SamplingParams, *, vocab: int, context: int) -> None:
    """Raises ``ParamError`` for a prompt or stop-token id the model cannot take."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(prompt_ids, (list, tuple)):
        raise ParamError("prompt", f"prompt token ids must be a list, got {type(prompt_ids).__name__}")
    if not prompt_ids:
        raise ParamError("prompt", "prompt is empty: at least one token is needed")
    if len(prompt_ids) >= context:  # before scanning the ids: a huge prompt is refused at once
        raise ParamError(
            "prompt", f"prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens"
        )
    bad = first_bad_token(prompt_ids, vocab)
    if bad is not None:
        raise ParamError("prompt", f"prompt token id {bad!r} is out of range [0, {vocab})")
    bad = [t for t in params.stop_token_ids or () if t >= vocab]
    if bad:
        raise ParamError("stop_token_ids", f"stop token id {bad[0]} is out of range [0, {vocab})")


def check_forced(s, token_ids: list[int], *, vocab: int, context: int) -> None:
    """Raises ValueError for forced tokens (``EngineCore.append_forced``) a sequence cannot take: ids outside
    the vocabulary, no room left to sample after them, or text its structured-output constraint refuses."""
    if first_bad_token(token_ids, vocab) is not None:
        raise ValueError(f"token ids must lie in [0, {vocab})")
    if len(s.generated) + len(token_ids) >= s.params.max_tokens:
        raise ValueError("the forced tokens would reach max_tokens: no room left to sample after them")
    if s.context_len + len(token_ids) >= context:
        raise ValueError(
            f"the forced tokens would reach the model's context of {context} tokens: no room left to sample "
            "after them"
        )
    if s.grammar is not None and not s.grammar.fits(token_ids):
        raise ValueError("the tokens do not fit the request's structured-output constraint")


def check_fits(need: int, num_slots: int, page_size: int) -> None:
    """One sequence alone must fit the cache; the n sequences of a request run in waves if not all fit."""
    if need > num_slots:
        raise ParamError(
            "max_tokens",
            f"one sequence of this request needs up to {need} KV slots (prompt + max_tokens, in pages of "
            f"{page_size}) but the cache has {num_slots}; lower max_tokens or the prompt length",
        )
