"""llama.cpp's own prompt-lookup decoding as a peer (llama-cpp-python's ``LlamaPromptLookupDecoding``): one
sequence at a time through its high-level ``Llama``, with and without the lookup, in a process of its own
(``peer_process.py``)."""

from __future__ import annotations

import time


class LookupPeer:
    """Two ``Llama`` objects on one file: one drafting with prompt lookup, one not."""

    def __init__(self, path: str, n_ctx: int, num_pred_tokens: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)
        # A draft model needs every position's logits (logits_all), as llama-cpp-python's own example sets.
        self.lookup = Llama(path, n_ctx=n_ctx, draft_model=draft, logits_all=True, verbose=False)
        self.plain = Llama(path, n_ctx=n_ctx, verbose=False)


def timed(peer: LookupPeer, prompt: list[int], tokens: int, temperature: float, top_p: float, lookup: bool):
    """Generated tokens per second of one completion of ``tokens`` new tokens (the prompt evaluated first,
    outside the timed part, by a one-token completion that leaves it in the cache)."""
    llm = peer.lookup if lookup else peer.plain
    llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.create_completion(
        prompt, max_tokens=tokens, temperature=temperature, top_p=top_p, seed=1, logit_bias=None
    )
    elapsed = time.perf_counter() - t0
    return out["usage"]["completion_tokens"] / elapsed
