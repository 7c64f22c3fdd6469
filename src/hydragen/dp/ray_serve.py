"""hydragen on Ray Serve: engine replicas on any machines of a Ray cluster, one OpenAI endpoint in front,
each request routed to the replica whose prefix cache holds the most of its prompt.

Two deployments (``build_app``):

* ``HydragenReplica`` (``data_parallel_size`` of them, placed by Ray on any node): an ``LLM`` and
  hydragen's own OpenAI app (``server.app.create_app``), which each request runs through in-process
  (``dp.asgi_call``), so a replica answers exactly as ``hydragen serve`` does, errors and streaming
  included. It publishes its prefix cache's KV events (``dp.kv_events``) on its node's address and gives
  that address to the router through ``record_replica_metadata``. Ray Serve health-checks it
  (``check_health``: a failed engine, or a step stuck past ``--step-timeout``, makes Ray replace it).
* ``HydragenIngress`` (behind Ray Serve's HTTP proxy): reads the body, computes the exact prompt token
  ids the replica will see (``dp.prompts``), and calls a replica through a handle whose request router is
  ``dp.ray_router.HydragenRequestRouter``; the replica's response streams back as it comes, with an
  ``x-hydragen-replica`` header naming the replica. A replica that refuses a request because its engine
  cannot take it (503 ``engine_failed`` or ``engine_stalled``, until Ray's health check replaces it) never
  took it, so the ingress routes it again, telling the router to pass that replica over. Its ``/metrics``
  gives the router's figures.

``hydragen serve --ray`` runs it (``dp.ray_launch``); so does ``serve run hydragen.dp.ray_serve:app_builder``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from hydragen.dp.asgi_call import call_asgi, http_scope
from hydragen.dp.health import REFUSALS, server_verdict
from hydragen.dp.kv_events import KVEventPublisher
from hydragen.dp.prompts import RequestPrompts
from hydragen.dp.ray_router import (
    KV_EVENTS_KEY,
    REFUSED_KEY,
    ROUTE_KWARG,
    HydragenRequestRouter,
    live_routers,
)
from hydragen.dp.router import POLICIES
from hydragen.engine.config import DEFAULT_PAGE_SIZE
from hydragen.server.body import read_body
from hydragen.server.errors import APIError
from hydragen.server.options import ServerOptions
from hydragen.server.responses import SSE_DONE, sse
from hydragen.tp.checkpoint import read_config

log = logging.getLogger("hydragen.dp")
RAY_PREFIX = "ray-prefix"  # Ray Serve LLM's own approximate router (PrefixCacheAffinityRouter)
REPLICA_HEADER = "x-hydragen-replica"
REPLICA_DEPLOYMENT = "HydragenReplica"
APP_NAME = "hydragen"  # the name hydragen serve --ray and the docs deploy the app under
ROUTED_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}  # set again by the proxy


@dataclass
class ReplicaCall:
    """One HTTP request for a replica. ``prompt``: the text the request is routed on, read by Ray Serve
    LLM's ``PrefixCacheAffinityRouter`` (from any argument with a ``prompt`` attribute); a call without a
    prompt (``GET /v1/models``) gives its method and path, as that router needs some text."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str


class HydragenReplica:
    """One engine replica: the LLM, its OpenAI app, and its KV-event publisher."""

    def __init__(
        self, model: str | None, llm_options: dict, served_model_name: str | None, server_options: dict
    ):
        from hydragen import LLM
        from hydragen.server.app import create_app

        self.llm = LLM(model, **llm_options)
        host = ray.util.get_node_ip_address()
        self.events = KVEventPublisher(
            f"tcp://{host}:0", self.llm.engine.pool.page_size, replay_endpoint=f"tcp://{host}:0"
        )
        self.llm.engine.publish_kv_events(self.events.publish)
        name = served_model_name or self.llm.model_path.stem
        self.app = create_app(self.llm, name, ServerOptions(**server_options))
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def record_replica_metadata(self) -> dict:
        """Where the router subscribes to this replica's cache (sent once, when the replica is ready)."""
        return {
            KV_EVENTS_KEY: {"endpoint": self.events.endpoint, "replay_endpoint": self.events.replay_endpoint}
        }

    def check_health(self) -> None:
        """Ray Serve calls it periodically; raising makes Ray replace this replica: when its engine failed,
        or is stuck in a step past the step timeout (not while it drains for a shutdown)."""
        if (err := self.app.state.engine_client.unavailable()) is not None and err.code in REFUSALS:
            raise RuntimeError(f"{err.code}: {err.message}")

    async def handle(self, call: ReplicaCall, **_: Any):
        """One HTTP request through the app: first {"status", "headers", "replica"}, then body chunks.
        (The ingress's ``route`` keyword is for the router; it is ignored here.)"""
        scope = http_scope(call.method, call.path, call.query, call.headers)
        async for message in call_asgi(self.app, scope, call.body):
            if message["type"] == "http.response.start":
                yield {
                    "status": message["status"],
                    "headers": message.get("headers", []),
                    "replica": self.replica_id,
                }
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]

    def __del__(self) -> None:  # Ray Serve stops the replica
        if hasattr(self, "app"):
            self.app.state.engine_client.shutdown()  # its engine thread (no ASGI lifespan runs in-process)
        if hasattr(self, "events"):
            self.events.close()
        if hasattr(self, "llm"):
            self.llm.close()


