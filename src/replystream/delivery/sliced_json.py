"""The large lists of a reply's JSON: made in slices, the loop turning between, or written
as they came.

A stream's events are small; a whole reply's body need not be: 4,096 tokens with 20 log
probabilities each are about 6 MB of JSON, made from some 90,000 dicts. Made and encoded in
one go, that holds the loop, and every stream the server carries stands still meanwhile
(docs/performance.md, "A whole reply's log probabilities"). Such a body's large part is
always a list whose items are made from a sequence (one entry per token), so a body builder
puts a ``Sliced`` there: the sequence and how to make items of it. ``dumps_sliced`` writes
the body with each ``Sliced`` made and encoded ``SLICE`` items at a time, awaiting a turn of
the loop between slices. A stream's last events, written where nothing may wait, repeat what
its deltas carried: there the items are written as they come (``Written``, the JSON of each
delta's items) and only joined at the end (``dumps_written``).

The text is ``json.dumps(body, separators=(",", ":"))``'s with every ``Sliced`` made whole
(``Sliced.whole``) and every ``Written`` the list it was written from, the floats spelt as
``json.dumps`` spells them. A body with neither is one ``json.dumps``, as before. This file
must not know what the lists hold.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Items made and encoded between two turns of the loop (16 tokens with 20 log probabilities
# each: 336 dicts).
SLICE = 16

_compact = json.JSONEncoder(separators=(",", ":")).encode


class Sliced(Generic[T]):
    """A list of a body made from ``source`` a slice at a time: ``make(source[i:j])`` is the
    list's items ``i`` to ``j``, whatever slice it is given."""

    __slots__ = ("make", "source")

    def __init__(self, source: Sequence[T], make: Callable[[Sequence[T]], list[Any]]) -> None:
        self.source = source
        self.make = make

    def whole(self) -> list[Any]:
        """The list in one go (what ``dumps_sliced`` writes in slices)."""
        return self.make(self.source)


class Written:
    """A list of a body whose items are written as JSON beforehand, some at a time as they
    come (``add``), and joined when the body is written."""

    __slots__ = ("_joined", "_pieces")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._joined: str | None = "[]"

    def __bool__(self) -> bool:
        """Whether it has any item (a list with none is plainly ``[]``)."""
        return bool(self._pieces)

    def add(self, items: str) -> None:
        """Some more items: a JSON list's text (``[]`` adds none)."""
        if items != "[]":
            self._pieces.append(items[1:-1])
            self._joined = None

    def json(self) -> str:
        """The whole list's JSON (joined once, however many bodies repeat it)."""
        if self._joined is None:
            self._joined = "[" + ",".join(self._pieces) + "]"
        return self._joined


def _with_stand_ins(body: Any) -> tuple[str, list[tuple[str, Sliced[Any] | Written]]]:
    """``body``'s compact JSON with each ``Sliced`` or ``Written`` in it written as a string
    no text can hold (a tag drawn for this body alone), and those strings (as JSON) with the
    part each stands for, in the order the text has them."""
    try:
        return _compact(body), []  # most bodies (every event but a few) have no part
    except TypeError:
        pass  # a part (or what JSON cannot write: refused below, as json.dumps refuses it)
    parts: list[tuple[str, Sliced[Any] | Written]] = []
    tag = ""

    def stand_in(value: object) -> str:
        nonlocal tag
        if not isinstance(value, Sliced | Written):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        if not parts:  # drawn at the first part
            tag = f"\x00part-{secrets.token_hex(16)}-"
        name = f"{tag}{len(parts)}"
        parts.append((_compact(name), value))
        return name

    return json.dumps(body, separators=(",", ":"), default=stand_in), parts


def dumps_written(body: Any) -> str:
    """``body`` as compact JSON, each ``Written`` list in it put in as written (no
    ``Sliced``: this does not wait). ``json.dumps``'s text of the body made whole."""
    text, parts = _with_stand_ins(body)
    if not parts:
        return text
    out: list[str] = []
    for stand_in, part in parts:
        if isinstance(part, Sliced):
            raise TypeError("a Sliced list is written by dumps_sliced, which waits")
        before, _, text = text.partition(stand_in)
        out += (before, part.json())
    out.append(text)
    return "".join(out)


async def dumps_sliced(body: Any) -> bytes:
    """``body`` as compact JSON (ASCII, as ``json.dumps`` escapes), its ``Sliced`` lists made
    and written a slice at a time, the loop turning between slices (``Written`` ones put in
    as written)."""
    text, parts = _with_stand_ins(body)
    if not parts:
        return text.encode()
    out: list[str] = []
    for stand_in, part in parts:
        before, _, text = text.partition(stand_in)
        out.append(before)
        if isinstance(part, Written):
            out.append(part.json())
        else:
            await _write(part, out)
    out.append(text)
    return "".join(out).encode()


async def _write(sliced: Sliced[Any], out: list[str]) -> None:
    source, make = sliced.source, sliced.make
    out.append("[")
    written = False
    for start in range(0, len(source), SLICE):
        if start:
            await asyncio.sleep(0)  # the other streams' turn
        items = make(source[start : start + SLICE])
        if items:
            out.append(f"{',' if written else ''}{_compact(items)[1:-1]}")
            written = True
    out.append("]")
