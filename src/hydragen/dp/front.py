"""The data-parallel front: one OpenAI-compatible endpoint before N replicas, routing each request.

A completion request goes: gate (host, API key; the server's ``Gate``) -> body read (the server's bounds)
-> the exact prompt token ids the replica will see (``dp.prompts``) -> ``Router.choose`` -> the request
proxied unchanged to that replica, its response passed back as it comes (SSE events one by one). A body
the front cannot parse is sent to a replica anyway, so the client gets the replica's own 4xx.

Requests never hang on a replica that fails: when its connection breaks or its process ends, each of its
requests in flight ends with a 502 ``replica_failed`` error (a streaming one with an SSE error event), and
the router stops choosing it until it is back. A replica whose process runs but whose engine failed or is
stuck in a step leaves the rotation too, and is restarted (``dp.health``). A replica that cannot be
connected to, or that refuses a request because its engine cannot take it (503 ``engine_failed`` or
``engine_stalled``), never took the request, so the request is routed again among the others. A client
that goes away closes the proxied connection, and the replica aborts the request. ``/health`` is ok
while at least one replica is healthy, and names each one's state. On SIGTERM the front behaves as the
server does (``HydragenServer``: drain, grace period, then 503 ``shutting_down``), then stops the replicas.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from hydragen.dp import metrics
from hydragen.dp.health import HealthWatch, Verdict, server_verdict
from hydragen.dp.kv_events import KVEventSubscriber
from hydragen.dp.prompts import RequestPrompts
from hydragen.dp.replicas import Replica, ReplicaSet, describe_exit
from hydragen.dp.router import NoReplica, Route, Router, RouteRequest
from hydragen.server.app import add_completion_routes, openai_app
from hydragen.server.body import read_body
from hydragen.server.errors import APIError
from hydragen.server.options import ServerOptions
from hydragen.server.responses import SSE_DONE, sse
from hydragen.server.serving import CLIENT_CLOSED, client_gone
from hydragen.server.step_watchdog import DEFAULT_STEP_TIMEOUT_S

log = logging.getLogger("hydragen.dp")
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


class Ended(Exception):
    """A proxied request ended from outside: ``error`` (replica failed, shutdown), or None (client left)."""

    def __init__(self, error: APIError | None):
        super().__init__(error.message if error else "client disconnected")
        self.error = error


class Unreachable(Exception):
    """The replica could not be connected to: the request never reached it, so another may take it."""

    def __init__(self, replica: int, cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.replica = replica


class Refused(Exception):
    """The replica answered 503 before taking the request, as its engine cannot: another may take it."""

    def __init__(self, replica: int, verdict: Verdict):
        super().__init__(f"{verdict.code}: {verdict.detail}")
        self.replica, self.code = replica, verdict.code


class Flight:
    """One request in flight at a replica; ``end`` finishes it early (first reason wins)."""

    def __init__(self, route: Route):
        self.route = route
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()

    def end(self, error: APIError | None) -> None:
        if not self.ended.done():
            self.ended.set_result(error)

    async def wait(self, awaitable):
        """``awaitable``'s result, or Ended as soon as the flight is ended (the awaitable is cancelled)."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({task, self.ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise Ended(self.ended.result())