class HydragenIngress:
    """The HTTP entry: computes each request's prompt ids and hands it to a replica through the router."""

    def __init__(
        self, replicas, model: str | None, tool_format: str | None, policy: str, server_options: dict
    ):
        self.replicas = replicas.options(method_name="handle", stream=True)
        config, path, _ = read_config(model)  # the model's config and tokenizer files only, no weights
        want_text = policy in ("approx", RAY_PREFIX)
        self.prompts = RequestPrompts.from_files(config, path, tool_format, want_text=want_text)
        self.options = ServerOptions(**server_options)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/metrics":
            return PlainTextResponse(router_metrics(), media_type="text/plain; version=0.0.4")
        try:
            body = await read_body(request, self.options.max_request_bytes, self.options.read_timeout)
        except APIError as e:
            return e.response()
        route, text = None, f"{request.method} {path}"
        if request.method == "POST" and path in ROUTED_PATHS:
            try:
                wanted = await self.prompts.route_request(body, ROUTED_PATHS[path])
                route, text = {"token_ids": wanted.token_ids, "text": wanted.text}, wanted.text or text
            except APIError:
                pass  # the replica refuses it with its own exact 4xx
        query = request.url.query.encode()
        replica_call = ReplicaCall(request.method, path, query, request.headers.raw, body, text)
        refused: list[str] = []  # replicas that refused it: their engine cannot take requests
        while True:
            call = self.replicas.remote(
                replica_call, **{ROUTE_KWARG: {**(route or {}), REFUSED_KEY: list(refused)}}
            )
            try:
                head = await call.__anext__()
            except Exception as e:  # the replica died before answering, or Ray could not reach it
                call.cancel()
                return replica_failed(e).response()
            headers = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in head["headers"]
                if k.lower() not in DROPPED_HEADERS
            }
            headers[REPLICA_HEADER] = head["replica"]
            if head["status"] != 503 or head["replica"] in refused:  # refused again: no other was left
                events = headers.get("content-type", "").startswith("text/event-stream")
                return StreamingResponse(relay(call, events), status_code=head["status"], headers=headers)
            try:
                answer = b"".join([chunk async for chunk in call])
            except Exception as e:
                return replica_failed(e).response()
            verdict = server_verdict(503, answer)
            if verdict is None:
                return Response(answer, status_code=503, headers=headers)
            log.warning("replica %s refused a request (%s); routing it again", head["replica"], verdict.code)
            refused.append(head["replica"])


async def relay(call, events: bool):
    """The replica's body chunks as they come; a replica lost mid-stream ends an SSE stream with an error
    event (a plain body just ends: its client sees it cut short)."""
    try:
        async for chunk in call:
            yield chunk
    except Exception as e:
        if events:
            yield sse(replica_failed(e).body())
            yield SSE_DONE
    finally:
        call.cancel()  # the client went away (or the stream ended): the replica aborts the request


def replica_failed(e: BaseException) -> APIError:
    log.warning("replica call failed: %s", e)
    return APIError(
        502, f"the replica serving this request failed: {type(e).__name__}", code="replica_failed"
    )


