"""What a request asks its output to match: ``StructuredOutputsParams`` (vLLM's naming), checked on
construction and turned into one grammar source the grammar engine compiles (and caches by)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hydragen.errors import ParamError
from hydragen.structured.schema_defaults import close_objects

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SOURCE_CHARS = 1_000_000  # a schema or grammar larger than this is refused before compiling
# JSON output without free whitespace between tokens: the model cannot pad forever, and forced runs
# such as `","name":"` are longer. A schema's own "x-guidance" options still override it.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSource:
    """One compilable grammar in llguidance's terms: ``kind`` is "json_schema", "regex" or "lark"."""

    kind: str
    text: str


@dataclass
class StructuredOutputsParams:
    """Constrain a completion: exactly one of ``json`` (a JSON Schema, dict or string), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF written with ``::=``) or
    ``json_object=True`` (any JSON object).

    ``literal_json_schema``: how a schema object without ``additionalProperties`` is read. False (peers'
    default, as XGrammar): it generates only the properties it names. True: JSON Schema's own semantics,
    any extra keys allowed. None: the engine's setting (``LLM(literal_json_schema=...)``, False unless
    changed)."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    literal_json_schema: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ParamError(
                "structured_outputs",
                f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got {named}",
            )
        if self.literal_json_schema not in (None, True, False):
            raise ParamError("structured_outputs", "literal_json_schema must be True, False or None")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ParamError("structured_outputs", f"json schema is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ParamError(
                    "structured_outputs",
                    f"json schema must be a JSON object (or true/false), got {type(value).__name__}",
                )
            self.json = value
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ParamError("structured_outputs", "choice must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            if value is not True:
                raise ParamError("structured_outputs", "json_object must be True")
        elif not isinstance(value, str) or not value:
            raise ParamError("structured_outputs", f"{kind} must be a non-empty string")
        size = len(self.source(literal_json_schema=True).text)
        if size > MAX_SOURCE_CHARS:
            raise ParamError(
                "structured_outputs", f"{kind} is {size} characters long; the limit is {MAX_SOURCE_CHARS}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def source(self, literal_json_schema: bool = False) -> GrammarSource:
        """The grammar to compile; equal sources share one compiled grammar. ``literal_json_schema`` is the
        engine's setting, used when the params leave it None."""
        kind = self.kind
        if kind == "json":
            literal = literal_json_schema if self.literal_json_schema is None else self.literal_json_schema
            schema = self.json if literal else close_objects(self.json)
            return GrammarSource("json_schema", json.dumps(schema))
        if kind == "json_object":
            return GrammarSource("json_schema", json.dumps({"type": "object"}))
        if kind == "regex":
            return GrammarSource("regex", self.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
            return GrammarSource("lark", "start: " + " | ".join(json.dumps(c) for c in self.choice))
        return GrammarSource("lark", self.grammar)
