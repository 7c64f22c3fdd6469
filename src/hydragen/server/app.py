"""FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with SSE streaming), /health, /metrics.

A completion request goes: gate (host, API key) -> body read (size and time bounded) -> parse and
validate on a worker thread -> tokenize on a worker thread (context checks) -> engine -> response. Every
failure on the way is an ``APIError`` in OpenAI's shape; a client that goes away has its requests aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sampling_params import MAX_N, ParamError
from hydragen.server.body import parse_body, read_body
from hydragen.server.engine_client import RequestStream
from hydragen.server.errors import APIError, install_error_handlers
from hydragen.server.in_process_client import InProcessClient
from hydragen.server.loads import add_loads_route
from hydragen.server.metrics import LatencyMetrics, render_gauges
from hydragen.server.middleware import Gate
from hydragen.server.options import ServerOptions
from hydragen.server.prompts import PromptEncoder
from hydragen.server.protocol import ChatCompletionRequest, CompletionRequest, refuse_unsupported
from hydragen.server.responses import SSE_DONE, Collected, Shapes, sse, usage

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default); chat gets the room left
CLIENT_CLOSED = 499  # logged status of a request whose client went away before its response


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
    client = InProcessClient(llm, metrics, options.step_timeout, restarts)
    tok, tool_format = llm.tokenizer, llm.tool_format  # the same for every rebuild: the same model files
    encoder = PromptEncoder(tok, llm.config.max_position_embeddings, llm.config.vocab_size)

    app = openai_app(client, options, on_shutdown=client.shutdown)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": int(client.started), "owned_by": "hydragen"}
            ],
        }

    add_loads_route(app, client)  # what model gateways (smg) poll

    @app.get("/metrics")
    async def prometheus():
        snap = client.snapshot()  # published by the engine thread after every step; never the live state
        st, unavailable = snap.stats, client.unavailable()
        rows = [
            (
                "hydragen_requests_running",
                "gauge",
                "sequences holding KV pages (decoding or prefilling)",
                snap.running,
            ),
            ("hydragen_requests_waiting", "gauge", "sequences waiting for admission", snap.waiting),
            (
                "hydragen_kv_pages_used",
                "gauge",
                f"KV pages in use, held or cached ({snap.page_size} tokens a page)",
                snap.pages_used,
            ),
            ("hydragen_kv_pages_free", "gauge", "free KV pages", snap.pages_total - snap.pages_used),
            ("hydragen_kv_pages_peak", "gauge", "most KV pages in use at once since start", snap.pages_peak),
            ("hydragen_kv_page_size", "gauge", "tokens a KV page holds", snap.page_size),
            (
                "hydragen_prefix_cache_tokens",
                "gauge",
                "tokens held by the prefix tree (whole pages)",
                snap.pages_cached * snap.page_size,
            ),
            ("hydragen_prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens", st.hit_rate),
            (
                "hydragen_generation_tokens_per_second",
                "gauge",
                "decode rate over the last 5 s",
                client.tokens_per_second,
            ),
            (
                "hydragen_engine_healthy",
                "gauge",
                "1 while the engine takes requests",
                unavailable is None,
            ),
            (
                "hydragen_engine_restarting",
                "gauge",
                "1 while the engine is rebuilt after its tensor-parallel group broke",
                unavailable is not None and unavailable.code == "engine_restarting",
            ),
            (
                "hydragen_engine_restarts_total",
                "counter",
                "tries to rebuild the engine after its tensor-parallel group broke (failed ones included)",
                restarts.count if restarts is not None else 0,
            ),
            (
                "hydragen_prompt_tokens_total",
                "counter",
                "prompt tokens of admitted sequences",
                st.prompt_tokens,
            ),
            ("hydragen_prefill_tokens_total", "counter", "prompt tokens computed", st.prefill_tokens),
            ("hydragen_generation_tokens_total", "counter", "generated tokens", st.generated_tokens),
            ("hydragen_requests_finished_total", "counter", "finished requests", st.requests_finished),
            (
                "hydragen_requests_failed_total",
                "counter",
                "requests ended by an engine error",
                metrics.failed,
            ),
            ("hydragen_preemptions_total", "counter", "sequences preempted for memory", st.preemptions),
        ]
        text = render_gauges(rows) + metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                code="model_not_found",
            )

    async def handle(http: Request, chat: bool):
        started = time.monotonic()
        record = http.scope["state"]["log"]
        record["id"] = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if (err := client.unavailable()) is not None:
            raise err
        raw = await read_body(http, options.max_request_bytes, options.read_timeout)
        body = await parse_body(raw, ChatCompletionRequest if chat else CompletionRequest, refuse_unsupported)
        check_model(body.model)
        logprobs = body.logprobs_count()
        requested = body.requested_max_tokens()
        body.sampling_params(1 if requested is None else requested, logprobs)  # every value checked up front
        prompts, tools = await encoder.request_prompts(body, chat, tool_format)
        if len(prompts) * body.n > MAX_N:
            raise APIError(
                400,
                f"prompts x n must be at most {MAX_N}, got {len(prompts) * body.n}",
                "n",
                code="invalid_value",
            )
        params = []
        for i, (ids, _) in enumerate(prompts):
            where = "messages" if chat else ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
            encoder.check_length(len(ids), where)
            default = None if chat else DEFAULT_MAX_TOKENS
            max_tokens = encoder.max_tokens(
                len(ids), body.requested_max_tokens(), default, body.max_tokens_param
            )
            params.append(body.sampling_params(max_tokens, logprobs))
        record["prompt_tokens"] = sum(len(ids) for ids, _ in prompts)
        field = body.structured_field()
        if tools is not None and tools.enforced:
            params, field = await tool_params(tools, params, body.literal_json_schema), "tools"
        else:
            await precompile(params[0].structured_outputs, field)
        subs = await submit_all(prompts, params, chat, body.max_tokens_param, record["id"], field)
        enforced = tools if tools is not None and tools.enforced else None
        shapes = Shapes(tok, chat, (body.top_logprobs or 0) if chat else 0, logprobs is not None, enforced)
        meta = {"id": record["id"], "created": int(time.time()), "model": body.model}
        record["stream"] = body.stream
        if not body.stream:
            return await respond(http, subs, body.n, shapes, meta, chat, record, started)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream(subs, body.n, shapes, meta, chat, include_usage, record, started)
        return StreamingResponse(events, media_type="text/event-stream")

    async def precompile(constraint, field: str) -> None:
        """Compile the request's constraint before the engine thread gets it (400 naming ``field``)."""
        try:
            await client.compile(constraint)
        except ParamError as e:
            raise APIError(400, str(e), field, code="invalid_value") from None

    async def tool_params(tools, params, literal: bool | None):
        """The request's params with its tool-call grammar, built and compiled off the event loop (errors
        name the tool whose schema is at fault)."""

        def build(ll_tokenizer, default_literal: bool):
            return tools.constraint(ll_tokenizer, default_literal if literal is None else literal)

        try:
            return tools.sampling_params(params, await client.compile(build))
        except ParamError as e:
            if e.param == "structured_outputs":  # the grammar did not compile
                e = tools.locate(e)
            raise APIError(400, str(e), e.param, code="invalid_value") from None

    async def submit_all(
        prompts,
        params,
        chat: bool,
        max_tokens_param: str,
        label: str,
        structured_param: str = "structured_outputs",
    ) -> list[RequestStream]:
        subs: list[RequestStream] = []
        try:
            for i, ((ids, text), p) in enumerate(zip(prompts, params, strict=True)):
                name = label if len(prompts) == 1 else f"{label} prompt {i}"
                subs.append(await client.submit(ids, p, text, name))
        except (ValueError, TypeError) as e:
            for stream in subs:
                client.abort(stream.request_id)
            param = getattr(e, "param", None) or "prompt"
            if param == "prompt" and chat:
                param = "messages"
            elif param == "max_tokens":
                param = max_tokens_param
            elif param == "structured_outputs":  # a constraint the grammar engine could not compile
                param = structured_param
            raise APIError(400, str(e), param, code="invalid_value") from None
        except BaseException:
            for stream in subs:
                client.abort(stream.request_id)
            raise
        return subs

    async def respond(http, subs, n, shapes, meta, chat, record, started) -> Response:
        collected, finals = Collected(), []
        gone = asyncio.ensure_future(client_gone(http))
        pending = list(subs)
        try:
            for p_idx, stream in enumerate(subs):
                while True:
                    getter = asyncio.ensure_future(anext(stream))
                    await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        record["client"] = "disconnected"
                        return Response(status_code=CLIENT_CLOSED)
                    report: RequestOutput = getter.result()  # a failed request raises its APIError
                    if record.get("ttft") is None and any(c.token_ids for c in report.outputs):
                        record["ttft"] = f"{time.monotonic() - started:.3f}s"
                    collected.add(p_idx * n, report)
                    if report.finished:
                        finals.append(report)
                        pending.remove(stream)
                        break
        finally:
            gone.cancel()
            for stream in pending:  # an error, or the client went away: free their pages now
                client.abort(stream.request_id)
        note_finish(record, collected.completion_tokens, finals, collected.reasons.values())
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion" if chat else "text_completion",
                "choices": collected.choices(shapes),
                "usage": usage(finals, collected.completion_tokens),
            }
        )

    async def stream(subs, n, shapes, meta, chat, include_usage, record, started) -> AsyncIterator[str]:
        chunk_base = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}
        finals: list[RequestOutput] = []
        reasons: list[str] = []
        completion_tokens = 0
        pending = dict(enumerate(subs))  # prompt index -> its stream
        try:
            if chat:
                for k in range(len(subs) * n):
                    yield sse({**chunk_base, "choices": [shapes.role_choice(k)]})
            while pending:
                getters = {asyncio.ensure_future(anext(s)): p_idx for p_idx, s in pending.items()}
                done, rest = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for fut in rest:
                    fut.cancel()
                for fut in done:
                    p_idx = getters[fut]
                    try:
                        report: RequestOutput = fut.result()
                    except APIError as err:  # the request failed: the stream ends with its error
                        record.update(error=err.type, code=err.code)
                        yield sse(err.body())
                        yield SSE_DONE
                        return
                    if record.get("ttft") is None and any(c.token_ids for c in report.outputs):
                        record["ttft"] = f"{time.monotonic() - started:.3f}s"
                    for d in report.outputs:
                        completion_tokens += len(d.token_ids)
                        if d.finish_reason:
                            reasons.append(d.finish_reason)
                        for choice in shapes.delta_choices(p_idx * n + d.index, d):
                            chunk = {**chunk_base, "choices": [choice]}
                            if include_usage:
                                chunk["usage"] = None
                            yield sse(chunk)
                    if report.finished:
                        finals.append(report)
                        pending.pop(p_idx)
            if include_usage:
                yield sse({**chunk_base, "choices": [], "usage": usage(finals, completion_tokens)})
            note_finish(record, completion_tokens, finals, reasons)
            yield SSE_DONE
        except Exception as e:  # a bug while formatting: end this stream with an error, never hang it
            err = APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")
            record.update(error=err.type, code=err.code)
            yield sse(err.body())
            yield SSE_DONE
        finally:
            if pending and "error" not in record:
                record["client"] = "disconnected"
            for stream in pending.values():  # client went away (or an error): free their pages now
                client.abort(stream.request_id)

    add_completion_routes(app, handle)
    return app


def add_completion_routes(app: FastAPI, handle) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions``, answered by ``handle(request, chat)``."""

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await handle(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await handle(http, chat=True)


def note_finish(record: dict, completion_tokens: int, finals: list[RequestOutput], reasons) -> None:
    record["completion_tokens"] = completion_tokens
    record["cached_tokens"] = sum(r.cached_prompt_tokens for r in finals)
    record["finish"] = ",".join(sorted({r for r in reasons if r})) or None


async def client_gone(http: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only a disconnect can arrive)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
