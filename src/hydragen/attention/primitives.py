"""One attention partial: queries against one block of keys, returning output and natural-log LSE.

Everything else in hydragen (shared prefixes, tree decode, chunked prefill) is built from this one
operation plus the LSE merge. Two implementations share one signature:

* ``fused``: on CPU, ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the LSE and
  handles GQA natively (query head h reads KV head h // (Hq // Hkv)); it runs the whole block as a
  tiled matrix-matrix product.
* ``torch``: plain matmul + softmax in fp32, the reference that runs on any device.

Layout is SDPA's: q [N, Hq, L, D], k/v [N, Hkv, S, D] (any strides), additive or boolean ``visible``
mask broadcastable to [N, 1, L, S]. Rows that see no key get out = 0 and lse = -inf (the fused
kernel reports lse = 0 for them, which would corrupt a merge, so we patch them).

``softcap`` c (Gemma 2's attention logit soft-capping) makes every scaled score s into c * tanh(s / c)
before the softmax. The fused CPU kernel has no such step, so a soft-capped partial always runs ``torch``.
"""

from __future__ import annotations

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _torch_partial(q, k, v, scale, visible, softcap=None):
    n, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # Fold the GQA group into query rows: [N, Hkv, g*L, D] against [N, Hkv, S, D]; no KV repeat.
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    qf = q.reshape(n, hkv, g * lq, d).to(acc)
    scores = torch.matmul(qf, k.to(acc).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        vis = visible.expand(n, 1, lq, k.shape[2]).unsqueeze(2).expand(n, 1, g, lq, k.shape[2])
        scores = scores.masked_fill(~vis.reshape(n, 1, g * lq, k.shape[2]), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    vf = v.to(acc)
    if visible is None:
        return torch.matmul(probs, vf).reshape(n, hq, lq, d), lse.reshape(n, hq, lq)
    # A masked key's probability is exactly 0, but 0 x inf is NaN: a V row holding an inf or NaN would reach
    # rows that must not see its key (and through a prefill row, K/V the prefix cache shares). Its entries
    # count as 0 in the product; the rows that do see such a key come out NaN. On CPU, where asking costs no
    # device sync, an all-finite V (the usual case) skips the copy and the extra product.
    bad = ~torch.isfinite(vf)
    if vf.device.type == "cpu" and not bool(bad.any()):
        return torch.matmul(probs, vf).reshape(n, hq, lq, d), lse.reshape(n, hq, lq)
    out = torch.matmul(probs, vf.masked_fill(bad, 0.0))
    bad_key = bad.any(-1, keepdim=True).to(acc)  # [n, hkv, S, 1]
    seen = torch.matmul(visible.expand(n, 1, lq, k.shape[2]).to(acc), bad_key) > 0  # [n, hkv, lq, 1]
    seen = seen.unsqueeze(2).expand(n, hkv, g, lq, 1).reshape(n, hkv, g * lq, 1)
    out = out.masked_fill(seen, float("nan"))
    return out.reshape(n, hq, lq, d), lse.reshape(n, hq, lq)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
    causal: bool = False,
    impl: str = "auto",
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block. Returns (out [N, Hq, L, D] in q's dtype, lse [N, Hq, L] fp32).

    ``visible`` is a boolean mask (True = may attend) broadcastable to [N, 1, L, S]; ``causal`` means
    square top-left causal (L == S); ``softcap`` caps the scores (module docstring). The caller guarantees
    S > 0.
    """
    if impl not in ("auto", "fused", "torch"):
        raise ValueError(f"impl must be 'auto', 'fused' or 'torch', got {impl!r}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("causal partials must be square (L == S); pass a visibility mask otherwise")
    if q.numel() == 0:  # the fused CPU kernel faults on empty queries
        return q.new_zeros(q.shape), torch.full(q.shape[:3], float("-inf"), device=q.device)
    use_fused = (
        q.dtype != torch.float64
        and softcap is None
        and (impl == "fused" or (impl == "auto" and q.device.type == "cpu" and _CPU_FLASH is not None))
    )
    finite = lambda t: bool(torch.isfinite(t).all())  # noqa: E731
    if visible is not None and use_fused and not (finite(k) and finite(v)):
        # ATen adds the mask to the scores (NaN + -inf is NaN) and multiplies masked V by 0: a masked key's
        # inf or NaN would reach rows that do not see it; _torch_partial replaces masked scores.
        use_fused = False
    if causal and use_fused and not finite(v):
        use_fused = False  # is_causal overwrites masked scores, but 0 x inf in V is NaN all the same
    if not use_fused:
        if causal:
            visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        out, lse = _torch_partial(q, k, v, scale, visible, softcap)
        return out.to(q.dtype), lse
    if visible is None:
        out, lse = _CPU_FLASH(q, k, v, is_causal=causal, scale=scale)
        return out, lse.float()
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = _CPU_FLASH(q, k, v, attn_mask=bias, scale=scale)
    lse = lse.float()
    blind = ~visible.any(-1)  # rows that see no key at all
    if bool(blind.any()):
        blind = blind.expand(q.shape[0], q.shape[1], q.shape[2])
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind.unsqueeze(-1), 0.0)
    return out, lse
