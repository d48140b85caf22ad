"""A tool's ``parameters`` and a structured output's ``schema`` are checked against the 2020-12
meta-schema: the same verdict as the reference implementation (``jsonschema``) on random
schemas, in one visit per value, over a real server: a schema nested as deep as JSON parsing
allows, or a ``pattern`` Python's ``re`` cannot compile, is never a 500, and a large schema
costs the event loop milliseconds, not seconds."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from replystream.client.transport import http_request
from replystream.server import create_app, running
from replystream.server.json_schemas import schema_problem
from tests.conftest import fast_engine
from tests.sse_client import post_events

# The reference, asserting no format (2020-12's meta-schema annotates them).
REFERENCE = Draft202012Validator(Draft202012Validator.META_SCHEMA)
TYPES = ["array", "boolean", "integer", "null", "number", "object", "string"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.sampled_from([-1.5, -0.0, 0.0, 2.0, 2.5]),
    st.sampled_from([*TYPES, "strin", "a", "_b", "1c", "#", "x#", "#y", "a\n"]),
)
names = st.lists(st.sampled_from(["a", "b", "c"]), max_size=3)


def schemas(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Objects of the meta-schema's keywords (and one it does not know), each value mostly
    of its keyword's kind, now and then of any other."""
    keys = st.sampled_from(["a", "b"])
    kinds: dict[str, st.SearchStrategy[Any]] = {
        "schema": children,
        "schemas": st.lists(children, max_size=3),
        "map": st.dictionaries(keys, children, max_size=2),
        "string": st.sampled_from(["a", "_b", "1c", "#", "x#", "#y", "a\n", ""]),
        "number": st.one_of(st.integers(-2, 3), st.sampled_from([-1.5, -0.0, 0.0, 2.0, 2.5])),
        "boolean": st.booleans(),
        "types": st.one_of(st.sampled_from([*TYPES, "strin"]), st.lists(st.sampled_from(TYPES))),
        "names": names,
        "names map": st.dictionaries(keys, names, max_size=2),
        "either map": st.dictionaries(keys, st.one_of(children, names), max_size=2),
        "booleans map": st.dictionaries(keys, st.one_of(st.booleans(), scalars), max_size=2),
        "anything": st.one_of(scalars, names),
    }
    keywords = {
        **dict.fromkeys(["$defs", "properties", "patternProperties"], "map"),
        **dict.fromkeys(["dependentSchemas", "definitions"], "map"),
        **dict.fromkeys(["prefixItems", "allOf", "anyOf", "oneOf"], "schemas"),
        **dict.fromkeys(["items", "contains", "additionalProperties", "propertyNames"], "schema"),
        **dict.fromkeys(["if", "then", "else", "not", "contentSchema"], "schema"),
        **dict.fromkeys(["unevaluatedItems", "unevaluatedProperties"], "schema"),
        **dict.fromkeys(["$id", "$schema", "$ref", "$anchor", "$dynamicRef"], "string"),
        **dict.fromkeys(["$dynamicAnchor", "$comment", "pattern", "title"], "string"),
        **dict.fromkeys(["description", "format", "contentEncoding"], "string"),
        **dict.fromkeys(["contentMediaType", "$recursiveAnchor", "$recursiveRef"], "string"),
        **dict.fromkeys(["multipleOf", "maximum", "exclusiveMaximum", "minimum"], "number"),
        **dict.fromkeys(["exclusiveMinimum", "maxLength", "minLength", "maxItems"], "number"),
        **dict.fromkeys(["minItems", "maxContains", "minContains", "maxProperties"], "number"),
        **dict.fromkeys(["minProperties"], "number"),
        **dict.fromkeys(["uniqueItems", "deprecated", "readOnly", "writeOnly"], "boolean"),
        **dict.fromkeys(["enum", "examples", "required"], "names"),
        "type": "types",
        "dependentRequired": "names map",
        "dependencies": "either map",
        "$vocabulary": "booleans map",
        **dict.fromkeys(["const", "default", "x-unknown"], "anything"),
    }

    anything = st.one_of(*kinds.values())

    @st.composite
    def entries(draw: st.DrawFn) -> dict[str, Any]:
        chosen = draw(st.lists(st.sampled_from(sorted(keywords)), max_size=4, unique=True))
        # One value in sixteen of any kind: most schemas are valid, or nearly.
        return {
            key: draw(anything if draw(st.integers(0, 15)) == 0 else kinds[keywords[key]])
            for key in chosen
        }

    return entries()


schema_values: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.booleans(), st.just({})), schemas, max_leaves=12
)


@settings(max_examples=1500, deadline=None)
@given(schema_values)
def test_the_verdict_is_the_reference_implementations(value: Any) -> None:
    assert (schema_problem(value) is None) == REFERENCE.is_valid(value), value


