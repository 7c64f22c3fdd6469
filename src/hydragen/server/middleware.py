"""The gate every HTTP request passes: Host check, API key, and its one log line.

* ``allowed_hosts``: when set, a request whose Host header names another host gets a 400 (protects a
  server on a private address from DNS rebinding). ``*`` allows any host.
* ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 otherwise), as in vLLM;
  ``/health`` and ``/metrics`` stay open for probes.
* One info line per request when it ends: method, path, status, latency and what the handler recorded
  (request id, token counts, finish reasons, or the error class); never the prompt. Probes log at debug.
"""

from __future__ import annotations

import hmac
import logging
import time

from hydragen.server.errors import APIError

log = logging.getLogger("hydragen.server")
QUIET_PATHS = ("/health", "/metrics")


class Gate:
    def __init__(self, app, api_key: str | None = None, allowed_hosts: list[str] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        record: dict = {}
        scope.setdefault("state", {})["log"] = record
        status = [0]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                record.update(error=refusal.type, code=refusal.code, param=refusal.param)
                await refusal.response()(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            self._log(scope, status[0] or 500, time.monotonic() - start, record)

    def _refusal(self, scope) -> APIError | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.allowed_hosts is not None and "*" not in self.allowed_hosts:
            host = _hostname(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                return APIError(400, f"host {host!r} is not allowed by this server", code="invalid_host")
        if self.api_key is not None and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None

    @staticmethod
    def _log(scope, status: int, seconds: float, record: dict) -> None:
        quiet = scope["path"] in QUIET_PATHS and status < 400
        level = logging.DEBUG if quiet else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields = " ".join(f"{k}={v}" for k, v in record.items() if v is not None)
        path = scope["path"] if len(scope["path"]) <= 200 else scope["path"][:200] + "..."
        path = path.encode("utf-8", "backslashreplace").decode("utf-8")
        log.log(level, "%s %s %d %.3fs %s", scope["method"], path, status, seconds, fields)


def _hostname(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
