"""The server's limits and access settings (``hydragen serve`` flags; tests build them directly)."""

from __future__ import annotations

from dataclasses import dataclass

from hydragen.restart_backoff import DEFAULT_MAX_PER_MINUTE
from hydragen.server.step_watchdog import DEFAULT_STEP_TIMEOUT_S

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass
class ServerOptions:
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    allowed_hosts: list[str] | None = None  # Host header names accepted; None: any
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get a 413
    read_timeout: float = 30.0  # seconds to receive a request's headers and body (408 / connection closed)
    shutdown_timeout: float = 10.0  # grace for in-flight requests after SIGTERM, then they are aborted
    keep_alive_timeout: float = 5.0  # idle keep-alive connections are closed after this
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S  # an engine step running longer is stalled (0: never)
    max_restarts_per_minute: int = DEFAULT_MAX_PER_MINUTE  # rebuilds of a broken tensor-parallel group

    def check(self) -> None:
        """ValueError naming the first bad option."""
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        for name in ("read_timeout", "shutdown_timeout", "keep_alive_timeout", "step_timeout"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        restarts = self.max_restarts_per_minute
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"--max-restarts-per-minute must be an integer >= 0, got {restarts}")
        if self.read_timeout <= 0:
            raise ValueError(f"--read-timeout must be > 0, got {self.read_timeout}")
        if self.allowed_hosts is not None and not all(h.strip() for h in self.allowed_hosts):
            raise ValueError("--allowed-hosts must be a comma-separated list of host names")
