"""The all-reduce alone: N fresh processes in a gloo group reduce [rows, hidden] fp32 tensors back to back.

``bench tp`` times all-reduces inside real steps, where a call also waits for the slower rank to finish its
share of the layer; this probe has nothing else to wait for, so it shows the transport's own cost per call
(``python -m hydragen.bench.tp.allreduce_probe RANK WORLD STORE_DIR HIDDEN ROWS...``; rank 0 prints JSON).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time

CALLS = 200


def probe(world: int, hidden: int, rows: list[int]) -> list[dict]:
    """Per-call all-reduce time for each row count, from a fresh group of ``world`` processes."""
    store = tempfile.mkdtemp(prefix="hydragen-allreduce-")
    from hydragen.tp.launcher import worker_env

    env = worker_env(OMP_NUM_THREADS="1")
    args = [str(world), store, str(hidden), *map(str, rows)]
    cmd = [sys.executable, "-m", "hydragen.bench.tp.allreduce_probe"]
    procs = [
        subprocess.Popen([*cmd, str(r), *args], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    try:
        out = procs[0].communicate(timeout=300)[0]
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(store, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def _main(argv: list[str]) -> None:
    import torch

    from hydragen.tp.group import join_group

    rank, world, store, hidden = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    torch.set_num_threads(1)
    group = join_group(rank, world, f"file://{store}/store", torch.device("cpu"))
    results = []
    for n in map(int, argv[4:]):
        x = torch.randn(n, hidden)
        for _ in range(20):
            group.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            group.all_reduce(x)
        per_call = (time.perf_counter() - t0) / CALLS
        results.append(
            {"rows": n, "hidden": hidden, "bytes": 4 * n * hidden, "idle_allreduce_ms": 1e3 * per_call}
        )
    group.close()
    if rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
