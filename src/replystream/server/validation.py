"""Raw request input in, a validated model (``server.*_schemas``) or the API's error out.

Every route reads its input through one of these: ``read_model`` (an HTTP body),
``parse_json`` (bytes or text already in hand: a WebSocket message), ``parse_mapping`` (a
query string or headers). Whatever the input, a failure is an ``HTTPAPIError`` in the API's
shape, with ``param`` the path of the field at fault (``messages[0].content[1].type``);
nothing a client sends reaches ``json.loads``, ``int()`` or a field's consumer unchecked.

What the JSON parser (pydantic's, jiter) guarantees besides the schema: nesting deeper than
its recursion limit (about 200) is invalid JSON, not a ``RecursionError``; numbers of any
size parse (an integer too large for its range is out of range, a float too large is not
finite); invalid UTF-8 and lone surrogates are invalid JSON. This file must not know which
route uses which model.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jiter
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from replystream.server.connection import refusal
from replystream.server.errors import HTTPAPIError
from replystream.server.guard import read_body
from replystream.server.schema_fields import UNION_TAGS, Schema

M = TypeVar("M", bound=Schema)

# The codings aiohttp decodes without optional packages (``br`` and ``zstd`` need Brotli
# and backports.zstd, which replystream does not install).
DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "x-gzip"})
_SCALARS = (str, int, float, bool, type(None))

# How each pydantic error reads after the field's name.
_PHRASES = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "none_required": "must be null",
    "finite_number": "must be a finite number",
    "literal_error": "must be {expected}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "greater_than": "must be greater than {gt}",
    "less_than": "must be less than {lt}",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "string_too_short": "must have at least {min_length} character(s)",
    "string_too_long": "must have at most {max_length} character(s)",
}


async def read_model(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, or an ``HTTPAPIError`` that says what is wrong."""
    # Several Content-Encoding fields are one list (RFC 9110, 5.3): codings applied in turn,
    # which aiohttp's parser, decoding by the last field alone, would not all undo.
    encoding = ", ".join(request.headers.getall("Content-Encoding", ())).strip().lower()
    if encoding not in DECODED_ENCODINGS:
        raise HTTPAPIError(
            415,
            f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed, "
            "or as gzip or deflate",
            code="unsupported_content_encoding",
        )
    try:
        raw = await read_body(request)
    except RequestPayloadError as exc:  # aiohttp's wrapper of what broke while reading
        # The parser stops at the bad bytes and feeds the body no more. Mark it ended, or
        # aiohttp's drain of an unread body after the handler meets the same error again and
        # logs it as unhandled; and close the connection: where this request ends is unknown.
        request.content.feed_eof()
        if isinstance(exc.__cause__, ContentEncodingError):
            message = f"the body is not valid {encoding} data, as its Content-Encoding says"
            status, code = 400, "invalid_content_encoding"
        else:  # its framing broke after the head: said as the parser's refusal of a head is
            status, code, message = refusal(exc.__cause__)
        raise HTTPAPIError(status, message, code=code, close_connection=True) from None
    if encoding == "x-gzip":
        raw = gunzipped(raw, request.client_max_size)
    return parse_json(raw, model, what="body")


def gunzipped(raw: bytes, limit: int) -> bytes:
    """A body sent as ``x-gzip``, gzip's old name (RFC 9110, 8.4.1.3), decoded: aiohttp's
    parser decodes only ``gzip`` by that name and hands this one over as it came. One whole
    gzip member or more, decoding to ``limit`` bytes at most.

    Raises:
        HTTPAPIError: the ``400`` of a body that is not whole gzip data.
        web.HTTPRequestEntityTooLarge: it decodes to more than ``limit`` bytes.
    """
    parts: list[bytes] = []
    left, size = raw, 0
    try:
        while left:
            member = zlib.decompressobj(16 + zlib.MAX_WBITS)
            part = member.decompress(left, limit + 1 - size)
            size += len(part)
            if size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            if not member.eof:  # cut short (its output is bounded only once it exceeds limit)
                raise zlib.error("the gzip data ends before its member does")
            parts.append(part)
            left = member.unused_data
    except zlib.error:
        raise HTTPAPIError(
            400,
            "the body is not valid x-gzip data, as its Content-Encoding says",
            code="invalid_content_encoding",
        ) from None
    return b"".join(parts)


