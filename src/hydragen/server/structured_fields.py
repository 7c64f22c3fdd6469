"""The request fields that constrain output, read into one ``StructuredOutputsParams``.

OpenAI's ``response_format`` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
``structured_outputs`` object (json / regex / choice / grammar / json_object) and vLLM's older
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``. At most one constraint per
request; anything malformed is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from hydragen.engine.sampling_params import ParamError
from hydragen.server.errors import APIError
from hydragen.structured.params import KINDS, StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _bad(field: str, message: str) -> APIError:
    return APIError(400, message, field, code="invalid_value")


def _from_response_format(rf: dict[str, Any]) -> dict | None:
    kind = rf.get("type")
    if kind == "text":
        if set(rf) != {"type"}:
            raise _bad("response_format", "response_format of type 'text' takes no other keys")
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(
                "response_format.json_schema", "response_format json_schema needs a 'json_schema' object"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise _bad(
                "response_format.json_schema.schema",
                "response_format.json_schema needs a 'schema' holding the JSON Schema object",
            )
        return {"json": schema}
    raise _bad(
        "response_format.type",
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


def structured_outputs_from(body) -> tuple[StructuredOutputsParams | None, str]:
    """(params or None, the field they came from, for error messages)."""
    found: list[tuple[str, dict]] = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs is not None:
        extra = set(body.structured_outputs) - set(KINDS)
        if extra:
            raise APIError(
                400,
                f"structured_outputs key {sorted(extra)[0]!r} is not supported "
                f"(use one of {', '.join(KINDS)})",
                "structured_outputs",
                code="unsupported_parameter",
            )
        found.append(("structured_outputs", dict(body.structured_outputs)))
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    if not found:
        return None, "structured_outputs"
    if len(found) > 1:
        names = " and ".join(f for f, _ in found)
        raise _bad(found[1][0], f"only one output constraint per request: got {names}")
    field, spec = found[0]
    try:
        return StructuredOutputsParams(**spec, literal_json_schema=body.literal_json_schema), field
    except ParamError as e:
        raise _bad(field, str(e)) from None