class Front:
    """The router, the replicas and the requests in flight at each; the ``engine`` HydragenServer drains."""

    def __init__(
        self,
        router: Router,
        prompts: RequestPrompts,
        serve_args: list[str],
        cores: list[list[int] | None],
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        restart_after: float = DEFAULT_STEP_TIMEOUT_S,
    ):
        """``restart_after``: seconds a replica may stay stalled or silent before it is restarted
        (``dp.health``; the command passes ``--step-timeout``)."""
        self.router, self.prompts = router, prompts
        self.replicas = ReplicaSet(
            serve_args, cores, on_up=self.replica_up, on_down=self.replica_down, command=command, env=env
        )
        n = len(cores)
        self.flights: list[set[Flight]] = [set() for _ in range(n)]
        self.failed = [0] * n  # requests ended by their replica's failure
        self.unreachable = [0] * n  # requests the replica could not be connected for (routed again)
        self.subscribers: list[KVEventSubscriber | None] = [None] * n
        self.client: httpx.AsyncClient | None = None
        self.draining = False
        self.health = HealthWatch(
            n,
            restart_after,
            take_out=lambda i: router.set_healthy(i, False),
            put_back=lambda i: router.set_healthy(i, True),
            replace=self.replace,
        )
        self._watching: asyncio.Task | None = None

    # ---- life --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the replicas and wait until all are ready (ReplicaStartError when one cannot start)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        for i in range(len(self.flights)):
            self.router.set_healthy(i, False)
        await self.replicas.start()
        self._watching = asyncio.ensure_future(self.health.watch(self.client, self.replicas.replicas))

    async def stop(self, timeout: float = 10.0) -> None:
        if self._watching is not None:
            self._watching.cancel()
        await self.replicas.stop(timeout)
        for i, sub in enumerate(self.subscribers):
            if sub is not None:
                await asyncio.to_thread(sub.close)
                self.subscribers[i] = None
        if self.client is not None:
            await self.client.aclose()

    async def replica_up(self, replica: Replica) -> None:
        i, ready = replica.index, replica.ready
        self.router.clear(i)
        if ready.events is not None:
            self.subscribers[i] = KVEventSubscriber(
                ready.events, lambda batch: self.router.apply(i, batch), ready.replay
            )
        else:
            log.warning("replica %d publishes no KV events: the cache policy cannot see its cache", i)
        self.health.up(i, replica.pid)
        self.router.set_healthy(i, True)

    async def replica_down(self, replica: Replica) -> None:
        i = replica.index
        self.router.set_healthy(i, False)
        self.router.clear(i)
        self.health.down(i)
        code = replica.process.returncode if replica.process is not None else None
        if replica.replacing is not None:
            why = f"it was restarted: {replica.replacing}"
        else:
            why = f"its process {describe_exit(code)}" if code is not None else "it stopped"
        for flight in list(self.flights[i]):
            flight.end(replica_failed(i, why))
        sub, self.subscribers[i] = self.subscribers[i], None
        if sub is not None:
            await asyncio.to_thread(sub.close)

    def replace(self, i: int, why: str) -> None:
        """Restart replica ``i``, whose process runs on but cannot serve; its requests in flight end first,
        with the reason (the kill would only tell them that the connection broke)."""
        for flight in list(self.flights[i]):
            flight.end(replica_failed(i, f"it was restarted: {why}"))
        self.replicas.replace(self.replicas.replicas[i], why)

    # ---- the server's drain interface --------------------------------------------------------------
    def unavailable(self) -> APIError | None:
        if self.draining:
            return APIError(
                503, "the server is shutting down and takes no more requests", code="shutting_down"
            )
        if not any(r["healthy"] for r in self.router.snapshot()):
            return no_replica(self.health.states())
        return None

    def health_body(self) -> dict:
        """``/health`` while a replica takes requests: each replica's state (ok, or why it is out)."""
        return {"status": "ok", "replicas": self.health.states()}

    def begin_drain(self) -> None:
        self.draining = True

    def fail_all(self, error: APIError) -> None:
        for flights in self.flights:
            for flight in list(flights):
                flight.end(error)

    # ---- routing and proxying ------------------------------------------------------------------------
    async def route_and_proxy(
        self, http: Request, request: RouteRequest, raw: bytes, record: dict
    ) -> Response:
        """Route and proxy; a replica that cannot be connected to, or that refuses the request before taking
        it, is left out and the request routed again (502 ``replica_failed`` when none could be connected
        to, 503 ``no_replica`` when every one tried refused)."""
        tried: frozenset[int] = frozenset()
        refused: dict[int, str] = {}  # replica -> its refusal's code
        last = -1  # the replica that could not be connected to last
        while True:
            try:
                route = self.router.choose(request, tried)
            except NoReplica:
                if tried and set(refused) != tried:
                    why = f"no replica could be connected to (tried {', '.join(map(str, sorted(tried)))})"
                    return replica_failed(last, why).response()
                states = {**self.health.states(), **{str(i): code for i, code in refused.items()}}
                raise no_replica(states) from None
            record.update(replica=route.replica, route=route.reason, matched=route.matched_tokens)
            try:
                return await self.proxy(http, route, raw, record)
            except Unreachable as e:
                last = e.replica
                self.unreachable[last] += 1
                tried |= {last}
                record["unreachable"] = sorted(tried - set(refused))
                log.warning("replica %d could not be connected to (%s); routing the request again", last, e)
            except Refused as e:
                refused[e.replica] = e.code
                tried |= {e.replica}
                record["refused"] = ",".join(f"{i}:{c}" for i, c in sorted(refused.items()))
                log.warning("replica %d refused the request (%s); routing it again", e.replica, e)

    def url(self, replica: int) -> str:
        url = self.replicas.replicas[replica].url
        if url is None:
            raise APIError(503, f"replica {replica} is not running", code="replica_unavailable")
        return url

    def judge(self, replica: int, pid: int | None, status: int, body: bytes) -> None:
        """What a replica's error answer says about it (``dp.health``): Refused when it did not take the
        request because its engine cannot."""
        verdict = server_verdict(status, body)
        if verdict is None:
            return
        self.health.judge(replica, pid, verdict)
        if status == 503:
            raise Refused(replica, verdict)

    async def proxy(self, http: Request, route: Route, raw: bytes, record: dict) -> Response:
        """Send the request to ``route.replica``; its response, streamed through when it is SSE."""
        i = route.replica
        flight = Flight(route)
        self.flights[i].add(flight)
        self.router.started(route)
        upstream: httpx.Response | None = None

        def release() -> None:
            if flight in self.flights[i]:
                self.flights[i].discard(flight)
                self.router.finished(route)

        async def close() -> None:
            release()
            if upstream is not None:
                await upstream.aclose()

        gone = asyncio.ensure_future(client_gone(http))
        gone.add_done_callback(lambda t: t.cancelled() or flight.end(None))
        streaming = False
        try:
            headers = {k: v for k, v in http.headers.items() if k in FORWARDED_HEADERS}
            pid = self.replicas.replicas[i].pid
            request = self.client.build_request(
                "POST", self.url(i) + http.url.path, content=raw, headers=headers
            )
            try:
                upstream = await flight.wait(self.client.send(request, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing was sent: routed again
                raise Unreachable(i, e) from e
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                body = await flight.wait(upstream.aread())
                self.judge(i, pid, upstream.status_code, body)
                media = upstream.headers.get("content-type", "application/json")
                return Response(body, status_code=upstream.status_code, media_type=media)
            gone.cancel()  # the streaming response watches the client itself
            streaming = True
            return ProxiedStream(self._events(flight, upstream, record), upstream.status_code, close)
        except Ended as e:
            return self._ended(e, i, record)
        except httpx.HTTPError as e:
            return self._lost(e, i, record).response()
        finally:
            gone.cancel()
            if not streaming:
                await close()

    async def _events(self, flight: Flight, upstream: httpx.Response, record: dict):
        """The replica's SSE events as they come, whole events at a time, or an error event to end them."""
        buffer = b""
        chunks = upstream.aiter_raw()
        try:
            while True:
                try:
                    chunk = await flight.wait(chunks.__anext__())
                except StopAsyncIteration:
                    break
                buffer += chunk
                cut = buffer.rfind(b"\n\n")
                if cut >= 0:
                    yield buffer[: cut + 2]
                    buffer = buffer[cut + 2 :]
            if buffer:
                yield buffer
        except Ended as e:
            if e.error is None:
                return
            record.update(error=e.error.type, code=e.error.code)
            self._count_failure(flight.route.replica, e.error)
            yield sse(e.error.body()) + SSE_DONE
        except httpx.HTTPError as e:
            err = self._lost(e, flight.route.replica, record)
            yield sse(err.body()) + SSE_DONE

    def _ended(self, e: Ended, replica: int, record: dict) -> Response:
        if e.error is None:
            record["client"] = "disconnected"
            return Response(status_code=CLIENT_CLOSED)
        self._count_failure(replica, e.error)
        record.update(error=e.error.type, code=e.error.code)
        return e.error.response()

    def _lost(self, e: httpx.HTTPError, replica: int, record: dict) -> APIError:
        """The connection to the replica broke (it died, or is restarting)."""
        err = replica_failed(replica, f"connection lost: {type(e).__name__}: {e}")
        self._count_failure(replica, err)
        record.update(error=err.type, code=err.code)
        return err

    def _count_failure(self, replica: int, err: APIError) -> None:
        if err.code == "replica_failed":
            self.failed[replica] += 1

    async def forward_get(self, path: str, http: Request) -> Response:
        """A GET answered by the first healthy replica (``/v1/models``; not routed, not counted)."""
        live = [r["replica"] for r in self.router.snapshot() if r["healthy"]]
        if not live:
            raise APIError(503, "no replica is ready to take requests", code="no_replica")
        headers = {k: v for k, v in http.headers.items() if k in FORWARDED_HEADERS}
        try:
            response = await self.client.get(self.url(live[0]) + path, headers=headers)
        except httpx.HTTPError as e:
            return replica_failed(live[0], f"connection lost: {type(e).__name__}").response()
        media = response.headers.get("content-type", "application/json")
        return Response(response.content, status_code=response.status_code, media_type=media)

    async def metrics_text(self) -> str:
        urls = [r.url for r in self.replicas.replicas]
        texts = await metrics.scrape(self.client, urls)
        own = metrics.router_families(
            self.router.snapshot(), self.replicas.replicas, self.failed, self.unreachable, self.health
        )
        return metrics.render(texts, own)


def no_replica(states: dict[str, str]) -> APIError:
    said = ", ".join(f"replica {i}: {state}" for i, state in states.items())
    return APIError(503, f"no replica is ready to take requests ({said})", code="no_replica")


def replica_failed(replica: int, why: str) -> APIError:
    return APIError(
        502, f"replica {replica} failed while serving this request ({why})", code="replica_failed"
    )


class ProxiedStream(StreamingResponse):
    """A streaming response that always releases its proxied request, however the stream ends (even when
    the client left before the first byte, when the body iterator never starts)."""

    def __init__(self, content, status_code: int, on_close):
        super().__init__(content, status_code=status_code, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def create_front_app(front: Front, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    options.check()

    app = openai_app(front, options, health_body=front.health_body)  # ok while a replica is healthy

    @app.get("/v1/models")
    async def models(http: Request):
        return await front.forward_get("/v1/models", http)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(await front.metrics_text(), media_type="text/plain; version=0.0.4")

    async def handle(http: Request, chat: bool) -> Response:
        record = http.scope["state"]["log"]
        if (err := front.unavailable()) is not None:
            raise err
        raw = await read_body(http, options.max_request_bytes, options.read_timeout)
        try:
            request = await front.prompts.route_request(raw, chat)
        except APIError:
            request = RouteRequest([])  # the replica answers with its own error
        if request.token_ids:
            record["prompt_tokens"] = len(request.token_ids)
        return await front.route_and_proxy(http, request, raw, record)

    add_completion_routes(app, handle)
    return app
