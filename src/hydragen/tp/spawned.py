"""A worker process that ``launcher.start`` spawned: ``python -m hydragen.tp.spawned SPEC``.

It ignores Ctrl-C (the terminal sends it to the whole process group; rank 0 decides and tells the workers),
dies with its parent, reports "started" / "loaded" / "error ..." on the status pipe, then follows rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time


def _die_with_parent(parent: int) -> None:
    """Exit when the parent exits, however it ends (Linux parent-death signal, and a pid watchdog)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="hydragen-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(spec["parent"])
    status = os.fdopen(spec["status_fd"], "w", buffering=1)

    def report(line: str) -> None:
        with contextlib.suppress(OSError):  # the parent stopped listening: it is going away
            status.write(line.replace("\n", " ") + "\n")

    import torch

    from hydragen.model.loader import resolve_dtype
    from hydragen.tp.checkpoint import load_shard
    from hydragen.tp.group import join_group
    from hydragen.tp.worker import serve_rank

    torch.set_num_threads(int(os.environ.get("HYDRAGEN_TP_THREADS", "1")))
    report("started")
    device, dtype = torch.device(spec["device"]), resolve_dtype(spec["dtype"])
    rank, world = spec["rank"], spec["world"]
    try:
        group = join_group(rank, world, spec["init_method"], device)
        net, cfg, _, shard = load_shard(
            spec["model"], rank, world, device, dtype, spec["random_weights"], spec["dequantize"]
        )
        net.attach(group, shard.vocab[0], cfg.vocab_size)
    except BaseException as e:  # noqa: BLE001  reported to rank 0, which raises it for the user
        report(f"error {type(e).__name__}: {e}")
        return 1
    report("loaded")
    status.close()
    code = serve_rank(group, net, cfg, shard, dtype)
    if code == 0:
        group.close()
    return code


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # no interpreter teardown: it could wait on the process group's threads
