"""An upstream's embeddings answer, checked and named as the client asked, without holding
the event loop.

An answer to 2,048 inputs of 1,536 numbers is 66 MB of JSON. Parsed whole (three million
floats made Python objects) and written again, it held the relay's loop for half a second,
and every stream it carried with it. This file decides how an answer is read instead: in
slices of about ``SLICE_BYTES``, the loop turning between them. Its structure comes from the
bytes that make it (quotes and brackets, each kind found by a ``bytes.find``, strings skipped
whole); each item of its ``data`` is parsed on its own (its embedding checked to be finite
numbers, or base64 of float32s, then dropped), the rest of it parsed with ``data`` emptied,
and what lies between the items checked to be commas and blanks: the whole text is checked
as JSON, as a full parse would check it. The
answer goes on as the upstream wrote it, ``data`` byte for byte, its other fields written
again with ``model`` the name asked for.
"""

from __future__ import annotations

import asyncio
import binascii
import math
import re
from typing import Any

from pydantic_core import from_json, to_json

from replystream.engine.base import Embeddings

SLICE_BYTES = 1 << 20  # read between two turns of the loop (1-5 ms of work here)

_QUOTE, _OPEN_LIST, _CLOSE_LIST, _OPEN, _CLOSE = b'"[]{}'
_MARKS = (_QUOTE, _OPEN_LIST, _CLOSE_LIST, _OPEN, _CLOSE)
_BACKSLASH = ord("\\")
_BLANK = re.compile(rb"[ \t\r\n]*")  # JSON's whitespace, and only it
_COMMA = re.compile(rb"[ \t\r\n]*,[ \t\r\n]*")


def _past_blanks(raw: bytes, at: int) -> int:
    blanks = _BLANK.match(raw, at)
    assert blanks is not None  # (it matches nothing as well)
    return blanks.end()


_NUMBERS = frozenset({int, float})


def sound_embedding(embedding: object) -> bool:
    """An embedding as OpenAI's API writes one: a list of finite numbers (``float``), or
    (``base64``) the base64 of little-endian float32s, which a client decodes with NumPy."""
    if type(embedding) is list:
        if not set(map(type, embedding)) <= _NUMBERS:  # in C: a few ns a number
            return False
        try:
            return math.isfinite(sum(embedding))  # any NaN or infinity makes the sum one
        except OverflowError:  # an integer past any float
            return False
    if type(embedding) is str:
        try:
            return len(binascii.a2b_base64(embedding, strict_mode=True)) % 4 == 0
        except ValueError:  # binascii.Error, or a character past ASCII
            return False
    return False


class _Malformed(Exception):
    """The answer is not JSON, or not an object with a list of embeddings in ``data``."""


