"""Which part of every weight a tensor-parallel rank holds (Megatron-style), and which splits are refused.

* Column-parallel (split the output rows): q/k/v (and their biases) by attention head, gate/up by MLP
  column. Each rank computes its own heads and its own MLP columns with no communication.
* Row-parallel (split the input columns): o and down. Each rank's product is a partial sum of the full
  output; one all-reduce after attention and one after the MLP add them up.
* Vocabulary-parallel: the embedding and the LM head are split by token id, padded to equal shards (vLLM
  pads the same way); the padding rows are zero and their logits are cut off after the gather.
* KV heads: split when there are at least as many as ranks; otherwise each KV head is replicated on the
  ``world // num_kv_heads`` consecutive ranks whose query heads read it (vLLM's rule).
Norms are replicated. Splits that would give ranks unequal heads are refused at start. MLP columns split
equally, except for a quantized model whose down projection is stored in blocks (32 or 256 weights along
its input): there each rank takes whole blocks, as equal as they come (11,008 columns in 256-blocks over 2
ranks: 5,632 and 5,376), so each rank's slice stays quantized. The o projection's input is split by heads,
and a head split that cuts its blocks is refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hydragen.model.config import ModelConfig


class TPSplitError(ValueError):
    """A model that cannot be split over the requested number of ranks; the message says why."""


def check_split(cfg: ModelConfig, world: int, blocks: SplitBlocks | None = None) -> None:
    """Raise TPSplitError naming the reason, and the sizes that work, when ``cfg`` cannot run on ``world``
    tensor-parallel ranks (``blocks``: the block sizes of a quantized checkpoint's row-parallel weights)."""
    blocks = blocks or SplitBlocks()
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TPSplitError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    why = _split_problem(cfg, world, blocks)
    if why is not None:
        sizes = [n for n in range(1, cfg.num_heads + 1) if _split_problem(cfg, n, blocks) is None]
        raise TPSplitError(f"{why} (sizes that work for this model: {', '.join(map(str, sizes))})")


def _split_problem(cfg: ModelConfig, world: int, blocks: SplitBlocks) -> str | None:
    heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if heads % world:
        return (
            f"cannot split {heads} attention heads over {world} ranks: tensor_parallel_size must divide "
            "the number of attention heads"
        )
    if kv >= world and kv % world:
        return (
            f"cannot split {kv} KV heads over {world} ranks: with at least as many KV heads as ranks, "
            "tensor_parallel_size must divide the number of KV heads"
        )
    if kv < world and world % kv:
        return (
            f"cannot replicate {kv} KV heads over {world} ranks: with fewer KV heads than ranks, "
            "tensor_parallel_size must be a multiple of the number of KV heads"
        )
    if blocks.down == 1 and inter % world:
        return (
            f"cannot split the MLP's {inter} columns over {world} ranks: tensor_parallel_size must divide "
            "intermediate_size"
        )
    if blocks.down > 1 and inter // blocks.down < world:
        units = inter // blocks.down
        return f"cannot split the MLP's {units} quantized blocks of {blocks.down} columns over {world} ranks"
    if heads % world == 0 and (heads // world * cfg.head_dim) % blocks.o:
        return (
            f"cannot split the o projection's quantized blocks of {blocks.o} columns by heads over {world} "
            f"ranks: each rank's {heads // world} heads hold {heads // world * cfg.head_dim} columns"
        )
    return None


@dataclass(frozen=True)
class SplitBlocks:
    """Weights per block along the input of the row-parallel projections (1: float weights)."""

    down: int = 1
    o: int = 1


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``: its heads, MLP columns and vocabulary rows."""

    cfg: ModelConfig
    rank: int
    world: int
    blocks: SplitBlocks = SplitBlocks()

    def __post_init__(self) -> None:
        check_split(self.cfg, self.world, self.blocks)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside [0, {self.world})")

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world)

    @property
    def head_lo(self) -> int:
        return self.rank * self.heads

    @property
    def kv_head_lo(self) -> int:
        kv = self.cfg.num_kv_heads
        if kv >= self.world:
            return self.rank * self.kv_heads
        return self.rank // (self.world // kv)  # the KV head this rank's query heads are grouped under

    @property
    def columns(self) -> tuple[int, int]:
        """This rank's MLP columns [lo, hi): an equal share, in whole blocks of the down projection."""
        block = self.blocks.down
        units = self.cfg.intermediate_size // block
        per, extra = divmod(units, self.world)
        lo = self.rank * per + min(self.rank, extra)
        return lo * block, (lo + per + (self.rank < extra)) * block

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.world)

    @property
    def vocab(self) -> tuple[int, int]:
        """Token ids [lo, hi) of this rank's real (not padding) vocabulary rows."""
        lo = self.rank * self.vocab_per_rank
        return min(lo, self.cfg.vocab_size), min(lo + self.vocab_per_rank, self.cfg.vocab_size)

    def local_config(self) -> ModelConfig:
        """The config this rank's model is built from: its heads, columns and (padded) vocabulary rows."""
        return dataclasses.replace(
            self.cfg,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.columns[1] - self.columns[0],
            vocab_size=self.vocab_per_rank,
        )

    def piece(self, name: str) -> Piece:
        """Which slice of the Hugging Face tensor ``name`` this rank loads."""
        d = self.cfg.head_dim
        q = (self.head_lo * d, (self.head_lo + self.heads) * d)
        kv = (self.kv_head_lo * d, (self.kv_head_lo + self.kv_heads) * d)
        kind = _kind(name)
        if kind == "vocab":
            lo, hi = self.vocab
            return Piece(0, lo, hi, pad_to=self.vocab_per_rank)
        if kind == "q":
            return Piece(0, *q)
        if kind in ("k", "v"):
            return Piece(0, *kv)
        if kind == "o":
            return Piece(1, *q)
        if kind == "gate_up":
            return Piece(0, *self.columns)
        if kind == "down":
            return Piece(1, *self.columns)
        return Piece(None, 0, 0)  # replicated (norms)


@dataclass(frozen=True)
class Piece:
    """Slice [lo, hi) along ``dim`` (None: the whole tensor), zero-padded to ``pad_to`` rows if set."""

    dim: int | None
    lo: int
    hi: int
    pad_to: int | None = None


_KINDS = [
    (re.compile(r"^model\.embed_tokens\.weight$|^lm_head\.weight$"), "vocab"),
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "q"),
    (re.compile(r"\.self_attn\.k_proj\.(weight|bias)$"), "k"),
    (re.compile(r"\.self_attn\.v_proj\.(weight|bias)$"), "v"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "o"),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), "gate_up"),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "down"),
]


def _kind(name: str) -> str:
    for pattern, kind in _KINDS:
        if pattern.search(name):
            return kind
    return "replicated"
