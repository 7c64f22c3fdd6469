"""A rank's shard of the Llama-family model: the same forward, on its heads, columns and vocabulary rows.

``DecoderModel`` built from the rank's local config already computes column-parallel q/k/v and gate/up and
attends over its own heads; this class adds the places that talk to the other ranks:

* the embedding looks up only the ids in its vocabulary shard (zeros elsewhere) and all-reduces, which is
  exact (each row has one non-zero contribution);
* ``reduce`` all-reduces the partial outputs of the row-parallel o and down projections (two per layer);
* ``logits`` (inherited) computes its vocabulary shard's logits [R, vocab_rows]; the step gathers every
  rank's on rank 0, which samples (``lockstep.py``, ``full_logits``).

So every forward issues the same all-reduces on every rank, 1 + 2 per layer, each of [tokens, hidden] in
the model's dtype: ``finish_reduces`` issues the ones a rank whose forward raised did not reach.
"""

from __future__ import annotations

import torch

from hydragen.model.decoder import DecoderModel
from hydragen.tp.group import TPGroup


class ShardedDecoderModel(DecoderModel):
    fuse_residual = False  # o and down give partial sums: all-reduced before they join the residual
    group: TPGroup
    vocab_lo: int = 0  # first token id of this rank's vocabulary rows
    full_vocab: int = 0  # the model's real vocabulary (the shards are padded to equal sizes)

    def attach(self, group: TPGroup, vocab_lo: int, full_vocab: int) -> ShardedDecoderModel:
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

    @property
    def vocab_rows(self) -> int:
        """The rows of every rank's vocabulary shard (equal on all ranks)."""
        return self.embed.num_embeddings

    def full_logits(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's logits shard, in rank order, as the full-vocabulary logits [R, V]."""
        return torch.cat(shards, dim=1)[:, : self.full_vocab]

    @torch.inference_mode()
    def finish_reduces(self, tokens: int) -> None:
        """Issue, with zeros, this forward's all-reduces that this rank has not reached (its forward raised
        part-way), so that no other rank waits in one this rank never joins."""
        total = 1 + 2 * len(self.layers)
        if self.group.issued >= total:
            return
        filler = torch.zeros(tokens, self.norm.shape[0], dtype=self.norm.dtype, device=self.group.device)
        while self.group.issued < total:
            self.group.all_reduce(filler.zero_())
