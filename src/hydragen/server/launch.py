"""Running the server: port bound before the model loads, a ready line, stalled clients cut off, and a
graceful SIGTERM.

* The listening socket is bound first, so a busy port or a bad host is a one-line error in a second,
  not a traceback after the model has loaded.
* Once serving, one "ready" line gives the URL and the KV cache size.
* A connection that has sent no complete request for ``read_timeout`` (plus the keep-alive time) is
  closed: a client that opens connections and stalls cannot hold them forever.
* SIGTERM (or Ctrl-C): stop accepting connections and requests (``/health`` says 503), give in-flight
  requests ``shutdown_timeout`` seconds, then end them with a 503 error and exit. A second signal exits
  at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hydragen.server.errors import APIError
from hydragen.server.options import ServerOptions

log = logging.getLogger("hydragen.server")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def configure_logging(level: str) -> None:
    """Our log lines (request lines, the ready line) go to stderr at ``level``, like uvicorn's."""
    logger = logging.getLogger("hydragen")
    if not any(getattr(h, "_hydragen", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        handler._hydragen = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening); OSError with a one-line reason otherwise."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise OSError(f"cannot resolve host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class HydragenServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_client, options: ServerOptions, ready: str = ""):
        """``engine_client``: what a shutdown drains (``begin_drain``, ``fail_all``): the app's
        ``EngineClient``, or the data-parallel front."""
        super().__init__(config)
        self.engine_client, self.options, self.ready = engine_client, options, ready
        self._idle_since: dict[tuple[int, int], float] = {}

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.ready:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            log.info(self.ready.format(port=port))

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            log.warning("second signal: exiting now")
            os._exit(128 + sig)
        log.info("shutting down: no new requests; %g s for the ones in flight", self.options.shutdown_timeout)
        self.engine_client.begin_drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.engine_client.begin_drain()
        expire = asyncio.ensure_future(self._abort_in_flight_after(self.options.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            expire.cancel()
        # uvicorn re-raises the signal it caught once it has shut down; a graceful exit is a clean exit.
        getattr(self, "_captured_signals", []).clear()

    async def _abort_in_flight_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        log.warning("shutdown grace period over: aborting the requests still in flight")
        self.engine_client.fail_all(
            APIError(
                503,
                "the server shut down; this request was aborted at the end of its grace period",
                code="shutting_down",
            )
        )

    async def on_tick(self, counter: int) -> bool:
        self._close_stalled_connections()
        return await super().on_tick(counter)

    def _close_stalled_connections(self) -> None:
        """Close connections with no request in progress for longer than read + keep-alive timeouts
        (never sent a complete request line and headers, or stalled half-way through the next one)."""
        now, limit = time.monotonic(), self.options.read_timeout + self.options.keep_alive_timeout
        live = set()
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and not getattr(cycle, "response_complete", True):
                continue  # a request is being served: its body read has its own deadline
            key = (id(conn), id(cycle))
            live.add(key)
            if now - self._idle_since.setdefault(key, now) > limit:
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.close()
        self._idle_since = {k: v for k, v in self._idle_since.items() if k in live}


class OpenAIErrorH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, but a request it cannot even parse (bad request line, oversized
    headers) gets its 400 in OpenAI's shape too, not plain text."""

    def send_400_response(self, msg: str) -> None:
        err = APIError(400, f"malformed HTTP request: {msg}", code="invalid_http")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=json.dumps(err.body()).encode()),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def make_server(app, options: ServerOptions, log_level: str = "info", ready: str = "") -> HydragenServer:
    """The uvicorn server for ``app`` (from create_app); ``ready`` is logged once serving."""
    config = uvicorn.Config(
        app,
        http=OpenAIErrorH11Protocol,
        log_level=log_level,
        access_log=False,  # the Gate writes one line per request
        timeout_keep_alive=options.keep_alive_timeout,
        timeout_graceful_shutdown=int(options.shutdown_timeout) + 5,  # a backstop: requests end at the grace
    )
    return HydragenServer(config, app.state.engine_client, options, ready)


def run(app, sock: socket.socket, options: ServerOptions, log_level: str, ready: str) -> None:
    """Serve ``app`` on the bound ``sock`` until a signal."""
    make_server(app, options, log_level, ready).run(sockets=[sock])
