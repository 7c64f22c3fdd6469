"""Running one HTTP request through an ASGI app in-process, its response messages yielded as they come.

A Ray Serve replica answers the ingress's calls with hydragen's own FastAPI app this way: no HTTP server
and no socket inside the replica, yet every status, header, error body and streamed event is the app's.
When the caller stops reading (the client went away, the call was cancelled), the app sees
``http.disconnect``, as it would from a server, and aborts the request's generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


def http_scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict:
    """The ASGI scope of an HTTP/1.1 request as a server would build it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in headers],
        "client": None,
        "server": None,
    }


async def call_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """The app's ``http.response.*`` messages for one request whose whole body is ``body``."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # after the body, the only message left is the client leaving
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()  # the response is complete, or our caller left: either way the client is gone now
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
