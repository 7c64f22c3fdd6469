"""Jump-forward: after a sampled token, append the text the grammar forces, re-tokenized at the boundary.

The grammar's automaton is never walked token by token through a forced run: llguidance computes the
forced bytes from the current state in one call (its lexer/parser does the compressed-FSM step), and
the tokens for them come back as the engine's multi-token extend, computed in one forward.

Boundary: the sampled token was chosen before the forced text was known, so ``sampled + forced`` may not
be how the tokenizer splits that text (a sampled ``"`` followed by forced ``,"age":`` is canonically
``","`` ``age`` ``":``). The sampled token has no KV yet (it is the next forward's input), so it can be
replaced for free: the text is re-encoded and, when the encoding differs and the grammar accepts it,
the canonical tokens replace the sampled one. Tokens already computed are never re-split.
"""

from __future__ import annotations

from hydragen.structured.matcher import GrammarState


def jump_forward(state: GrammarState, ll_tokenizer, encode, sampled: int) -> list[int]:
    """Tokens to append in place of ``sampled`` (already accepted by ``state``): the first replaces it,
    the rest are forced. ``state`` ends having accepted exactly the returned tokens."""
    forced = state.forced_tokens()
    if not forced:
        return [sampled]
    ids = [sampled, *forced]
    try:
        text = bytes(ll_tokenizer.decode_bytes(ids)).decode("utf-8")
    except UnicodeDecodeError:  # a token ends inside a character: keep the tokens as they are
        text = None
    canonical = encode(text) if text is not None else ids
    if canonical and canonical != ids:
        state.rollback(1)
        if state.fits(canonical):
            state.accept_all(canonical)
            return list(canonical)
        state.accept(sampled)
    state.accept_all(forced)
    return ids
