"""The server's FastAPI app, wired: an ``EngineClient`` behind OpenAI's routes.

``create_app(llm, ...)`` runs ``llm`` in an ``InProcessClient`` and serves ``/v1/completions``
(``serving_completion``), ``/v1/chat/completions`` (``serving_chat``), ``/v1/models``
(``serving_models``), ``/metrics`` (``metrics_route``), ``/v1/loads`` (``loads``) and ``/health``. The
routes reach the engine through the client alone; the hops of one request are in docs/design.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hydragen.server.engine_client import EngineClient
from hydragen.server.errors import install_error_handlers
from hydragen.server.in_process_client import InProcessClient
from hydragen.server.loads import add_loads_route
from hydragen.server.metrics import LatencyMetrics
from hydragen.server.metrics_route import add_metrics_route
from hydragen.server.middleware import Gate
from hydragen.server.options import ServerOptions
from hydragen.server.prompts import PromptEncoder
from hydragen.server.serving_chat import ChatServing
from hydragen.server.serving_completion import CompletionServing
from hydragen.server.serving_models import ServedModel, add_models_route

# Answers a generation request: (the HTTP request, whether it is a chat completion) -> its response.
Handler = Callable[[Request, bool], Awaitable[Response]]


def openai_app(engine_client, options: ServerOptions, on_shutdown=None, health_body=None) -> FastAPI:
    """What the server and the data-parallel front (``dp.front``) share: errors in OpenAI's shape, the
    gate, ``/health`` from ``engine_client.unavailable()``, and ``engine_client`` in ``app.state``, which
    HydragenServer drains on SIGTERM (``begin_drain``, ``fail_all``): an ``EngineClient``, or the front.
    ``on_shutdown`` runs when the app stops; ``health_body()`` gives the body of an ok ``/health``
    (default ``{"status": "ok"}``)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="hydragen", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_client = engine_client
    app.state.options = options
    install_error_handlers(app)
    app.add_middleware(Gate, api_key=options.api_key, allowed_hosts=options.allowed_hosts)

    @app.get("/health")
    async def health():
        err = engine_client.unavailable()
        if err is not None:
            return err.response()
        return health_body() if health_body is not None else {"status": "ok"}

    return app


def create_app(
    llm, model_name: str, options: ServerOptions | None = None, rebuild: Callable[[], Any] | None = None
) -> FastAPI:
    """The server's app for ``llm``. ``rebuild()`` makes a new LLM with the same options: given, the server
    rebuilds its engine when the tensor-parallel group breaks (``engine_restarts``), at most
    ``options.max_restarts_per_minute`` times a minute. The app then owns ``llm``: it reaches the engine
    through ``app.state.engine_client`` only, and the caller should keep no reference (a restart frees it)."""
    options = options or ServerOptions()
    options.check()
    metrics = LatencyMetrics()
    restarts = None
    if rebuild is not None:
        from hydragen.server.engine_restarts import GroupRestarts

        restarts = GroupRestarts(rebuild, options.max_restarts_per_minute)
    model = ServedModel.of(llm, model_name)  # the same for every rebuild: the same model files
    client = InProcessClient(llm, metrics, options.step_timeout, restarts)
    return serving_app(client, model, options, metrics)


def serving_app(
    client: EngineClient, model: ServedModel, options: ServerOptions, metrics: LatencyMetrics
) -> FastAPI:
    """OpenAI's routes over ``client``, which serves ``model``; ``metrics``: the latencies it observes."""
    app = openai_app(client, options, on_shutdown=client.shutdown)
    add_models_route(app, client, model)
    add_loads_route(app, client)  # what model gateways (smg) poll
    add_metrics_route(app, client, metrics)
    encoder = PromptEncoder(model.tokenizer, model.context, model.vocab_size)
    chat = ChatServing(client, model, encoder, options)
    completion = CompletionServing(client, model, encoder, options)

    async def handle(http: Request, is_chat: bool) -> Response:
        return await (chat if is_chat else completion).create(http)

    add_completion_routes(app, handle)
    return app


def add_completion_routes(app: FastAPI, handle: Handler) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions``, answered by ``handle(request, chat)``: the
    server's serving modules, or the data-parallel front's proxy."""

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await handle(http, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await handle(http, True)
