"""FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with SSE streaming), /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hydragen.server.async_engine import AsyncEngine, Update
from hydragen.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 16


def create_app(llm, model_name: str) -> FastAPI:
    engine = AsyncEngine(llm)
    tok = llm.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="hydragen", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            msg = "request body is not valid JSON"
        elif err.get("type") == "missing":
            msg = f"missing required field {param!r}"
        else:
            msg = f"invalid value for {param!r}: {err.get('msg', 'invalid')}"
        return JSONResponse(APIError(400, msg, param).body(), status_code=400)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": int(engine.started), "owned_by": "hydragen"}
            ],
        }

    @app.get("/metrics")
    async def metrics():
        e = llm.engine
        st = e.stats
        used = e.pool.used_pages
        lines = [
            ("hydragen_requests_running", "gauge", "sequences in the decode batch", e.num_running),
            (
                "hydragen_requests_waiting",
                "gauge",
                "sequences waiting or prefilling",
                len(e.waiting) + len(e.prefilling),
            ),
            ("hydragen_kv_pages_used", "gauge", f"KV pages in use ({e.pool.page_size} tokens a page)", used),
            ("hydragen_kv_pages_free", "gauge", "free KV pages", e.pool.num_pages - used),
            ("hydragen_prefix_cache_tokens", "gauge", "tokens held by the prefix tree", e.tree.cached_tokens),
            ("hydragen_prefix_cache_hit_rate", "gauge", "cached prompt tokens / prompt tokens", st.hit_rate),
            (
                "hydragen_generation_tokens_per_second",
                "gauge",
                "decode rate over the last 5 s",
                engine.tokens_per_second,
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
            ("hydragen_preemptions_total", "counter", "sequences preempted for memory", st.preemptions),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {float(v)}\n" for n, t, h, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def submit_all(prompts, params) -> list[tuple[str, asyncio.Queue]]:
        subs = []
        try:
            for ids, text in prompts:
                subs.append(await engine.submit(ids, params, text))
        except ValueError as e:
            for rid, _ in subs:
                engine.abort(rid)
            param = "messages" if "chat" in str(e) else "prompt"
            raise APIError(400, str(e), param) from None
        return subs

    def encode(p) -> tuple[list[int], str | None]:
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
            return tok.encode(p), p
        return list(p), None

    def usage(updates: dict[str, Update], completion_tokens: int) -> dict:
        prompt_tokens = sum(u.prompt_tokens for u in updates.values())
        cached = sum(u.cached_tokens for u in updates.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def token_str(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    def completion_logprobs(lps: list[dict[int, float]], ids: list[int]) -> dict:
        return {
            "tokens": [token_str(t) for t in ids],
            "token_logprobs": [lp[t] for lp, t in zip(lps, ids, strict=False)],
            "top_logprobs": [{token_str(k): v for k, v in lp.items()} for lp in lps],
            "text_offset": [],
        }

    def chat_logprobs(lps: list[dict[int, float]], ids: list[int], top: int) -> dict:
        content = []
        for lp, t in zip(lps, ids, strict=False):
            alts = sorted(((k, v) for k, v in lp.items()), key=lambda kv: -kv[1])[:top]
            s = token_str(t)
            content.append(
                {
                    "token": s,
                    "logprob": lp[t],
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": token_str(k), "logprob": v, "bytes": list(token_str(k).encode())}
                        for k, v in alts
                    ],
                }
            )
        return {"content": content}

    async def run(http: Request, body, prompts, params, chat: bool):
        subs = await submit_all(prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        n = params.n
        top = (body.top_logprobs or 0) if chat else 0
        want_lp = params.logprobs is not None

        if not body.stream:
            results: dict[str, Update] = {}
            texts, ids, lps, reasons = {}, {}, {}, {}
            try:
                for p_idx, (req_id, q) in enumerate(subs):
                    while True:
                        upd: Update = await q.get()
                        if upd.error:
                            raise APIError(500, upd.error, type_="server_error")
                        for d in upd.deltas:
                            k = p_idx * n + d.index
                            texts[k] = texts.get(k, "") + d.text
                            ids.setdefault(k, []).extend(d.token_ids)
                            if d.logprobs:
                                lps.setdefault(k, []).extend(d.logprobs)
                            if d.finish_reason:
                                reasons[k] = d.finish_reason
                        if upd.finished:
                            results[req_id] = upd
                            break
            except (asyncio.CancelledError, APIError):
                for req_id, _ in subs:
                    engine.abort(req_id)
                raise
            choices = []
            for k in sorted(texts.keys() | reasons.keys()):
                c = {"index": k, "finish_reason": reasons.get(k)}
                if chat:
                    c["message"] = {"role": "assistant", "content": texts.get(k, "")}
                    c["logprobs"] = chat_logprobs(lps.get(k, []), ids.get(k, []), top) if want_lp else None
                else:
                    c["text"] = texts.get(k, "")
                    c["logprobs"] = completion_logprobs(lps.get(k, []), ids.get(k, [])) if want_lp else None
                choices.append(c)
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": usage(results, sum(len(v) for v in ids.values())),
            }

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            results: dict[str, Update] = {}
            completion_tokens = 0
            pending = {req_id: (p_idx, q) for p_idx, (req_id, q) in enumerate(subs)}
            try:
                if chat:
                    for p_idx in range(len(subs)):
                        for i in range(n):
                            yield _sse(
                                {
                                    "id": rid,
                                    "object": chunk_obj,
                                    "created": created,
                                    "model": body.model,
                                    "choices": [
                                        {
                                            "index": p_idx * n + i,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None,
                                            "finish_reason": None,
                                        }
                                    ],
                                }
                            )
                while pending:
                    getters = {asyncio.ensure_future(q.get()): req_id for req_id, (_, q) in pending.items()}
                    done, rest = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                    for fut in rest:
                        fut.cancel()
                    for fut in done:
                        req_id = getters[fut]
                        p_idx, _ = pending[req_id]
                        upd: Update = fut.result()
                        if upd.error:
                            yield _sse({"error": {"message": upd.error, "type": "server_error"}})
                            pending.pop(req_id)
                            continue
                        for d in upd.deltas:
                            completion_tokens += len(d.token_ids)
                            k = p_idx * n + d.index
                            if chat:
                                lp = (
                                    chat_logprobs(d.logprobs, d.token_ids, top)
                                    if want_lp and d.logprobs
                                    else None
                                )
                                choice = {
                                    "index": k,
                                    "delta": {"content": d.text} if d.text else {},
                                    "logprobs": lp,
                                    "finish_reason": d.finish_reason,
                                }
                            else:
                                lp = (
                                    completion_logprobs(d.logprobs, d.token_ids)
                                    if want_lp and d.logprobs
                                    else None
                                )
                                choice = {
                                    "index": k,
                                    "text": d.text,
                                    "logprobs": lp,
                                    "finish_reason": d.finish_reason,
                                }
                            chunk = {
                                "id": rid,
                                "object": chunk_obj,
                                "created": created,
                                "model": body.model,
                                "choices": [choice],
                            }
                            if include_usage:
                                chunk["usage"] = None
                            yield _sse(chunk)
                        if upd.finished:
                            results[req_id] = upd
                            pending.pop(req_id)
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": chunk_obj,
                            "created": created,
                            "model": body.model,
                            "choices": [],
                            "usage": usage(results, completion_tokens),
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                for req_id in pending:  # client went away (or an error): free its pages now
                    engine.abort(req_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, "logprobs must be in [0, 20]", "logprobs")
        params = body.sampling_params(body.logprobs, DEFAULT_MAX_TOKENS)
        prompts = [encode(p) for p in body.prompts()]
        return await run(http, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        check_model(body.model)
        if tok is None or not tok.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, "top_logprobs must be in [0, 20]", "top_logprobs")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(logprobs, llm.config.max_position_embeddings)
        try:
            ids = tok.apply_chat_template(body.conversation(), add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        room = llm.config.max_position_embeddings - len(ids)
        if body._max_tokens() is None and room > 0:
            params.max_tokens = min(params.max_tokens, room)
        return await run(http, body, [(ids, None)], params, chat=True)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