def parse_json(raw: bytes | str, model: type[M], *, what: str = "body", whole: bool = True) -> M:
    """``raw`` (JSON) as ``model``; ``what`` names the input in messages ("body", "message").
    ``whole``: ``model`` reads all of ``raw``, so an object naming a field twice is refused
    (False: a first look at part of it, as at a WebSocket message's envelope)."""
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        error = api_error(exc, model, what)
        if error.code == "invalid_json":
            error = half_a_character(raw, what) or error
        raise error from None
    if whole:
        refuse_repeated_fields(raw, what)
    return parsed


class _Repeated(dict[str, Any]):
    """A JSON object that names a field (``name``) more than once."""

    name = ""


def _fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    fields = dict(pairs)
    if len(fields) == len(pairs):
        return fields
    repeated, seen = _Repeated(fields), set()
    for name, _ in pairs:
        if name in seen:
            repeated.name = name
            break
        seen.add(name)
    return repeated


def _repeated_at(value: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    """Where the first object naming a field twice is, and that field; None: nowhere."""
    if isinstance(value, _Repeated):
        return (*loc, value.name)
    if isinstance(value, dict):
        items: Iterable[tuple[int | str, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _repeated_at(item, (*loc, key))
        if found is not None:
            return found
    return None


def refuse_repeated_fields(raw: bytes | str, what: str) -> None:
    """A 400 naming the field an object of ``raw`` (valid JSON) names twice. JSON leaves
    which value counts to each parser (pydantic's takes the last; others the first), so the
    request is refused rather than read one way here and another way by its sender.

    Raises:
        HTTPAPIError: a field is named twice.
    """
    try:
        jiter.from_json(raw if isinstance(raw, bytes) else raw.encode(), catch_duplicate_keys=True)
        return  # the usual case, in a pass of pydantic's own parser (a few microseconds)
    except ValueError:
        pass  # a field named twice (the JSON is valid): find which, and where
    loc = _repeated_at(json.loads(raw, object_pairs_hook=_fields), ())
    if loc is not None:
        param = field_path(loc)
        message = f"{what} names {param} more than once: give each field once"
        raise HTTPAPIError(400, message, code="invalid_value", param=param)


def parse_mapping(values: Mapping[str, str], model: type[M]) -> M:
    """Text parameters (a query string, headers) as ``model``. A parameter the model declares
    is given once: given again it is a 400 naming it, as which value was meant would be a
    guess. One the model does not declare is ignored. A list parameter (``list_params``)
    is every value given under its name or its name with ``[]``, in their order."""
    # A multidict (aiohttp's query) has one item per value given, though one key per name.
    counts = Counter(name for name, _ in values.items())
    for name in model.model_fields:
        if counts[name] > 1 and name not in model.list_params:
            raise repeated(name, counts[name])
    given: dict[str, Any] = {name: values[name] for name in values}
    for name in model.list_params:
        spellings = (name, f"{name}[]")
        listed = tuple(value for key, value in values.items() if key in spellings)
        given.pop(f"{name}[]", None)
        if listed:
            given[name] = listed
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise api_error(exc, model, "query") from None


def repeated(name: str, count: int, *, param: str | None = None) -> HTTPAPIError:
    """The error for a parameter given ``count`` times (``param``: its name in errors, when
    it is a header's)."""
    return HTTPAPIError(
        400,
        f"{name} is given {count} times; give it once",
        code="invalid_value",
        param=param or name,
    )


def half_a_character(raw: bytes | str, what: str) -> HTTPAPIError | None:
    """The ``400`` of JSON whose only fault is a string holding half a character: a UTF-16
    surrogate escape (``\\ud83d``) without its other half, as a JavaScript client writes
    text cut in the middle of an emoji. JSON's grammar takes the escape, but it is no
    character (no more than bytes that are not UTF-8, which are refused too), and the
    parser's words for it ("unexpected end of hex escape") do not say so. None for any
    other JSON fault."""
    try:
        value = json.loads(raw)  # Python's reader takes a lone surrogate
    except (ValueError, RecursionError):
        return None
    half = _first_surrogate(value)
    if half is None:
        return None
    return HTTPAPIError(
        400,
        f"{what} is not valid JSON: \\u{ord(half):04x} is half of a character (a UTF-16 "
        "surrogate escape without its other half); send whole characters",
        code="invalid_json",
    )


def _first_surrogate(value: object) -> str | None:
    """The first lone surrogate in a string (or a key) of a parsed JSON value."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            for char in item:
                if "\ud800" <= char <= "\udfff":
                    return char
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.extend((child, key))
    return None


def field_path(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "role")`` as ``messages[0].role``; None for the input as a whole. A
    field with an empty name (JSON allows ``{"": 1}``) is ``""``: else it would be no name at
    all, and the error would name the body, or the object, that holds it."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in UNION_TAGS:
            name = part or '""'
            path += f".{name}" if path else name
    return path or None


def api_error(exc: ValidationError, model: type[Schema], what: str) -> HTTPAPIError:
    """One of pydantic's errors as the API's error, naming the field: the first about a
    field's value, else the first unknown field (an ``image_url`` part is reported by its
    ``type``, not by its ``image_url`` field that text parts lack)."""
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] != "extra_forbidden"), errors[0])
    kind = error["type"]
    loc = error["loc"]
    name = None
    if "[key]" in loc:  # a mapping's key (pydantic's place: the key, then "[key]")
        loc = loc[: loc.index("[key]") - 1]
        name = f"a key of {field_path(loc)}"
    # A check across an object's fields names one of them, inside the object's own place.
    named = error.get("ctx", {}).get("param")
    param = field_path((*loc, named) if named is not None else loc)
    if kind == "json_invalid":
        detail = error["msg"].removeprefix("Invalid JSON: ")
        return HTTPAPIError(400, f"{what} is not valid JSON: {detail}", code="invalid_json")
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return HTTPAPIError(400, f"{what} must be a JSON object", code="invalid_json")
    top_field = str(error["loc"][0]) if error["loc"] else ""
    # A value of the right type that this server cannot honour (``only``) asks for a feature
    # it lacks; any other failure is a bad value.
    default = "unsupported_parameter" if kind == "not_honoured" else "invalid_value"
    # A code for the field's own place (``text.format.type``), else for its top field.
    code = model.field_codes.get(param or "", model.field_codes.get(top_field, default))
    if kind == "extra_forbidden":  # one code on every route; each dialect's own words
        if model.unknown_field == "openai":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"unknown field {param!r}"
        return HTTPAPIError(400, message, code="unknown_parameter", param=param)
    if kind == "missing":
        # OpenAI's code names a missing request parameter, not a nested object's field
        # (every route says it so: docs/api.md's one table of codes).
        if len(error["loc"]) == 1:
            code = "missing_required_parameter"
        return HTTPAPIError(400, f"{param} is required", code=code, param=param)
    return HTTPAPIError(400, _message(error, name or param), code=code, param=param)


def _message(error: ErrorDetails, param: str | None) -> str:
    if error["type"] == "invalid_field":  # already a whole sentence naming the field
        return error["msg"]
    name = param or "the input"
    if error["type"] == "unfit_value":  # what follows the field's name
        return f"{name} {error['msg']}"
    phrase = _PHRASES.get(error["type"])
    if phrase is None:
        return f"{name}: {error['msg']}"
    text = f"{name} {phrase.format(**error.get('ctx', {}))}"
    value = error.get("input")
    if isinstance(value, _SCALARS):
        text += f", got {_shown(value)}"
    return text


def _shown(value: Any) -> str:
    """A JSON value as it is shown in a message: short (a 400-digit number is cut)."""
    try:
        text = json.dumps(value)
    except ValueError:  # an integer with more digits than Python converts to text
        return "a number too large to show"
    return text if len(text) <= 40 else text[:37] + "..."