ROUTER_FIGURES = (  # (metric, type, help, how to read it from a Router.snapshot() row)
    ("hydragen_router_healthy", "gauge", "1 while a live replica holds the slot", lambda s: s["healthy"]),
    ("hydragen_router_in_flight", "gauge", "requests in flight there", lambda s: s["in_flight"]),
    (
        "hydragen_router_cached_pages",
        "gauge",
        "pages its KV events say it holds",
        lambda s: s["cached_pages"],
    ),
    (
        "hydragen_router_matched_tokens_total",
        "counter",
        "prompt tokens of requests routed there that it held (or was computing)",
        lambda s: s["matched_tokens"],
    ),
    ("hydragen_router_routed_total", "counter", "requests routed there", lambda s: sum(s["routed"].values())),
)


def router_metrics() -> str:
    """Prometheus text of the router in this process, one sample per replica slot (``replica="i"``)."""
    rows = [row for router in live_routers() for row in router.snapshot()]
    lines = []
    for name, kind, help_text, read in ROUTER_FIGURES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{row["replica"]}"}} {float(read(row))}' for row in rows]
    return "\n".join(lines) + "\n"


def build_app(
    model: str | None = None,
    data_parallel_size: int = 2,
    policy: str = "cache",
    balance_bound: int = 4,
    replica_cpus: float = 1.0,
    llm_options: dict | None = None,
    served_model_name: str | None = None,
    server_options: dict | None = None,
    max_ongoing_requests: int = 256,
    app_name: str = APP_NAME,
):
    """The Ray Serve application: ``data_parallel_size`` replicas of ``LLM(model, **llm_options)`` behind
    the ingress, routed by ``policy`` (``dp.router.POLICIES``). ``replica_cpus``: Ray CPUs each replica
    reserves (and its torch threads, unless ``llm_options`` says ``threads``). ``app_name``: the name it will
    be deployed under (``serve.run(app, name=...)``; the ray-prefix policy needs it)."""
    if policy not in (*POLICIES, RAY_PREFIX):
        raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, {RAY_PREFIX}; got {policy!r}")
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
    llm_options = dict(llm_options or {})
    llm_options.setdefault("threads", max(1, int(replica_cpus)))
    server_options = dict(server_options or {})
    ServerOptions(**server_options).check()
    if policy == RAY_PREFIX:
        router = ray_prefix_router(app_name)
    else:
        kwargs = {
            "policy": policy,
            "balance_bound": balance_bound,
            "max_replicas": data_parallel_size,
            "page_size": llm_options.get("page_size", DEFAULT_PAGE_SIZE),  # pending prefixes before any event
        }
        router = RequestRouterConfig(request_router_class=HydragenRequestRouter, request_router_kwargs=kwargs)
    replica = serve.deployment(
        HydragenReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=data_parallel_size,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=router,
    )
    ingress = serve.deployment(
        HydragenIngress,
        name="HydragenIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests * data_parallel_size,
    )
    replicas = replica.bind(model, llm_options, served_model_name, server_options)
    return ingress.bind(replicas, model, llm_options.get("tool_format"), policy, server_options)


def ray_prefix_router(app_name: str) -> RequestRouterConfig:
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` (an approximate tree of the text routed to each replica,
    like SGLang's), imported from its implementation module: the public ``ray.serve.llm`` path also imports
    pyarrow, which ``ray[serve]`` does not install.

    Its tree lives in a named actor that the router creates unless it exists. Created by Ray's default, the
    actor waits for a free CPU, and replicas that reserved every CPU would leave it waiting forever: when
    Ray is running it is created here first, under the router's own name, with no CPU reserved."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor
    from ray.serve._private.constants import SERVE_NAMESPACE

    if ray.is_initialized():
        PrefixTreeActor.options(
            name="LlmPrefixTreeActor",
            namespace=f"{SERVE_NAMESPACE}::{app_name}::{REPLICA_DEPLOYMENT}",
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
        ).remote()
    return RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter)


def app_builder(args: dict[str, str]):
    """For ``serve run hydragen.dp.ray_serve:app_builder model=PATH data_parallel_size=2 policy=cache``."""
    known = {"model", "data_parallel_size", "policy", "balance_bound", "replica_cpus", "served_model_name"}
    if unknown := set(args) - known:
        raise ValueError(
            f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
    return build_app(
        model=args.get("model"),
        data_parallel_size=int(args.get("data_parallel_size", 2)),
        policy=args.get("policy", "cache"),
        balance_bound=int(args.get("balance_bound", 4)),
        replica_cpus=float(args.get("replica_cpus", 1)),
        served_model_name=args.get("served_model_name"),
    )
