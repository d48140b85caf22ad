"""Write events and comments as the bytes of an event stream (UTF-8).

This file decides the wire form of one event: which fields are written, in what order, and
which events cannot be written at all. It must not know about connections, flushing, clocks
or what the events mean.

Wire form, field order ``event``, ``id``, ``retry``, ``data``, then a blank line::

    event: TYPE      omitted when TYPE is "message" (the type a parser assumes)
    id: ID           omitted when ID is None; an empty ID is written "id: " (a parser strips
                     the one space and reads the empty string, which resets the last event ID)
    retry: N         omitted when N is None
    data: LINE       one line per line of data; empty data is one "data: " line

Every field is written ``name: value`` with exactly one space, which a parser removes, so a
value that starts with a space survives. The one loss is in data: CR, LF and CRLF all end a
line, so any of them in data is read back as LF (an event stream cannot carry CR in data).
"""

from __future__ import annotations

from replystream.sse.events import Event, SSEError

__all__ = ["encode", "encode_comment", "encode_data"]


def encode(event: Event) -> bytes:
    """The bytes of one event, ending with its blank line; raises `SSEError` if unwritable."""
    return _encode(event.data, event.type, event.id, event.retry)


def encode_data(data: str, *, type: str | None = None, id: str | None = None) -> bytes:
    """Like ``encode(Event(data, type, id))`` without building an Event (the hot path).

    ``type=None`` means "message".
    """
    return _encode(data, type, id, None)


def encode_comment(text: str = "") -> bytes:
    """A comment block, ``: text`` and a blank line; parsers ignore it (use it as a keep-alive)."""
    if "\r" in text or "\n" in text:
        raise SSEError(f"comment must not contain CR or LF: {text!r}")
    return _to_utf8(f": {text}\n\n")


def _encode(data: str, event_type: str | None, event_id: str | None, retry: int | None) -> bytes:
    if "\r" in data:
        data = data.replace("\r\n", "\n").replace("\r", "\n")
    out = "data: " + data.replace("\n", "\ndata: ") + "\n\n"
    if retry is not None:
        # bool is an int, but "retry: True" is not a retry field.
        if type(retry) is not int or retry < 0:
            raise SSEError(f"retry must be a non-negative int, got {retry!r}")
        out = f"retry: {retry}\n{out}"
    if event_id is not None:
        # A parser ignores an id containing NUL, and CR/LF would end the field early.
        if "\0" in event_id or "\n" in event_id or "\r" in event_id:
            raise SSEError(f"event id must not contain CR, LF or NUL: {event_id!r}")
        out = f"id: {event_id}\n{out}"
    if event_type is not None and event_type != "message":
        # An empty type would be read back as "message", so it cannot round-trip.
        if not event_type or "\0" in event_type or "\n" in event_type or "\r" in event_type:
            raise SSEError(f"event type must be non-empty, without CR, LF or NUL: {event_type!r}")
        out = f"event: {event_type}\n{out}"
    return _to_utf8(out)


def _to_utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
        raise SSEError(f"cannot encode as UTF-8: {exc}") from exc
