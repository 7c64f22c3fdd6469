"""The steps of serving one generation request that every API shares, whatever its JSON shapes.

An API's module (``serving_chat``, ``serving_completion``, and any API beside them) calls them in order,
each a function of data: ``read`` (HTTP request -> validated body), ``params`` (body and prompt ids ->
checked ``SamplingParams``), ``submit`` (-> one ``RequestStream`` per prompt), then ``Reports`` (the
streams' DELTA reports merged as they come) or ``collect`` (all of them added up), which it renders in its
own shapes. Every failure on the way is an ``APIError``; a client that goes away has its requests aborted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel

from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sampling_params import MAX_N, ParamError, SamplingParams
from hydragen.server.body import parse_body, read_body
from hydragen.server.engine_client import EngineClient, RequestStream
from hydragen.server.errors import APIError
from hydragen.server.options import ServerOptions
from hydragen.server.prompts import PromptEncoder
from hydragen.server.protocol import refuse_unsupported
from hydragen.server.responses import Collected, Tally
from hydragen.server.serving_models import ServedModel

CLIENT_CLOSED = 499  # logged status of a request whose client went away before its response
Body = TypeVar("Body", bound=BaseModel)
Prompts = list[tuple[list[int], str | None]]  # (token ids, text or None) per prompt


class GenerationBody(Protocol):
    """What the shared steps read of a parsed request body (``protocol.py``'s models provide it)."""

    model: str
    n: int  # samples per prompt

    def logprobs_count(self) -> int | None: ...

    def requested_max_tokens(self) -> int | None: ...

    @property
    def max_tokens_param(self) -> str: ...

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """The body's sampling fields as SamplingParams (``defaults`` for the ones it leaves unset: the
        model's own), or a 400 naming the field at fault."""
        ...


@dataclass(frozen=True)
class ParamNames:
    """The request fields that errors from the engine name: its prompt, max tokens and constraint."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    structured: str = "structured_outputs"


class RequestLog:
    """One request's line of the access log (the middleware's ``record``), noted as the steps go, and when
    the request began (for its time to first token)."""

    def __init__(self, record: dict, started: float) -> None:
        self.record, self.started = record, started

    @property
    def id(self) -> str:
        return self.record["id"]

    def first_token(self, report: RequestOutput) -> None:
        if self.record.get("ttft") is None and any(c.token_ids for c in report.outputs):
            self.record["ttft"] = f"{time.monotonic() - self.started:.3f}s"

    def finished(self, tally: Tally) -> None:
        self.record["completion_tokens"] = tally.completion_tokens
        self.record["cached_tokens"] = sum(r.cached_prompt_tokens for r in tally.finals)
        self.record["finish"] = ",".join(sorted(set(tally.reasons))) or None

    def failed(self, err: APIError) -> None:
        self.record.update(error=err.type, code=err.code)

    @property
    def has_failed(self) -> bool:
        return "error" in self.record

    def disconnected(self) -> None:
        self.record["client"] = "disconnected"


class Serving:
    """The shared steps over one engine client, serving one model."""

    def __init__(
        self, client: EngineClient, model: ServedModel, encoder: PromptEncoder, options: ServerOptions
    ):
        self.client, self.model, self.encoder, self.options = client, model, encoder, options

    async def read(self, http: Request, body_type: type[Body], id_prefix: str) -> tuple[Body, RequestLog]:
        """(the validated body, the request's log): 503 while the engine takes no requests, then the body
        read (size and time bounded), parsed and checked, and its model."""
        log = RequestLog(http.scope["state"]["log"], time.monotonic())
        log.record["id"] = id_prefix + uuid.uuid4().hex[:24]
        if (err := self.client.unavailable()) is not None:
            raise err
        raw = await read_body(http, self.options.max_request_bytes, self.options.read_timeout)
        body = await parse_body(raw, body_type, refuse_unsupported)
        self.model.check(body.model)
        return body, log

    def sampling(self, body: GenerationBody) -> int | None:
        """The body's logprobs count, once every sampling value in it is checked (a 400 before any
        tokenizing)."""
        logprobs = body.logprobs_count()
        requested = body.requested_max_tokens()
        body.sampling_params(1 if requested is None else requested, logprobs, self.model.sampling_defaults)
        return logprobs

    def params(
        self,
        body: GenerationBody,
        prompts: Prompts,
        logprobs: int | None,
        where: Callable[[int], str],
        default_max: int | None,
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt, its max tokens within the context left (``default_max`` when the
        body sets none; None: all that is left); 400 naming ``where(i)`` for a prompt that does not fit."""
        if len(prompts) * body.n > MAX_N:
            raise APIError(
                400,
                f"prompts x n must be at most {MAX_N}, got {len(prompts) * body.n}",
                "n",
                code="invalid_value",
            )
        params = []
        for i, (ids, _) in enumerate(prompts):
            self.encoder.check_length(len(ids), where(i))
            max_tokens = self.encoder.max_tokens(
                len(ids), body.requested_max_tokens(), default_max, body.max_tokens_param
            )
            params.append(body.sampling_params(max_tokens, logprobs, self.model.sampling_defaults))
        return params

    async def precompile(self, constraint, field: str) -> None:
        """Compile the request's constraint before it reaches the engine thread (400 naming ``field``)."""
        try:
            await self.client.compile(constraint)
        except ParamError as e:
            raise APIError(400, str(e), field, code="invalid_value") from None

    async def submit(
        self, prompts: Prompts, params: list[SamplingParams], label: str, names: ParamNames
    ) -> list[RequestStream]:
        """A stream per prompt, all or none: a prompt the engine refuses aborts the others (400 naming the
        field at fault)."""
        streams: list[RequestStream] = []
        try:
            for i, ((ids, text), p) in enumerate(zip(prompts, params, strict=True)):
                name = label if len(prompts) == 1 else f"{label} prompt {i}"
                streams.append(await self.client.submit(ids, p, text, name))
        except (ValueError, TypeError) as e:
            self.abort(streams)
            param = getattr(e, "param", None) or "prompt"
            if param == "prompt":
                param = names.prompt
            elif param == "max_tokens":
                param = names.max_tokens
            elif param == "structured_outputs":  # a constraint the grammar engine could not compile
                param = names.structured
            raise APIError(400, str(e), param, code="invalid_value") from None
        except BaseException:
            self.abort(streams)
            raise
        return streams

    def abort(self, streams: Iterable[RequestStream]) -> None:
        for stream in streams:
            self.client.abort(stream.request_id)

    async def collect(
        self, http: Request, streams: list[RequestStream], n: int, log: RequestLog
    ) -> Collected | None:
        """All of a request's reports added up (choice ``k``: sample ``k % n`` of prompt ``k // n``), or
        None when the client went away first; a failed request raises its APIError."""
        collected = Collected()
        gone = asyncio.ensure_future(client_gone(http))
        try:
            with Reports(self.client, streams, stop=gone) as reports:
                async for p_idx, report in reports:
                    log.first_token(report)
                    collected.add(p_idx * n, report)
        finally:
            gone.cancel()
        if reports.stopped:
            log.disconnected()
            return None
        log.finished(collected.tally)
        return collected


