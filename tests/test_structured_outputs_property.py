"""Whatever JSON an upstream holds its text to, the relay's client gets that JSON, byte for
byte, in every dialect, streamed and whole, batched and held back; and a reply its upstream
cut at the token limit says so, never ``stop``.

Hypothesis draws a schema of OpenAI's strict subset (objects whose properties are all
required and that allow no others, arrays, ``anyOf``, ``enum``, ``const``, ``$defs`` and
``$ref``, strings, numbers, integers, booleans, null), a document that schema accepts (the
text a grammar holding an upstream to the schema would write: ``json.dumps`` of it, ASCII or
not, compact or not), and how the upstream cuts that text into chunks. The upstream is a small
aiohttp app on a loopback port streaming those chunks, the relay a replystream app serving an
``UpstreamEngine``; the client a plain HTTP client. Every reply the relay reports finished
(``stop``, ``completed``, ``end_turn``) must be that document, which the schema accepts
(``jsonschema``); a reply cut short must report the token limit.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sse_client import Received, post_events
from tests.test_upstream_routing import Upstream, relay

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ASK = [{"role": "user", "content": "Answer in JSON."}]
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
# Text as a model writes it, quotes, backslashes, control characters and astral-plane
# characters (a surrogate pair in ASCII JSON, which an upstream may cut in two) included.
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), TEXT)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.integers(-1000, 1000).map(lambda low: {"type": "integer", "minimum": low}),
        st.lists(TEXT, min_size=1, max_size=4, unique=True).map(
            lambda values: {"type": "string", "enum": values}
        ),
        SCALARS.map(lambda value: {"const": value}),
    )


def _strict_object(properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _nested(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.dictionaries(NAMES, children, max_size=4).map(_strict_object),
        children.map(lambda item: {"type": "array", "items": item}),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    )


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    """A strict schema: an object at the top, as OpenAI's structured outputs require, one of
    whose properties may be a ``$ref`` to a definition."""
    inner = st.recursive(_leaf(), _nested, max_leaves=8)
    plain = st.dictionaries(NAMES, inner, min_size=1, max_size=4).map(_strict_object)

    def with_definition(pair: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
        top, defined = pair
        top = dict(top)
        top["properties"] = {**top["properties"], "ref": {"$ref": "#/$defs/part"}}
        top["required"] = list(top["properties"])
        return {**top, "$defs": {"part": defined}}

    return st.one_of(plain, st.tuples(plain, inner).map(with_definition))


def documents(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Documents ``schema`` (a part of ``root``, whose ``$defs`` a ``$ref`` names) accepts."""
    if "$ref" in schema:
        return documents(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([documents(option, root) for option in schema["anyOf"]])
    kind = schema["type"]
    if kind == "object":
        fields = {name: documents(part, root) for name, part in schema["properties"].items()}
        return st.fixed_dictionaries(fields)
    if kind == "array":
        return st.lists(documents(schema["items"], root), max_size=3)
    if kind == "integer":
        return st.integers(min_value=schema["minimum"], max_value=schema["minimum"] + 10**6)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    leaves = {"string": TEXT, "boolean": st.booleans(), "null": st.none()}
    return leaves[kind]


@st.composite
def replies(draw: st.DrawFn) -> tuple[dict[str, Any], str, list[str]]:
    """A schema, the text of a document it accepts, and that text cut into chunks."""
    schema = draw(schemas())
    document = draw(documents(schema, schema))
    compact = draw(st.booleans())
    text = json.dumps(
        document,
        ensure_ascii=draw(st.booleans()),
        separators=(",", ":") if compact else None,
    )
    # Cut as UTF-16 code units, as a Node.js server's chunks may be: a character past the
    # BMP may be cut between its surrogates, each chunk then holding a lone one.
    units = text.encode("utf-16-le", "surrogatepass")
    size = len(units) // 2
    cuts = sorted(draw(st.sets(st.integers(1, max(1, size - 1)), max_size=12)))
    pieces = [
        units[2 * a : 2 * b].decode("utf-16-le", "surrogatepass")
        for a, b in zip([0, *cuts], [*cuts, size], strict=True)
    ]
    return schema, text, [piece for piece in pieces if piece]


def _chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + json.dumps({**body, "choices": [choice]}).encode() + b"\n\n"


class GrammarUpstream(Upstream):
    """Streams ``pieces`` (then finishes with ``finish``), as a server whose grammar held its
    text to the schema it was sent would; it writes each chunk as ``json.dumps`` does, ASCII:
    a character past the BMP cut between chunks is a lone surrogate escape in each."""

    def __init__(self, pieces: list[str], finish: str) -> None:
        super().__init__(["m"])
        self.pieces, self.finish = pieces, finish

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_chunk("", None))
        for piece in self.pieces:
            await response.write(_chunk(piece))
        await response.write(_chunk(None, self.finish))
        await response.write(b"data: [DONE]\n\n")
        return response


