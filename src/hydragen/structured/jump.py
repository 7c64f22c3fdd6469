"""Jump-forward: after a sampled token, append the text the grammar forces, re-tokenized at the boundary.

The grammar's automaton is never walked token by token through a forced run: llguidance computes the
forced bytes from the current state in one call (its lexer/parser does the compressed-FSM step), and
the tokens for them are appended to the sequence (``EngineCore``'s forced append), computed in one forward.

Boundary: the sampled token was chosen before the forced text was known, so ``sampled + forced`` may not
be how the tokenizer splits that text (a sampled ``"`` followed by forced ``,"age":`` is canonically
``","`` ``age`` ``":``). The sampled token has no KV yet (it is the next forward's input), so it can be
replaced for free: the text is re-encoded and, when the encoding differs, spells exactly the same bytes
and the grammar accepts it, the canonical tokens replace the sampled one. Tokens already computed are
never re-split.

Byte-exactness matters: a SentencePiece tokenizer that adds a dummy-prefix space (Llama-2, Mistral
v0.1) encodes ``",`` as ``▁"`` ``,``, one space more than the text. Inside a JSON string the grammar
accepts that space, so without the byte check it would enter the value, and the model would condition
on a token it never chose. Such an encoding is refused and the original tokens are kept.
"""

from __future__ import annotations

from hydragen.structured.matcher import GrammarState


def jump_forward(state: GrammarState, ll_tokenizer, encode, sampled: int) -> list[int]:
    """Tokens to append in place of ``sampled`` (already accepted by ``state``): the first replaces it,
    the rest are forced. ``state`` ends having accepted exactly the returned tokens, which decode to
    exactly the bytes of ``sampled`` followed by the forced text."""
    forced = state.forced_tokens()
    if not forced:
        return [sampled]
    ids = [sampled, *forced]
    canonical = _canonical(ids, ll_tokenizer, encode)
    if canonical is not None:
        state.rollback(1)
        if state.fits(canonical):
            state.accept_all(canonical)
            return canonical
        state.accept(sampled)
    state.accept_all(forced)
    return ids


def _canonical(ids: list[int], ll_tokenizer, encode) -> list[int] | None:
    """The tokenizer's own split of the bytes of ``ids`` when it differs from ``ids`` and spells exactly
    the same bytes; None to keep ``ids``."""
    raw = bytes(ll_tokenizer.decode_bytes(ids))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # a token ends inside a character: keep the tokens as they are
        return None
    canonical = list(encode(text))
    if not canonical or canonical == ids or bytes(ll_tokenizer.decode_bytes(canonical)) != raw:
        return None
    return canonical