class _Marks:
    """The bytes that give a JSON text its structure, in order, each string whole: one
    ``bytes.find`` per kind of mark, each kind's next place kept until passed."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.end = len(raw)
        self.next = {mark: self._find(mark, 0) for mark in _MARKS}

    def _find(self, mark: int, at: int) -> int:
        found = self.raw.find(mark, at)
        return self.end if found < 0 else found

    def take(self, at: int) -> tuple[int, int, int]:
        """The first mark at ``at`` or after: (its byte, where it is, where what follows
        it begins; for a string's quote, past its closing quote). Raises ``_Malformed``
        at the text's end, or in a string that does not end."""
        places = self.next
        for mark, place in places.items():
            if place < at:
                places[mark] = self._find(mark, at)
        mark = min(places, key=places.__getitem__)
        place = places[mark]
        if place == self.end:
            raise _Malformed
        if mark != _QUOTE:
            return mark, place, place + 1
        return mark, place, self._closing_quote(place + 1) + 1

    def _closing_quote(self, at: int) -> int:
        raw = self.raw
        while True:
            quote = raw.find(b'"', at)
            if quote < 0:
                raise _Malformed
            escapes = quote
            while raw[escapes - 1] == _BACKSLASH:
                escapes -= 1
            if (quote - escapes) % 2 == 0:  # not itself escaped
                return quote
            at = quote + 1


async def checked_answer(raw: bytes, answer_as: str) -> Embeddings | None:
    """``raw`` named ``answer_as``, with the prompt tokens its usage reports, if it is what an
    OpenAI client reads as embeddings (an object whose ``data`` is a list of objects, each
    with an ``embedding`` that is a list or a base64 string); else None."""
    try:
        data, items = await _layout(raw)
        top = from_json(raw[: data[0]] + b"[]" + raw[data[1] :])
        if not isinstance(top, dict) or top.get("data") != []:
            return None
        await _check_items(raw, data, items)
    except (_Malformed, ValueError):  # (pydantic_core's parse errors are ValueErrors)
        return None
    top["model"] = answer_as
    usage = top.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    counted = tokens if type(tokens) is int and tokens >= 0 else None
    large = len(raw) >= SLICE_BYTES
    if large:  # the copy below in a turn of its own, not after the last slice's work
        await asyncio.sleep(0)
    body = _written(raw, data, top)
    if large:  # nor before the write of it to the client
        await asyncio.sleep(0)
    return Embeddings(body, counted)


def _written(raw: bytes, data: tuple[int, int], top: dict[str, Any]) -> bytes:
    """``top`` as JSON, its ``data`` the list as ``raw`` has it: one copy of it (a step that
    holds the loop for the answer's size, about 0.5 ms a megabyte here)."""
    parts: list[bytes | memoryview] = []
    for name, value in top.items():
        parts += (b",", to_json(name), b":")
        parts.append(memoryview(raw)[data[0] : data[1]] if name == "data" else to_json(value))
    parts[0] = b"{"
    parts.append(b"}")
    return b"".join(parts)


async def _layout(raw: bytes) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """Where the top object's ``data`` list is (its brackets included), and each of its
    items; the loop turns every ``SLICE_BYTES`` read."""
    start = _past_blanks(raw, 0)
    if raw[start : start + 1] != b"{":
        raise _Malformed
    marks = _Marks(raw)
    depth, at, turned = 1, start + 1, start
    data_at = -1  # where the list of ``data`` opens, once its key is read
    data: tuple[int, int] | None = None
    items: list[tuple[int, int]] = []
    item_at = -1
    while depth:
        mark, place, at = marks.take(at)
        if at - turned >= SLICE_BYTES:
            await asyncio.sleep(0)
            turned = at
        in_data = data_at >= 0 and data is None
        if mark == _QUOTE:
            if in_data and depth == 2:
                raise _Malformed  # an item that is a string
            if depth == 1 and data_at < 0 and raw[place:at] == b'"data"':
                colon = _past_blanks(raw, at)
                if raw[colon : colon + 1] == b":":  # the key, not a value
                    data_at = _past_blanks(raw, colon + 1)
                    if raw[data_at : data_at + 1] != b"[":
                        raise _Malformed
        elif mark in (_OPEN, _OPEN_LIST):
            if in_data and depth == 2:
                if mark != _OPEN:
                    raise _Malformed  # an item that is a list
                item_at = place
            depth += 1
        else:
            depth -= 1
            if in_data and depth == 2:
                items.append((item_at, at))
            elif in_data and depth == 1:
                if mark != _CLOSE_LIST:
                    raise _Malformed
                data = (data_at, at)
    if data is None or raw[_past_blanks(raw, at) :]:
        raise _Malformed  # no list of data, or more after the object
    return data, items


async def _check_items(raw: bytes, data: tuple[int, int], items: list[tuple[int, int]]) -> None:
    """Each item parsed alone (its numbers checked, then dropped), and only a comma and
    blanks between two items (nothing else can hide there: no mark was found in it)."""
    inside = (data[0] + 1, data[1] - 1)
    if not items:
        if _BLANK.fullmatch(raw, *inside) is None:
            raise _Malformed  # numbers or literals in the list
        return
    if _BLANK.fullmatch(raw, inside[0], items[0][0]) is None:
        raise _Malformed
    if _BLANK.fullmatch(raw, items[-1][1], inside[1]) is None:
        raise _Malformed
    read = 0
    for index, (start, end) in enumerate(items):
        if index and _COMMA.fullmatch(raw, items[index - 1][1], start) is None:
            raise _Malformed
        item = from_json(raw[start:end])
        if not isinstance(item, dict) or not sound_embedding(item.get("embedding")):
            raise _Malformed
        read += end - start
        if read >= SLICE_BYTES:
            await asyncio.sleep(0)
            read = 0