def _chat_stream(got: Received) -> dict[int, tuple[str, str | None]]:
    """Each streamed choice's text and finish reason, by index."""
    said: dict[int, tuple[str, str | None]] = {}
    for event in got.events:
        if event.type != "message" or event.data == "[DONE]":
            continue
        for choice in json.loads(event.data)["choices"]:
            text, finish = said.get(choice["index"], ("", None))
            said[choice["index"]] = (
                text + (choice["delta"].get("content") or ""),
                choice["finish_reason"] or finish,
            )
    return said


async def _asked(schema: dict[str, Any], pieces: list[str], finish: str) -> dict[str, Any]:
    """What each dialect's client was told of the reply ``pieces`` make, the upstream ending
    it with ``finish``: (text, how it ended) per way of asking."""
    fields = {"name": "doc", "schema": schema, "strict": True}
    fmt = {"type": "json_schema", "json_schema": fields}
    chat = {"messages": ASK, "response_format": fmt, "max_tokens": 4096}
    told: dict[str, Any] = {}
    async with relay([GrammarUpstream(pieces, finish)]) as url:
        whole = json.loads((await post_events(f"{url}/v1/chat/completions", chat)).raw)
        choice = whole["choices"][0]
        told["chat"] = (choice["message"]["content"], choice["finish_reason"])
        streamed = {**chat, "stream": True, "n": 2, "batch_tokens": 3, "holdback_tokens": 2}
        for index, said in _chat_stream(
            await post_events(f"{url}/v1/chat/completions", streamed)
        ).items():
            told[f"chat stream {index}"] = said
        text_format = {"type": "json_schema", **fields}
        responses = {"input": "Answer in JSON.", "text": {"format": text_format}}
        response = json.loads((await post_events(f"{url}/v1/responses", responses)).raw)
        parts = [p for item in response["output"] for p in item["content"]]
        told["responses"] = ("".join(p["text"] for p in parts), response["status"])
        messages = {
            "model": "m",
            "max_tokens": 4096,
            "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        }
        message = json.loads((await post_events(f"{url}/v1/messages", messages)).raw)
        text = "".join(block["text"] for block in message["content"])
        told["anthropic"] = (text, message["stop_reason"])
    return told


FINISHED = {"stop", "completed", "end_turn"}
CUT = {"length", "incomplete", "max_tokens"}


@SETTINGS
@given(reply=replies())
def test_every_reply_reported_finished_is_the_document_its_schema_accepts(
    reply: tuple[dict[str, Any], str, list[str]],
) -> None:
    schema, text, pieces = reply
    jsonschema.Draft202012Validator.check_schema(schema)
    told = asyncio.run(_asked(schema, pieces, "stop"))
    assert set(told) == {"chat", "chat stream 0", "chat stream 1", "responses", "anthropic"}
    for way, (said, ended) in told.items():
        assert ended in FINISHED, (way, ended)
        assert said == text, way
        jsonschema.validate(json.loads(said), schema)


@SETTINGS
@given(reply=replies(), kept=st.integers(0, 11))
def test_a_reply_its_upstream_cut_at_the_token_limit_is_never_reported_finished(
    reply: tuple[dict[str, Any], str, list[str]], kept: int
) -> None:
    schema, _, pieces = reply
    shown = pieces[: min(kept, len(pieces) - 1)]  # at least the last piece is cut off
    told = asyncio.run(_asked(schema, shown, "length"))
    for way, (said, ended) in told.items():
        assert ended in CUT, (way, ended)
        # (A character cut between its surrogates at the end is U+FFFD, as a decoder's bad
        # bytes are.)
        assert said == "".join(shown).encode("utf-16-le", "surrogatepass").decode(
            "utf-16-le", "replace"
        ), way
