"""A rank's shard of the Llama-family model: the same forward, on its heads, columns and vocabulary rows.

``LlamaModel`` built from the rank's local config already computes column-parallel q/k/v and gate/up and
attends over its own heads; this class adds the three places that talk to the other ranks:

* the embedding looks up only the ids in its vocabulary shard (zeros elsewhere) and all-reduces, which is
  exact (each row has one non-zero contribution);
* ``reduce`` all-reduces the partial outputs of the row-parallel o and down projections (two per layer);
* ``logits`` computes its vocabulary shard's logits and gathers them on rank 0, which samples.
"""

from __future__ import annotations

import torch

from hydragen.distributed.group import TPGroup
from hydragen.model.llama import LlamaModel


class ShardedLlamaModel(LlamaModel):
    fuse_residual = False  # o and down give partial sums: all-reduced before they join the residual
    group: TPGroup
    vocab_lo: int = 0  # first token id of this rank's vocabulary rows
    full_vocab: int = 0  # the model's real vocabulary (the shards are padded to equal sizes)

    def attach(self, group: TPGroup, vocab_lo: int, full_vocab: int) -> ShardedLlamaModel:
        self.group, self.vocab_lo, self.full_vocab = group, vocab_lo, full_vocab
        return self

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed.num_embeddings
        local = input_ids - self.vocab_lo
        outside = (local < 0) | (local >= rows)
        h = self.embed(local.clamp(0, rows - 1)).to(self.norm.dtype)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.reduce(h)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, normalized: bool = True) -> torch.Tensor | None:
        """Full-vocabulary logits [B, V] (fp32) on rank 0; None on the other ranks."""
        parts = self.group.gather_to_first(super().logits(hidden, normalized))
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, : self.full_vocab]
