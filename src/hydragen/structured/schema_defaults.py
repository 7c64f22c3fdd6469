"""How a JSON Schema is read: peers' default (objects generate only the properties they name) or JSON
Schema's literal semantics, and errors that name the keyword the grammar engine does not support.

JSON Schema says an object without ``additionalProperties`` may carry any extra keys, and llguidance
follows that literally: a model is free to invent keys, and a weak one often does until ``max_tokens``
(``"avatar_image_large_large": ...``). vLLM and SGLang default to XGrammar, which generates only the
named properties unless the schema allows more. ``close_objects`` gives the same default by writing
``additionalProperties: false`` into every object schema that names ``properties`` and says nothing
about extra keys. Left alone, because closing them would change what they mean:

- an object without ``properties`` (``{"type": "object"}`` means "any object");
- a schema combined with others through ``allOf`` (its own members, and the schema holding the
  ``allOf``): closing each part would forbid the keys the other parts add;
- a ``$ref`` with sibling ``properties``, and the ``$defs``/``definitions`` entry it extends, for the
  same reason.
"""

from __future__ import annotations

import copy
import re

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema):
    """A copy of ``schema`` in which every object naming ``properties`` without saying whether other keys
    are allowed allows none (see the module docstring for what is left alone)."""
    out = copy.deepcopy(schema)
    extended = _extended_definitions(out)
    _close(out, extended, in_all_of=False, path="#")
    return out


def _close(node, extended: set[str], in_all_of: bool, path: str) -> None:
    if not isinstance(node, dict):
        return
    closable = (
        isinstance(node.get("properties"), dict)
        and "additionalProperties" not in node
        and "unevaluatedProperties" not in node
        and "allOf" not in node
        and "$ref" not in node
        and not in_all_of
        and path not in extended
        and _may_be_object(node.get("type"))
    )
    if closable:
        node["additionalProperties"] = False
    for key in _ONE:
        _close(node.get(key), extended, False, f"{path}/{key}")
        if isinstance(node.get(key), list):  # draft-7 tuple `items`
            for i, sub in enumerate(node[key]):
                _close(sub, extended, False, f"{path}/{key}/{i}")
    for key in (*_MANY, "allOf"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _close(sub, extended, key == "allOf", f"{path}/{key}/{i}")
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _close(sub, extended, False, f"{path}/{key}/{name}")


def _may_be_object(types) -> bool:
    if types is None:
        return True
    return types == "object" or (isinstance(types, list) and "object" in types)


def _extended_definitions(schema) -> set[str]:
    """Local ``$ref`` targets used with sibling ``properties`` somewhere in ``schema``."""
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and "properties" in node:
                found.add(ref)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return found


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def explain(message: str, schema=None) -> str:
    """The grammar engine's compile error, rewritten to name an unsupported keyword and where it is."""
    found = _UNIMPLEMENTED.search(message)
    if not found:
        return message
    names = [n.strip().strip('"') for n in found.group(1).split(",") if n.strip()]
    where = find_keyword(schema, names[0]) if schema is not None else None
    at = f" (at {where})" if where else ""
    listed = ", ".join(f'"{n}"' for n in names)
    noun = "keyword" if len(names) == 1 else "keywords"
    return f"unsupported JSON Schema {noun} {listed}{at}: it cannot be enforced, so the schema is refused"


def find_keyword(node, key: str, path: str = "#", names: bool = False) -> str | None:
    """JSON-pointer-like path of the first schema object holding keyword ``key`` (``names``: ``node`` maps
    property or definition names to schemas, so its own keys are names, not keywords)."""
    if isinstance(node, dict):
        if key in node and not names:
            return path
        for k, v in node.items():
            hit = find_keyword(v, key, f"{path}/{k}", names=not names and k in _MAP)
            if hit:
                return hit
    elif isinstance(node, list):
        for i, v in enumerate(node):
            hit = find_keyword(v, key, f"{path}/{i}")
            if hit:
                return hit
    return None