class Reports:
    """A request's streams merged: (prompt index, report) as each report comes, until every prompt's last
    (a failed request raises its APIError). ``stop``: a future that ends the iteration early when it is
    done first (``stopped`` then says so). Leaving the ``with`` block aborts the requests not finished."""

    def __init__(
        self, client: EngineClient, streams: list[RequestStream], stop: asyncio.Future | None = None
    ) -> None:
        self.client, self.stop, self.stopped = client, stop, False
        self.pending = dict(enumerate(streams))  # prompt index -> its stream, until its last report
        self._ready: list[tuple[int, asyncio.Future]] = []  # reports that came together, not yet handed

    def __enter__(self) -> Reports:
        return self

    def __exit__(self, *exc) -> None:
        for stream in self.pending.values():  # an error, or the client went away: free their pages now
            self.client.abort(stream.request_id)

    def __aiter__(self) -> Reports:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while not self._ready:
            if not self.pending or self.stopped:
                raise StopAsyncIteration
            getters = {asyncio.ensure_future(anext(s)): p_idx for p_idx, s in self.pending.items()}
            waited = set(getters) if self.stop is None else {*getters, self.stop}
            try:
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for fut in getters:
                    if not fut.done():
                        fut.cancel()
            self._ready = [(i, fut) for fut, i in getters.items() if fut.done() and not fut.cancelled()]
            self.stopped = not self._ready
        p_idx, fut = self._ready.pop(0)
        report: RequestOutput = fut.result()  # a failed request raises its APIError
        if report.finished:
            self.pending.pop(p_idx)
        return p_idx, report


async def client_gone(http: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only a disconnect can arrive)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
