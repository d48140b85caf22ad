"""A whole reply's JSON body written in slices, the event loop turning between them.

A stream's events are small; a whole reply's body need not be: 4,096 tokens with 20 log
probabilities each are about 6 MB of JSON, made from some 90,000 dicts. Made and encoded in
one go, that holds the loop for a quarter of a second, and every stream the server carries
stands still meanwhile. Such a body's large part is always a list whose items are made from
a sequence (one entry per token), so a body builder puts a ``Sliced`` there: the sequence and
how to make items of it. ``dumps_sliced`` writes the body with each ``Sliced`` made and
encoded ``SLICE`` items at a time, awaiting a turn of the loop between slices.

The bytes are ``json.dumps(body, separators=(",", ":"))``'s with every ``Sliced`` made whole
(``Sliced.whole``), the floats spelt as ``json.dumps`` spells them. A body with no ``Sliced``
is one ``json.dumps``, as before. This file must not know what the lists hold.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Items made and encoded between two turns of the loop: 16 tokens with 20 log probabilities
# each are 336 dicts, about a millisecond here.
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


async def dumps_sliced(body: Any) -> bytes:
    """``body`` as compact JSON (ASCII, as ``json.dumps`` escapes), its ``Sliced`` lists made
    and written a slice at a time, the loop turning between slices."""
    sliced: list[Sliced[Any]] = []
    # Each Sliced is written first as a string no text can hold (a tag drawn for this body
    # alone), then that string is replaced by the list: one json.dumps for the rest.
    tag = f"\x00sliced-{secrets.token_hex(16)}-"

    def stand_in(value: object) -> str:
        if not isinstance(value, Sliced):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        sliced.append(value)
        return f"{tag}{len(sliced) - 1}"

    text = json.dumps(body, separators=(",", ":"), default=stand_in)
    if not sliced:
        return text.encode()
    parts: list[str] = []
    rest = text
    for index, part in enumerate(sliced):  # in the order json.dumps met them, the text's
        before, _, rest = rest.partition(_compact(f"{tag}{index}"))
        parts.append(before)
        await _write(part, parts)
    parts.append(rest)
    return "".join(parts).encode()


async def _write(sliced: Sliced[Any], parts: list[str]) -> None:
    source, make = sliced.source, sliced.make
    parts.append("[")
    written = False
    for start in range(0, len(source), SLICE):
        if start:
            await asyncio.sleep(0)  # the other streams' turn
        items = make(source[start : start + SLICE])
        if items:
            parts.append(f"{',' if written else ''}{_compact(items)[1:-1]}")
            written = True
    parts.append("]")
