"""The value every part of replystream uses for one server-sent event."""

from __future__ import annotations

from typing import NamedTuple


class Event(NamedTuple):
    """One server-sent event.

    Immutable, and a NamedTuple rather than a frozen dataclass, as ``Delta`` is: a parser
    makes one per event it reads (a relay, one per relayed chunk), and a frozen dataclass's
    ``__init__`` costs twice as much.

    When encoding, ``id=None`` writes no ``id:`` line and ``retry=None`` no ``retry:`` line.
    A parsed event's ``id`` is the last event ID in force when it was dispatched (``""`` if
    none).
    """

    data: str
    type: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEError(ValueError):
    """An event cannot be encoded, or a stream cannot be parsed within its limits."""


class EventTooLarge(SSEError):
    """A stream exceeded the parser's maximum event size (a hostile or broken stream)."""
