"""The loop every rank but 0 runs: wait for rank 0's command, do it on this rank's shard, repeat.

A worker holds its model shard and a page pool of the same pages as rank 0's (its own KV heads). It keeps
no scheduler state: each ``STEP`` brings the whole packed batch, and the forward's collectives (two
all-reduces per layer, the embedding's all-reduce, the logits' gather) meet rank 0's. A forward that
raises here is finished in step with the others (``lockstep.py``): the worker keeps its error for rank 0's
``REPORT``, prints the traceback, and waits for the next command. Anything else that fails (a collective,
a command it cannot read) ends the worker with a non-zero exit code: rank 0 then sees a failed collective
or a dead worker, which fails the requests instead of leaving any rank waiting.
"""

from __future__ import annotations

import sys
import traceback

import torch

from hydragen.engine.model_runner import ModelRunner
from hydragen.kv.layout import model_kv_layout
from hydragen.kv.pool import PagePool
from hydragen.tp import commands
from hydragen.tp.group import TPGroup
from hydragen.tp.lockstep import run_step


def serve_rank(group: TPGroup, model, cfg, shard, dtype: torch.dtype) -> int:
    """Run commands until STOP (returns 0) or a failure (returns 1, after printing why)."""
    device = group.device
    runner: ModelRunner | None = None
    last_error = ""  # this rank's error in the last step, for rank 0's REPORT
    while True:
        try:
            command, payload = commands.receive(group)
        except Exception as e:  # noqa: BLE001  rank 0 is gone or the group timed out
            print(f"hydragen: tensor-parallel rank {group.rank}: lost rank 0 ({e})", file=sys.stderr)
            return 1
        try:
            if command == commands.STOP:
                return 0
            if command == commands.NOOP:
                continue
            if command == commands.SETUP:
                num_pages, page_size, code, kv_code = payload.tolist()
                local = shard.local_config()
                kv_dtype = commands.KV_DTYPE_CODES[kv_code]
                pool = PagePool(
                    cfg.num_layers, num_pages, page_size, local.num_kv_heads, cfg.head_dim, kv_dtype, device,
                    model_kv_layout(cfg),
                )  # fmt: skip
                runner = ModelRunner(model, cfg, pool, device, commands.ATTENTION_CODES[code])
            elif command == commands.COPY:
                runner.pool.copy_physical(*commands.unpack_copy(payload, device))  # rank 0 maps the groups
            elif command == commands.STEP:
                outcome = run_step(runner.forward, runner.model, commands.unpack_step(payload, device))
                last_error = _describe(outcome.error)
                if outcome.error is not None:
                    print(f"hydragen: tensor-parallel rank {group.rank}: its step failed:", file=sys.stderr)
                    traceback.print_exception(outcome.error, file=sys.stderr)
            elif command == commands.REPORT:
                group.gather_texts(last_error)
            else:
                raise ValueError(f"unknown command {command}")
        except Exception:  # noqa: BLE001
            name = commands.NAMES.get(command, command)
            print(f"hydragen: tensor-parallel rank {group.rank} failed in {name}:", file=sys.stderr)
            traceback.print_exc()
            return 1


def _describe(error: BaseException | None) -> str:
    if error is None:
        return ""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
