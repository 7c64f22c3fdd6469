"""The tensor-parallel process group: rendezvous, backend choice, timeouts and the collectives the model uses.

The group is a standalone ``torch.distributed`` process group built on the rendezvous store (file://,
tcp:// or torchrun's env://), not the global default group: a program may hold several tensor-parallel
LLMs, and one that also uses torch.distributed for its own work keeps its default group. On CPU one gloo
group carries everything. On CUDA the step's metadata (CPU tensors) goes through gloo and activations
through NCCL, as vLLM splits them. Every collective is bounded by the timeout (``HYDRAGEN_TP_TIMEOUT``
seconds, 300 by default), so a peer that hangs becomes an error, never a wait forever; a peer that dies
closes its connections, which fails the collective at once. A collective that raises is a
``CollectiveError``: the group is then out of step for good (a gloo group that failed cannot be reused),
unlike a rank's own computation raising, which ``lockstep.py`` recovers from.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
TEXT_BYTES = 1024  # a gathered error message, UTF-8, cut to this


class CollectiveError(RuntimeError):
    """A collective itself failed (a peer died, hung past the timeout, or disagreed): the group is done."""


def collective_timeout() -> float:
    raw = os.environ.get("HYDRAGEN_TP_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"HYDRAGEN_TP_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"HYDRAGEN_TP_TIMEOUT must be positive, got {raw!r}")
    return value


@dataclass(frozen=True)
class TorchrunEnv:
    """The ranks torchrun (or any launcher using the env:// convention) started."""

    rank: int
    world: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a torchrun job of more than one rank, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        return None
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    return TorchrunEnv(rank, world, local)


@dataclass
class TPGroup:
    """This rank's view of the group: its rank, the world size, the device its shard lives on, and the
    process groups (``control``: gloo, CPU tensors; ``data``: the model's collectives)."""

    rank: int
    world: int
    device: torch.device
    control: object = field(repr=False)
    data: object = field(repr=False)
    issued: int = field(default=0, repr=False)  # all-reduces issued since the step began (lockstep.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.issued += 1  # counted before the call: a Ctrl-C is raised after a call returns, never before it
        try:
            self.data.allreduce([x]).wait()
        except Exception as e:
            raise CollectiveError(f"all-reduce failed: {e}") from e
        return x

    def gather_to_first(self, x: torch.Tensor, control: bool = False) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on all ranks) on rank 0, in rank order; None elsewhere.
        ``control``: through the control group (CPU tensors), not the data group."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        pg = self.control if control else self.data
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        try:
            pg.gather([parts] if parts is not None else [], [x], opts).wait()
        except Exception as e:
            raise CollectiveError(f"gather failed: {e}") from e
        return parts

    def gather_texts(self, text: str) -> list[str] | None:
        """Every rank's ``text`` (UTF-8, cut to TEXT_BYTES) on rank 0, in rank order; None elsewhere."""
        data = text.encode()[:TEXT_BYTES]
        buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.gather_to_first(buf, control=True)
        if parts is None:
            return None
        return [bytes(p.tolist()).rstrip(b"\0").decode(errors="replace") for p in parts]

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor ``x`` into every rank's ``x`` (the control channel: rank 0's commands)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.control.broadcast([x], opts).wait()
        except Exception as e:
            raise CollectiveError(f"broadcast failed: {e}") from e
        return x

    def close(self) -> None:
        for pg in {id(self.control): self.control, id(self.data): self.data}.values():
            if hasattr(pg, "shutdown"):
                pg.shutdown()


def join_group(rank: int, world: int, init_method: str, device: torch.device) -> TPGroup:
    """Join (and with the others, form) the group. ``init_method``: file://, tcp:// or env://."""
    timeout = datetime.timedelta(seconds=collective_timeout())
    store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    prefix = "hydragen-tp"  # each group has its own store (a fresh file, or torchrun's job)
    control = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "-gloo", store), rank, world, timeout)
    data = control
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "-nccl", store), rank, world, options)
    return TPGroup(rank, world, device, control, data)
