"""Whether a request's value is a JSON Schema: what the 2020-12 meta-schema asks of it.

This file decides what a tool's ``parameters`` (``input_schema``) and a structured output's
``schema`` must be: an object or a boolean, each keyword of draft 2020-12 (every vocabulary
of its meta-schema, and the older keywords the meta-schema still constrains: ``definitions``,
``dependencies``, ``$recursiveAnchor``, ``$recursiveRef``) of the type its meta-schema gives,
and every subschema likewise. A keyword it does not know is free, as the meta-schema leaves
it. Formats are annotations in 2020-12's meta-schema and are not asserted: a ``pattern`` is
an ECMA-262 regular expression, which Python's ``re`` would neither read as ECMA-262 does
(it refuses ``\\p{L}``) nor compile cheaply (a pattern of a megabyte: six seconds), nor
safely (groups nested a thousand deep: a ``RecursionError``).

Why not the reference implementation (``jsonschema``, which the tests compare this with):
it checked a subschema in about 200 µs, so a body of 770 KB holding 16,000 properties held
the event loop 3.4 s, and it recursed with every level, so a schema of ``allOf`` nested 95
deep (within what JSON parsing allows) ran out of stack: a 500. Here every value is visited
twice (once for its numbers, below), from a list rather than by recursion, in a few
microseconds.

A JSON Schema is a JSON value, which has no infinity and no NaN: a number too large for a
float (``1e999``) parses as infinite, and the parser also takes the ``NaN`` and ``Infinity``
that JSON leaves out. Anywhere in a schema (``maximum``, ``const``, an ``enum``'s item, a
keyword it does not know) such a number is refused: taken, it was written back as
``Infinity`` in every Responses object that echoes the tools, which no JSON parser but
Python's reads, and sent so to a relay's upstream.

It must not know about requests, pydantic or aiohttp.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

# Where a value sits, built only when it is reported: (the parent's place, the key) pairs,
# () at the top, so each value costs one pair whatever its depth.
Place = tuple[Any, ...]
Todo = list[tuple[Any, Place]]
# What a keyword's value is checked by: the phrase that follows its name when the value is
# wrong (None: right). A keyword holding subschemas adds them to the list still to check.
KeywordCheck = Callable[[Any, Place, Todo], str | None]

SIMPLE_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_SIMPLE_TYPES = frozenset(SIMPLE_TYPES)
# The meta-schema's patterns, read as ``jsonschema`` reads them (``re.search``).
_ANCHOR = re.compile(r"^[A-Za-z_][-A-Za-z0-9._]*$")
_ID = re.compile(r"^[^#]*#?$")
_MAX_PLACE_CHARS = 200  # a place named in a message is cut to this


def schema_problem(value: Any) -> tuple[str, str] | None:
    """What first makes ``value`` no JSON Schema: where (keys from the top joined by ``/``,
    "" for the top) and what is wrong there; None when it is one. A schema's own keywords
    are read before its subschemas, and those in the order they are written (a stack
    popped as filled named the last bad property of many, not the first)."""
    infinite = non_finite_place(value)
    if infinite is not None:
        return infinite, NOT_FINITE
    todo: Todo = [(value, ())]
    while todo:
        schema, place = todo.pop()
        if isinstance(schema, bool):
            continue
        if not isinstance(schema, dict):
            return _named(place), "must be a JSON Schema (an object or a boolean)"
        pushed = len(todo)
        for keyword, item in schema.items():
            check = _KEYWORDS.get(keyword)
            if check is None:
                continue
            at = (place, keyword)
            wrong = check(item, at, todo)
            if wrong is not None:
                return _named(at), wrong
        todo[pushed:] = reversed(todo[pushed:])  # its subschemas, the first on top
    return None


NOT_FINITE = "must be a finite number (JSON has no infinity or NaN)"


def non_finite_place(value: Any) -> str | None:
    """Where (keys from the top joined by ``/``, "" for the top) a number that is infinite or
    NaN first is in ``value``, a request's JSON taken as it came; None: nowhere. The JSON
    parser reads ``1e999`` as infinity, and ``NaN``, which is no JSON, as NaN: in a field
    that takes any value, they would be written on as ``Infinity`` and ``NaN``, JSON that
    strict parsers refuse."""
    place = _non_finite_at(value)
    return None if place is None else _named(place)


def _non_finite_at(value: Any) -> Place | None:
    """Where a number that is infinite or NaN first is in ``value`` (None: nowhere)."""
    todo: Todo = [(value, ())]
    while todo:
        item, place = todo.pop()
        if isinstance(item, dict):  # (reversed: the first is popped first)
            todo.extend((child, (place, key)) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            todo.extend((item[index], (place, index)) for index in reversed(range(len(item))))
        elif isinstance(item, float) and not math.isfinite(item):
            return place
    return None


def _named(place: Place) -> str:
    keys: list[str] = []
    while place:
        place, key = place
        keys.append(str(key))
    named = "/".join(reversed(keys))
    return named if len(named) <= _MAX_PLACE_CHARS else named[: _MAX_PLACE_CHARS - 3] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    """A non-negative integer, as JSON Schema counts them (``2.0`` is one)."""
    if isinstance(value, float):
        return value.is_integer() and value >= 0
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_string_set(value: Any) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(item, str) for item in value)
        and len(set(value)) == len(value)
    )


def _subschema(item: Any, at: Place, todo: Todo) -> str | None:
    todo.append((item, at))
    return None


def _schema_map(item: Any, at: Place, todo: Todo) -> str | None:
    if not isinstance(item, dict):
        return "must be an object whose values are JSON Schemas"
    todo.extend((schema, (at, name)) for name, schema in item.items())
    return None


def _schema_list(item: Any, at: Place, todo: Todo) -> str | None:
    if not isinstance(item, list) or not item:
        return "must be a non-empty list of JSON Schemas"
    todo.extend((schema, (at, index)) for index, schema in enumerate(item))
    return None


def _dependencies(item: Any, at: Place, todo: Todo) -> str | None:
    if not isinstance(item, dict):
        return "must be an object"
    for name, value in item.items():
        if isinstance(value, dict | bool):
            todo.append((value, (at, name)))
        elif not _is_string_set(value):
            return f"{name!r} must be a JSON Schema or a list of distinct strings"
    return None


def _types(item: Any, at: Place, todo: Todo) -> str | None:
    if isinstance(item, str) and item in _SIMPLE_TYPES:
        return None
    if (
        isinstance(item, list)
        and item
        and all(isinstance(name, str) and name in _SIMPLE_TYPES for name in item)
        and len(set(item)) == len(item)
    ):
        return None
    return f"must be one of {', '.join(SIMPLE_TYPES)}, or a non-empty list of distinct ones"


def _string_sets(item: Any, at: Place, todo: Todo) -> str | None:
    if not isinstance(item, dict):
        return "must be an object"
    for name, value in item.items():
        if not _is_string_set(value):
            return f"{name!r} must be a list of distinct strings"
    return None


def _vocabulary(item: Any, at: Place, todo: Todo) -> str | None:
    if not isinstance(item, dict) or not all(isinstance(v, bool) for v in item.values()):
        return "must be an object whose values are true or false"
    return None


def _matching(pattern: re.Pattern[str], phrase: str) -> KeywordCheck:
    def check(item: Any, at: Place, todo: Todo) -> str | None:
        return None if isinstance(item, str) and pattern.search(item) else phrase

    return check


def _of(test: Callable[[Any], bool], phrase: str) -> KeywordCheck:
    def check(item: Any, at: Place, todo: Todo) -> str | None:
        return None if test(item) else phrase

    return check


_string = _of(lambda v: isinstance(v, str), "must be a string")
_boolean = _of(lambda v: isinstance(v, bool), "must be true or false")
_number = _of(_is_number, "must be a number")
_count = _of(_is_count, "must be a whole number, 0 or more")
_array = _of(lambda v: isinstance(v, list), "must be a list")
_anchor = _matching(_ANCHOR, "must be a name: a letter or _, then letters, digits, -, . or _")

# Every keyword the 2020-12 meta-schema constrains, by vocabulary.
_KEYWORDS: dict[str, KeywordCheck] = {
    # core
    "$id": _matching(_ID, "must be a URI reference with no fragment but an empty one"),
    "$schema": _string,
    "$ref": _string,
    "$anchor": _anchor,
    "$dynamicRef": _string,
    "$dynamicAnchor": _anchor,
    "$vocabulary": _vocabulary,
    "$comment": _string,
    "$defs": _schema_map,
    # applicator
    "prefixItems": _schema_list,
    "items": _subschema,
    "contains": _subschema,
    "additionalProperties": _subschema,
    "properties": _schema_map,
    "patternProperties": _schema_map,
    "dependentSchemas": _schema_map,
    "propertyNames": _subschema,
    "if": _subschema,
    "then": _subschema,
    "else": _subschema,
    "allOf": _schema_list,
    "anyOf": _schema_list,
    "oneOf": _schema_list,
    "not": _subschema,
    # unevaluated
    "unevaluatedItems": _subschema,
    "unevaluatedProperties": _subschema,
    # validation
    "type": _types,
    "enum": _array,
    "multipleOf": _of(lambda v: _is_number(v) and v > 0, "must be a number above 0"),
    "maximum": _number,
    "exclusiveMaximum": _number,
    "minimum": _number,
    "exclusiveMinimum": _number,
    "maxLength": _count,
    "minLength": _count,
    "pattern": _string,
    "maxItems": _count,
    "minItems": _count,
    "uniqueItems": _boolean,
    "maxContains": _count,
    "minContains": _count,
    "maxProperties": _count,
    "minProperties": _count,
    "required": _of(_is_string_set, "must be a list of distinct strings"),
    "dependentRequired": _string_sets,
    # meta-data, format, content
    "title": _string,
    "description": _string,
    "deprecated": _boolean,
    "readOnly": _boolean,
    "writeOnly": _boolean,
    "examples": _array,
    "format": _string,
    "contentEncoding": _string,
    "contentMediaType": _string,
    "contentSchema": _subschema,
    # earlier drafts' keywords, still constrained
    "definitions": _schema_map,
    "dependencies": _dependencies,
    "$recursiveAnchor": _anchor,
    "$recursiveRef": _string,
}
