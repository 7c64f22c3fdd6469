"""A ``hydragen serve`` of its own for a benchmark (``bench serve``, ``bench dp``): started in a child process
on a free local port, quiet (no request lines), and handed over once it is healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``hydragen serve`` with ``extra`` flags on a free port, once its /health answers: (process, URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "hydragen",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",  # no request lines in the benchmark's output
        *extra,
    ]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start within 300 s")
