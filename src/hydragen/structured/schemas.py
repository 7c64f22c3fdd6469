"""A fixed set of JSON Schemas covering what users send (nested objects, bounded arrays, enums, patterns,
optional fields, anyOf, numbers with ranges): the grammar-backend measurement, the structured-output
benchmark and the tests all run on it.

Every string has a ``maxLength`` and every array a ``maxItems``, and objects forbid extra keys, so a
constrained generation always ends within a bounded number of tokens, even from a random model.
"""

from __future__ import annotations

_S = {"type": "string", "maxLength": 12}
_INT = {"type": "integer", "minimum": 0, "maximum": 999}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict] = {
    "flat_person": _obj({"name": _S, "age": _INT}),
    "bool_flag": _obj({"ok": {"type": "boolean"}}),
    "enum_color": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const_version": _obj({"version": {"const": 2}, "tag": _S}),
    "pattern_zip": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "pattern_code": _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "date_pattern": _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "optional_fields": _obj({"id": _INT, "nickname": _S, "email": _S}, required=["id"]),
    "all_optional": _obj({"a": _INT, "b": {"type": "boolean"}}, required=[]),
    "nested_address": _obj({"name": _S, "address": _obj({"street": _S, "city": _S, "zip": _INT})}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _INT})})})}),
    "array_min_max": _obj({"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}}),
    "array_exact": _obj({"rgb": {"type": "array", "items": _INT, "minItems": 3, "maxItems": 3}}),
    "array_of_objects": _obj(
        {"people": {"type": "array", "items": _obj({"name": _S, "age": _INT}), "minItems": 1, "maxItems": 2}}
    ),
    "array_empty_ok": _obj({"items": {"type": "array", "items": _INT, "maxItems": 2}}),
    "enum_array": _obj(
        {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3}}
    ),
    "anyof_scalar": _obj({"value": {"anyOf": [_INT, {"type": "boolean"}]}}),
    "anyof_objects": _obj(
        {"shape": {"anyOf": [_obj({"radius": _INT}), _obj({"width": _INT, "height": _INT})]}}
    ),
    "nullable": _obj({"note": {"anyOf": [_S, {"type": "null"}]}}),
    "type_list": _obj({"x": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}}),
    # A number needs multipleOf to bound its digits: a bare "number" lets a model write decimals forever.
    "number_range": _obj({"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25}}),
    "negative_int": _obj({"delta": {"type": "integer", "minimum": -50, "maximum": 50}}),
    "enum_mixed": _obj({"level": {"enum": ["low", 1, None, True]}}),
    "string_min_len": _obj({"word": {"type": "string", "minLength": 2, "maxLength": 6}}),
    "entity_movie": _obj(
        {
            "title": _S,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "action", "documentary"]},
            "director": _obj({"first_name": _S, "last_name": _S}),
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
    "entity_company": _obj(
        {
            "company_name": _S,
            "founded_year": {"type": "integer", "minimum": 1800, "maximum": 2030},
            "headquarters": _obj({"city": _S, "country": _S}),
            "is_public": {"type": "boolean"},
            "industries": {"type": "array", "items": _S, "minItems": 1, "maxItems": 2},
        }
    ),
    "entity_product": _obj(
        {
            "product_id": {"type": "string", "pattern": "^P[0-9]{4}$"},
            "in_stock": {"type": "boolean"},
            "price_cents": _INT,
            "category": {"enum": ["books", "toys", "tools"]},
        },
        required=["product_id", "in_stock"],
    ),
    "defs_ref": {
        "type": "object",
        "$defs": {"point": _obj({"x": _INT, "y": _INT})},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "allof_merge": {
        "allOf": [_obj({"a": _INT}), {"type": "object", "properties": {"a": {"maximum": 9}}}],
    },
    "top_level_array": {"type": "array", "items": _obj({"k": _S}), "minItems": 1, "maxItems": 2},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "unicode_keys": _obj({"prénom": _S, "städte": {"type": "array", "items": _S, "maxItems": 2}}),
    "long_keys": _obj(
        {
            "customer_account_identifier": _INT,
            "preferred_communication_channel": {"enum": ["email", "telephone", "postal_mail"]},
            "marketing_consent_given": {"type": "boolean"},
        }
    ),
}
