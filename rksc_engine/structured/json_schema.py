"""Which JSON schemas the constrained decoder can guarantee, checked before decoding.

``ConstrainedDecoder`` (``rksc_engine.structured.constrained``) honours only part of JSON schema;
output decoded under a schema that asks for more may not validate. A caller that promises valid output (the HTTP
server, for tool parameters and ``response_format``) calls ``check_schema`` up front and refuses the
request with the location of the first unsupported use, rather than answer with JSON its schema
rejects. The check lives apart from the decoder because it is a promise about the decoder's output,
made before any decoding runs, and apart from the tool protocol because JSON answers need it without
tools. The decoder's item limit (``MAX_ITEMS``) is defined here, since the check promises it and the
decoder, which imports this module, enforces it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSON_TYPES", "MAX_ITEMS", "UNSUPPORTED_KEYWORDS", "SchemaNotSupported", "check_schema"]

MAX_ITEMS = 8  # array items / free object keys the model may produce, so a loop cannot run away

JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Assertions the decoder does not enforce: output decoded under a schema that uses them may not
# validate, so a caller that promises validity refuses such a schema up front (``check_schema``).
UNSUPPORTED_KEYWORDS = (
    "pattern", "minLength", "maxLength", "format", "contentEncoding", "contentMediaType", "multipleOf",
    "prefixItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "not",
    "if", "then", "else", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
)
_COMBINERS = ("anyOf", "oneOf", "allOf")


class SchemaNotSupported(ValueError):
    """A JSON schema asks for something ``ConstrainedDecoder`` cannot guarantee.

    Attributes:
        loc: Where, as keys and list indices from the schema's root (``("properties", "x", "pattern")``).
    """

    def __init__(self, message: str, loc: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.loc = loc


def check_schema(schema: Any) -> None:
    """Raise ``SchemaNotSupported`` unless every value decoded under ``schema`` validates against it.

    The decoder honours ``type`` (one, or one plus ``"null"``), ``properties``/``required``,
    ``additionalProperties`` beside properties, ``items``, ``enum``, ``const``, numeric bounds, local
    ``$ref``s (not recursive ones), Optional-style ``anyOf``/``oneOf`` (one non-null option) and a
    one-schema ``allOf``. It writes only required keys, 1 to ``MAX_ITEMS`` array items, and coerces
    each value to its type; anything that constrains more than that (``UNSUPPORTED_KEYWORDS``, tighter
    array bounds, unions of several types) is refused rather than answered with invalid JSON.
    Keywords it does not know are annotations (``title``, ``description``, vendor keys) and pass.

    Raises:
        SchemaNotSupported: The first unsupported use, with its location.
    """
    defs = {}
    if isinstance(schema, dict):
        defs = {**{k: ("definitions", k) for k in schema.get("definitions") or {}},
                **{k: ("$defs", k) for k in schema.get("$defs") or {}}}
    _check_node(schema, schema, (), defs, ())


def _check_node(root: Any, node: Any, loc: tuple[str | int, ...], defs: dict[str, tuple[str, str]],
                refs: tuple[str, ...]) -> None:
    if not isinstance(node, dict):
        raise SchemaNotSupported(f"must be a JSON-schema object, got {json.dumps(node)[:40]}", loc)
    ref = node.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
        if not isinstance(ref, str) or not ref.startswith("#/") or name not in defs:
            raise SchemaNotSupported(f"$ref {ref!r} is not a local reference to $defs or definitions", (*loc, "$ref"))
        if name in refs:
            raise SchemaNotSupported(f"$ref {ref!r} is recursive; the decoder needs a finite schema", (*loc, "$ref"))
        target_loc = defs[name]
        _check_node(root, root[target_loc[0]][target_loc[1]], target_loc, defs, (*refs, name))
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            raise SchemaNotSupported(f"{keyword} is not supported: constrained decoding cannot enforce it",
                                     (*loc, keyword))
    if node.get("uniqueItems"):
        raise SchemaNotSupported("uniqueItems is not supported: constrained decoding cannot enforce it",
                                 (*loc, "uniqueItems"))
    _check_type(node, loc)
    _check_combiners(root, node, loc, defs, refs)
    _check_object(root, node, loc, defs, refs)
    _check_array(root, node, loc, defs, refs)
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise SchemaNotSupported("enum must be a non-empty list", (*loc, "enum"))


def _check_type(node: dict[str, Any], loc: tuple[str | int, ...]) -> None:
    kind = node.get("type")
    if kind is None:
        return
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        raise SchemaNotSupported(f"type must be one of {sorted(JSON_TYPES)} or a list of them, got {kind!r}",
                                 (*loc, "type"))
    if len([k for k in kinds if k != "null"]) > 1:
        raise SchemaNotSupported(f"type {kind!r} is a union of several types; the decoder writes one (and null)",
                                 (*loc, "type"))


def _check_combiners(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                     defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    for combiner in _COMBINERS:
        if combiner not in node:
            continue
        options = node[combiner]
        if not isinstance(options, list) or not options:
            raise SchemaNotSupported(f"{combiner} must be a non-empty list of schemas", (*loc, combiner))
        non_null = [i for i, o in enumerate(options) if not (isinstance(o, dict) and o.get("type") == "null")]
        if len(non_null) != 1:
            raise SchemaNotSupported(f"{combiner} with {len(non_null)} non-null options is not supported: the "
                                     f"decoder takes exactly one (Optional[X])", (*loc, combiner))
        _check_node(root, options[non_null[0]], (*loc, combiner, non_null[0]), defs, refs)


def _check_object(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                  defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    properties = node.get("properties")
    if properties is not None and not isinstance(properties, dict):
        raise SchemaNotSupported("properties must be an object of schemas", (*loc, "properties"))
    for key, value in (properties or {}).items():
        _check_node(root, value, (*loc, "properties", key), defs, refs)
    required = node.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaNotSupported("required must be a list of property names", (*loc, "required"))
        missing = [k for k in required if k not in (properties or {})]
        if missing:
            raise SchemaNotSupported(f"required names {missing}, which are not in properties; the decoder "
                                     f"writes only declared properties", (*loc, "required"))
    extra = node.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool) and not properties:
        raise SchemaNotSupported("additionalProperties as a schema (a map of typed values) is not supported",
                                 (*loc, "additionalProperties"))


def _check_array(root: Any, node: dict[str, Any], loc: tuple[str | int, ...],
                 defs: dict[str, tuple[str, str]], refs: tuple[str, ...]) -> None:
    if "items" in node:
        _check_node(root, node["items"], (*loc, "items"), defs, refs)
    low, high = node.get("minItems"), node.get("maxItems")
    if low is not None and (not isinstance(low, int) or low > 1):
        raise SchemaNotSupported(f"minItems {low} is not supported: the decoder may write a single item",
                                 (*loc, "minItems"))
    if high is not None and (not isinstance(high, int) or high < MAX_ITEMS):
        raise SchemaNotSupported(f"maxItems {high} is not supported: the decoder may write up to {MAX_ITEMS} items",
                                 (*loc, "maxItems"))
