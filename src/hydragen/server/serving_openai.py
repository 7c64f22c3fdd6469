"""OpenAI's answer to a generation request, which chat and text completions share: one JSON body with the
choices and usage, or server-sent events (chunks of choices as the reports come, usage on request, then
``[DONE]``). What differs between the two is their ``Choices``, the renderer each module supplies."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hydragen.engine.outputs import CompletionOutput
from hydragen.server.engine_client import RequestStream
from hydragen.server.errors import APIError
from hydragen.server.responses import SSE_DONE, Tally, sse
from hydragen.server.serving import CLIENT_CLOSED, Reports, RequestLog, Serving


class Choices(Protocol):
    """How one API renders a request's choices; choice ``k`` is sample ``k % n`` of prompt ``k // n``."""

    object: str  # the response's "object"
    chunk_object: str  # its stream chunks' "object"

    def opening(self, count: int) -> list[dict]:
        """The stream's first choices, before any report (chat: each choice's role)."""
        ...

    def delta(self, index: int, piece: CompletionOutput) -> list[dict]:
        """The stream's choices for one report's piece of choice ``index``."""
        ...

    def final(self, index: int, text: str, ids: list[int], logprobs: list, reason: str | None) -> dict:
        """A whole choice of a non-streaming response."""
        ...


class OpenAIServing(Serving):
    """The shared steps, answered in OpenAI's shapes."""

    async def answer(
        self, http: Request, body, streams: list[RequestStream], choices: Choices, log: RequestLog
    ) -> Response:
        """The response: one JSON body, or server-sent events as the reports come (``body.stream``)."""
        meta = {"id": log.id, "created": int(time.time()), "model": body.model}
        log.record["stream"] = body.stream
        if not body.stream:
            return await self.respond(http, streams, body.n, choices, meta, log)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = self.events(streams, body.n, choices, meta, include_usage, log)
        return StreamingResponse(events, media_type="text/event-stream")

    async def respond(
        self,
        http: Request,
        streams: list[RequestStream],
        n: int,
        choices: Choices,
        meta: dict,
        log: RequestLog,
    ) -> Response:
        collected = await self.collect(http, streams, n, log)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(
            {
                **meta,
                "object": choices.object,
                "choices": [choices.final(*choice) for choice in collected.choices()],
                "usage": collected.tally.usage().openai(),
            }
        )

    async def events(
        self,
        streams: list[RequestStream],
        n: int,
        choices: Choices,
        meta: dict,
        include_usage: bool,
        log: RequestLog,
    ) -> AsyncIterator[str]:
        chunk_base = {**meta, "object": choices.chunk_object}
        tally, ended = Tally(), False
        try:
            with Reports(self.client, streams) as reports:
                for choice in choices.opening(len(streams) * n):
                    yield sse({**chunk_base, "choices": [choice]})
                async for p_idx, report in reports:
                    log.first_token(report)
                    tally.add(report)
                    for piece in report.outputs:
                        for choice in choices.delta(p_idx * n + piece.index, piece):
                            chunk = {**chunk_base, "choices": [choice]}
                            if include_usage:
                                chunk["usage"] = None
                            yield sse(chunk)
                ended = True
            if include_usage:
                yield sse({**chunk_base, "choices": [], "usage": tally.usage().openai()})
            log.finished(tally)
            yield SSE_DONE
        except APIError as err:  # the request failed: the stream ends with its error
            log.failed(err)
            yield sse(err.body())
            yield SSE_DONE
        except Exception as e:  # a bug while formatting: end this stream with an error, never hang it
            err = APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")
            log.failed(err)
            yield sse(err.body())
            yield SSE_DONE
        finally:
            if not ended and not log.has_failed:
                log.disconnected()
