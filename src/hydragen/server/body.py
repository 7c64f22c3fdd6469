"""Reading and parsing a request body: bounded in size and time, strict about encoding and values.

Python's JSON parser accepts things the engine cannot use: lone UTF-16 surrogates (``"\\ud800"``, which no
tokenizer can encode), ``NaN``/``Infinity`` literals and numbers like ``1e400`` that parse as infinity.
They are refused here with a 400 naming the field. Parsing and validation run on a worker thread, so a
body of many megabytes never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from hydragen.server.errors import APIError

M = TypeVar("M", bound=BaseModel)

# A \uD800-\uDFFF escape in the JSON text: the only way a lone surrogate gets into a parsed string (the
# UTF-8 decode already refused raw ones). Valid surrogate pairs match too; the walk then finds nothing.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

# An oversized body is still read (and thrown away) up to this much, so the client gets its 413 instead
# of a connection reset while it is still sending; beyond it the connection is simply closed.
DRAIN_BYTES = 64 * 2**20


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, or 413 when it is larger than ``limit`` bytes, or 408 when it takes too long."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or len(declared) > 18):
        raise APIError(400, "invalid Content-Length header", code="invalid_header")
    too_big = APIError(
        413,
        f"request body is larger than the server's limit of {limit} bytes (--max-request-bytes)",
        code="request_too_large",
    )
    if declared is not None and int(declared) > max(limit, DRAIN_BYTES):
        raise too_big

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                if size > DRAIN_BYTES:
                    break
                continue
            chunks.append(chunk)
        if size > limit:
            raise too_big
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"request body was not received within {timeout:g} s", code="request_timeout"
        ) from None


async def parse_body(raw: bytes, model: type[M], prepare=None) -> M:
    """Decode, parse, check and validate ``raw`` into ``model`` on a worker thread.

    ``prepare(dict) -> dict`` runs on the parsed object before validation (e.g. to refuse parameters
    the server does not implement with their own message).
    """
    return await asyncio.to_thread(_parse, raw, model, prepare)


def _parse(raw: bytes, model: type[M], prepare) -> M:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            400, f"request body is not valid UTF-8 (bad byte at offset {e.start})", code="invalid_json"
        ) from None
    nonfinite = []

    def parse_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            nonfinite.append(literal)
        return value

    def parse_constant(literal: str) -> float:
        nonfinite.append(literal)
        return float(literal)

    try:
        obj = json.loads(text, parse_float=parse_float, parse_constant=parse_constant)
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError) as e:  # an integer with too many digits, nesting too deep
        raise APIError(
            400, f"request body is not valid JSON: {type(e).__name__}: {e}", code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise APIError(
            400, f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    if nonfinite or _SURROGATE_ESCAPE.search(text):  # rare: only then walk the whole body to name the field
        check_values(obj)
    if prepare is not None:
        obj = prepare(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e, model) from None


def check_values(obj: Any) -> None:
    """400 for a lone surrogate in any string (keys too) or a non-finite number anywhere."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise APIError(
                    400,
                    f"{path or 'body'} holds a lone UTF-16 surrogate (not valid Unicode text)",
                    _param(path),
                    code="invalid_value",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise APIError(
                    400, f"{path} must be a finite number, got {value}", _param(path), code="invalid_value"
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                key_path = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    raise APIError(
                        400,
                        f"a key in {path or 'the body'} holds a lone UTF-16 surrogate",
                        _param(path),
                        code="invalid_value",
                    )
                stack.append((v, key_path))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _param(path: str) -> str | None:
    return path or None


def validation_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    """The first problem pydantic found, as a 400 naming the parameter."""
    errors = e.errors()
    first = errors[0]
    loc, kind = tuple(first.get("loc", ())), first.get("type", "")
    if kind == "extra_forbidden":  # the last part is the unknown key itself
        parent = _loc_param(loc[:-1], model)
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
    else:
        param = _loc_param(loc, model)
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"unsupported parameter {param!r}: this server does not implement it",
            param,
            code="unsupported_parameter",
        )
    if kind == "missing":
        return APIError(
            400, f"missing required parameter {param!r}", param, code="missing_required_parameter"
        )
    top = [err.get("loc", ())[:1] for err in errors]
    several = len(errors) > 1 and all(t == top[0] for t in top)  # a union: no accepted type matched
    detail = "not one of the accepted types" if several else first.get("msg", "invalid")
    return APIError(400, f"invalid value for {param!r}: {detail}", param, code="invalid_value")


def _loc_param(loc: tuple, model: type[BaseModel]) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role``; union member tags (``'list[int]'``) are
    dropped, and so is what follows them."""
    names = _field_names(model)
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names or not out:
            out += f".{part}" if out else str(part)
        else:
            break
    return out


def _field_names(model: type[BaseModel], seen: set | None = None) -> set[str]:
    """Field names of ``model`` and of every model nested in its fields."""
    seen = set() if seen is None else seen
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for sub in _models_in(field.annotation):
            names |= _field_names(sub, seen)
    return names


def _models_in(annotation) -> list[type[BaseModel]]:
    found, stack = [], [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        stack.extend(getattr(a, "__args__", ()) or ())
    return found