@pytest.mark.parametrize(
    ("schema", "where", "wrong"),
    [
        ({"type": "strin"}, "type", "must be one of array, boolean, integer"),
        ({"type": ["string", "strin"]}, "type", "must be one of array, boolean, integer"),
        ({"properties": {"a": {"type": 5}}}, "properties/a/type", "must be one of"),
        ({"allOf": []}, "allOf", "must be a non-empty list of JSON Schemas"),
        ({"items": [{}]}, "items", "must be a JSON Schema (an object or a boolean)"),
        ({"required": ["a", "a"]}, "required", "must be a list of distinct strings"),
        ({"anyOf": [{}, {"minLength": -1}]}, "anyOf/1/minLength", "must be a whole number"),
        ({"$anchor": "1a"}, "$anchor", "must be a name"),
        # Of several, the first as written (not the last, as a stack popped as filled had it).
        ({"properties": {"a": {"type": 5}, "b": {"type": 6}}}, "properties/a/type", "must"),
        ({"allOf": [{"minLength": -1}], "not": {"minLength": -2}}, "allOf/0/minLength", "must"),
        ({"enum": [float("inf"), float("nan")]}, "enum/0", "must be a finite number"),
        # An older draft's ``dependencies``: a list of names, or a subschema checked as any.
        ({"dependencies": {"a": ["b"], "c": {"type": 5}}}, "dependencies/c/type", "must be"),
        ({"dependencies": {"a": ["b", "b"]}}, "dependencies", "'a' must be a JSON Schema"),
        # A place of 200 characters is named whole; a longer one is cut to 200.
        ({"properties": {"p" * 184: {"type": 5}}}, "properties/" + "p" * 184 + "/type", "must"),
        ({"properties": {"p" * 185: {"type": 5}}}, "properties/" + "p" * 185 + "/...", "must"),
    ],
)
def test_the_first_problem_is_named_where_it_is(schema: Any, where: str, wrong: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None
    assert problem[0] == where and problem[1].startswith(wrong)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"allOf": [schema]}
    return schema


def chat(parameters: dict[str, Any]) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [tool]}


async def test_a_deep_or_unusual_schema_is_answered_never_a_500():
    # Checked by recursion, ``allOf`` nested 95 deep (190 levels of JSON: within what the
    # parser takes) ran out of stack, and a pattern with groups nested 500 deep, or a
    # repeat too large for ``re``, raised out of ``re.compile``: each a 500 and a traceback.
    # A pattern is an ECMA-262 expression, not Python's, and formats are annotations in
    # 2020-12: it is taken as a string.
    deep_groups = {"type": "object", "properties": {"x": {"pattern": "(" * 500 + ")" * 500}}}
    huge_repeat = {"type": "object", "properties": {"x": {"pattern": "a{4294967295}"}}}
    async with running(create_app(fast_engine(delay_ms=0.0, jitter_ms=0.0))) as url:
        for parameters in (nested(95), deep_groups, huge_repeat):
            got = await post_events(f"{url}/v1/chat/completions", chat(parameters))
            assert got.status == 200, got.raw
        wrong = nested(90)
        wrong["allOf"][0]["allOf"][0]["allOf"] = []
        got = await post_events(f"{url}/v1/chat/completions", chat(wrong))
    assert got.status == 400
    error = json.loads(got.raw)["error"]
    assert error["param"] == "tools[0].function.parameters"
    assert (
        "(at allOf/0/allOf/0/allOf: must be a non-empty list of JSON Schemas)" in error["message"]
    )


async def test_a_large_schema_costs_the_server_little():
    # 16,000 properties in 770 KB: about 200 µs each in the reference implementation,
    # 3.4 s of the event loop for one request; a few microseconds each here (0.1-0.2 s of
    # the process's CPU for the whole request, client included; the bound leaves room for a
    # loaded machine, and still catches the reference's cost).
    properties = {f"p{i}": {"type": "string", "pattern": "^a+$"} for i in range(16_000)}
    body = chat({"type": "object", "properties": properties})
    async with running(create_app(fast_engine(delay_ms=0.0, jitter_ms=0.0))) as url:
        await post_events(f"{url}/v1/chat/completions", chat({"type": "object"}))  # warm
        began = time.process_time()
        got = await post_events(f"{url}/v1/chat/completions", body)
        spent = time.process_time() - began
    assert got.status == 200
    assert spent < 2.0


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"maximum": float("inf")}, "maximum"),
        ({"properties": {"x": {"const": [1, float("nan")]}}}, "properties/x/const/1"),
        ({"x-unknown": {"a": -float("inf")}}, "x-unknown/a"),
    ],
)
def test_a_number_json_has_not_is_named_where_it_is(schema: Any, where: str) -> None:
    assert schema_problem(schema) == (
        where,
        "must be a finite number (JSON has no infinity or NaN)",
    )


async def test_an_infinite_number_in_a_schema_is_refused_not_echoed_as_infinity():
    # ``1e999`` is valid JSON that parses as an infinite float, and ``NaN`` a literal the
    # parser takes: taken, the Responses object echoed the tool's schema with ``Infinity``
    # in it, which JSON.parse (and every parser but Python's) refuses.
    tool = '{"type":"function","name":"f","parameters":{"type":"object","properties":'
    async with running(create_app(fast_engine(delay_ms=0.0, jitter_ms=0.0))) as url:
        for number, where in (("1e999", "x/maximum"), ("NaN", "x/enum/0")):
            keyword = "maximum" if where.endswith("maximum") else "enum"
            value = number if keyword == "maximum" else f"[{number}]"
            schema = f'{{"x":{{"type":"number","{keyword}":{value}}}}}}}'
            body = f'{{"input":"hi","max_output_tokens":2,"tools":[{tool}{schema}}}]}}'
            async with http_request(
                f"{url}/v1/responses",
                method="POST",
                body=body.encode(),
                headers={"Content-Type": "application/json"},
            ) as response:
                status, raw = response.status, b"".join([chunk.data async for chunk in response])
            assert status == 400, raw
            error = json.loads(raw)["error"]
            assert error["param"] == "tools[0].parameters"
            assert f"(at properties/{where}: must be a finite number" in error["message"]
