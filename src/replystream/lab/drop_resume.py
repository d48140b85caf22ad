"""The drop-and-resume scenario: a reader that loses its connection and resumes with
``Last-Event-ID`` (or the route's own query cursor), and what it found on the way back.

This file decides how a dropped read is done and judged, on two routes:
- native: ``POST .../v1/replies`` with ``resumable: true`` (the reply id in ``X-Reply-Id``),
  resumed at ``GET /v1/replies/{id}/stream``, the query cursor ``last_event_id``;
- responses: ``POST .../v1/responses`` with ``store`` and ``background`` (OpenAI resumes only
  a background response: any other stops when its reader leaves), the response id from
  ``response.created``, resumed at ``GET .../v1/responses/{id}?stream=true``, the query
  cursor ``starting_after`` (a ``sequence_number``, counted from 0; ``Last-Event-ID`` takes
  an ``id:``). An event's number, by which losses and repeats are counted, is its ``id:`` or
  else its ``sequence_number``.
Start the reply, read until ``drop_after`` tokens arrived, close the socket, then ask for the
events after the last number seen and read to the end. It reports the
time from sending the resume request to the first replayed event, and the events lost (an id
that never arrived, or one the server announced in a ``gap`` event) and duplicated (an id
that arrived twice); both must be 0. The whole read, both connections, is one
``ReplyTiming`` so its latencies sit beside every other request's. It must not know what
the figures mean for a run (``benchstats``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard
from urllib.parse import urlencode, urlsplit, urlunsplit

from replystream.client import ReplyTiming
from replystream.client.formats import interpret_event, server_json
from replystream.client.resume import resume_url
from replystream.client.transport import (
    ConnectError,
    Headers,
    TransportError,
    http_request,
    with_headers,
)
from replystream.sse import EventParser, SSEError

Route = Literal["native", "responses"]
ROUTES: tuple[Route, ...] = ("native", "responses")
# How the resume says where it left off: the Last-Event-ID header, or the route's own query
# parameter (``last_event_id`` native, ``starting_after`` Responses, as OpenAI's SDK sends).
Cursor = Literal["header", "query"]
CURSORS: tuple[Cursor, ...] = ("header", "query")


@dataclass(frozen=True, slots=True)
class ResumeOutcome:
    """What one drop and resume found."""

    dropped_after_tokens: int
    # The connection was dropped: a reply that ended before ``dropped_after_tokens`` was read
    # whole on its first connection, with nothing to resume.
    dropped: bool
    resumed: bool  # the resume request was answered with the rest of the reply
    reconnect_ms: float | None  # resume request sent -> first replayed event
    lost: int
    duplicated: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "dropped_after_tokens": self.dropped_after_tokens,
            "dropped": self.dropped,
            "resumed": self.resumed,
            "reconnect_ms": self.reconnect_ms,
            "lost": self.lost,
            "duplicated": self.duplicated,
        }


@dataclass
class _Read:
    """State across both connections of one reply."""

    started: float
    ids: list[int] = field(default_factory=list)
    announced: list[tuple[int, int]] = field(default_factory=list)  # ``gap`` ranges, ids
    by_ids: bool = False  # an event had an ``id:`` of its own: events are counted by those
    text: list[str] = field(default_factory=list)
    # A reasoning model's thinking: output as its text is (``measure_reply`` takes it so),
    # so it is in every timing and count, and the answer's first text is timed apart.
    thoughts: list[str] = field(default_factory=list)
    first_answer_ms: float | None = None
    tokens: int = 0
    # The server's own count of the reply's tokens (a Responses stream's ending event, a
    # ``usage`` event): the better count, as ``measure_reply`` takes it, since an event may
    # carry several tokens without saying so.
    reported_tokens: int | None = None
    estimated: bool = False  # a text event's tokens were counted here (``Meaning.counted``)
    event_ms: list[float] = field(default_factory=list)
    event_chars: list[int] = field(default_factory=list)
    complete: bool = False
    error: str | None = None
    status: int | None = None
    headers_ms: float | None = None
    first_chunk_ms: float | None = None
    body_bytes: int = 0
    reply_id: str | None = None
    response_id: str | None = None  # a Responses id, from ``response.created``
    first_number: int | None = None  # the first event's number: 1 ours, 0 OpenAI's Responses
    last_sequence: int | None = None  # the last Responses ``sequence_number`` read

    def ms(self, at: float) -> float:
        return (at - self.started) * 1000.0


def _id_number(event_id: str | None) -> int | None:
    """An event's own ``id:`` as its number (None: it has none, or one of other characters;
    ``str.isdigit`` alone takes ``"\u00b2"``, which ``int`` refuses)."""
    if event_id is not None and event_id.isascii() and event_id.isdigit():
        return int(event_id)
    return None


def _sequence_number(payload: Any) -> int | None:
    number = payload.get("sequence_number") if isinstance(payload, dict) else None
    return number if _whole(number) else None


async def _follow(
    read: _Read,
    url: str,
    method: str,
    body: bytes,
    headers: Headers,
    stop_after: int,
    tls: ssl.SSLContext | None,
) -> float | None:
    """Read one connection's events until the end, an error or ``stop_after`` tokens (0: no
    stop); return the time of its first numbered event (perf_counter) or None."""
    first_at: float | None = None
    async with http_request(url, method=method, body=body, headers=headers, tls=tls) as response:
        if read.status is None:
            read.status = response.status
            read.headers_ms = read.ms(response.head_at)
            read.reply_id = response.headers.get("x-reply-id")
        if response.status != 200 or response.content_type != "text/event-stream":
            detail = b"".join([c.data async for c in response])[:200].decode(errors="replace")
            read.error = f"HTTP {response.status}: {detail}"
            return None
        parser = EventParser()
        previous_id = ""
        async for chunk in response:
            if read.first_chunk_ms is None:
                read.first_chunk_ms = read.ms(chunk.at)
            read.body_bytes += len(chunk.data)
            for event in parser.feed(chunk.data):
                sequenced = read.response_id is not None or event.type == "response.created"
                # A parsed event carries the last id in force: one that repeats the id of
                # the event before it has none of its own (a ``gap``, a notice about this
                # connection), and its number is not that event's again.
                event_id = event.id or ""
                own_id = event_id if event_id != previous_id else None
                previous_id = event_id
                number = _id_number(own_id)
                payload = _json(event.data) if sequenced or number is None else None
                if number is not None:
                    read.by_ids = True
                elif not read.by_ids:
                    # A stream without ids (OpenAI's Responses) is counted by its
                    # ``sequence_number``s; one with ids by those alone: an event without
                    # (a notice) repeats the number of the one before it, in either count.
                    number = _sequence_number(payload)
                sequence = _sequence_number(payload)
                if sequence is not None:
                    read.last_sequence = sequence
                if number is not None:
                    read.ids.append(number)
                    read.first_number = number if read.first_number is None else read.first_number
                    first_at = chunk.at if first_at is None else first_at
                if event.type == "gap":
                    read.announced.append(_gap_range(event.data))
                elif event.type == "response.created":
                    read.response_id = read.response_id or _created_id(_json(event.data))
                meaning = interpret_event(event)
                if meaning.usage is not None:
                    read.reported_tokens = meaning.usage
                if meaning.kind in ("text", "thinking") and meaning.text:
                    if meaning.kind == "thinking":
                        read.thoughts.append(meaning.text)
                    else:
                        read.text.append(meaning.text)
                        if read.first_answer_ms is None:
                            read.first_answer_ms = read.ms(chunk.at)
                    read.tokens += meaning.tokens
                    read.estimated = read.estimated or not meaning.counted
                    read.event_ms.append(read.ms(chunk.at))
                    read.event_chars.append(len(meaning.text))
                    if stop_after and read.tokens >= stop_after:
                        return first_at
                elif meaning.kind == "done":
                    read.complete = True
                    return first_at
                elif meaning.kind == "usage":
                    read.reported_tokens = meaning.tokens
                elif meaning.kind == "error":
                    read.error = meaning.error
                    return first_at
    return first_at


def _gap_range(data: str) -> tuple[int, int]:
    """The ids a ``gap`` event says were lost (``{"lost_from", "lost_to"}``), first and last;
    raises ValueError for one that names no such range (a server's mistake, reported)."""
    gap = _json(data)
    first = gap.get("lost_from") if isinstance(gap, dict) else None
    last = gap.get("lost_to") if isinstance(gap, dict) else None
    if not (_whole(first) and _whole(last) and 0 <= first <= last):
        raise ValueError(f"a gap event names no range of lost events: {data[:80]!r}")
    return first, last


def _lost(seen: set[int], origin: int, announced: list[tuple[int, int]]) -> int:
    """How many numbers from ``origin`` up were lost: never arrived (below the highest that
    did) or announced in a ``gap`` event, each counted once when it is both."""
    ranges = list(announced)
    expected = origin
    for number in sorted(seen):
        if number > expected:
            ranges.append((expected, number - 1))
        expected = max(expected, number + 1)
    lost, end = 0, -1  # ``end``: the last number counted so far
    for first, last in sorted(ranges):
        if last > end:
            lost += last - max(first, end + 1) + 1
            end = last
    return lost


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _created_id(payload: Any) -> str | None:
    """The response id a ``response.created`` event carries, if it carries one."""
    response = payload.get("response") if isinstance(payload, dict) else None
    found = response.get("id") if isinstance(response, dict) else None
    return found if isinstance(found, str) and found else None


def _json(data: str) -> Any:
    try:
        return server_json(data)
    except ValueError:
        return None


def _start_body(route: Route, json_body: dict[str, Any]) -> dict[str, Any]:
    if route == "native":
        return {**json_body, "resumable": True}
    return {**json_body, "stream": True, "store": True, "background": True}


def _resume_request(
    route: Route, cursor: Cursor, url: str, read: _Read
) -> tuple[str, dict[str, str]] | None:
    """The URL and headers that ask for the events after the last one read (None: the
    reply's id never arrived, so it cannot be asked for)."""
    after = str(read.ids[-1])
    if route == "native":
        if read.reply_id is None:
            return None
        target, param = resume_url(url, read.reply_id), "last_event_id"
        query: dict[str, str] = {}
    else:
        if read.response_id is None:
            return None
        parts = urlsplit(url)
        path = f"{parts.path.rstrip('/')}/{read.response_id}"
        target = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        param, query = "starting_after", {"stream": "true"}
    sent_headers = {"Last-Event-ID": after} if cursor == "header" else {}
    if cursor == "query":
        # ``starting_after`` is a sequence number, whatever the events' ids.
        sequence = read.last_sequence if param == "starting_after" else None
        query[param] = after if sequence is None else str(sequence)
    return (f"{target}?{urlencode(query)}" if query else target), sent_headers


async def drop_and_resume(
    url: str,
    json_body: dict[str, Any],
    drop_after_tokens: int,
    timeout_s: float,
    headers: Headers | None = None,
    *,
    route: Route = "native",
    cursor: Cursor = "header",
    tls: ssl.SSLContext | None = None,
) -> tuple[ReplyTiming, ResumeOutcome]:
    """Start a resumable reply at ``url`` on ``route``, drop it after ``drop_after_tokens``
    tokens, resume it (saying where with ``cursor``) and read it to the end (``headers``
    sent on both connections; ``tls`` for an https URL)."""
    read = _Read(time.perf_counter())
    body = json.dumps(_start_body(route, json_body)).encode()
    ours = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    start_headers = with_headers(ours, headers)
    reconnect_ms: float | None = None
    dropped = resumed = False
    connected = True
    try:
        async with asyncio.timeout(timeout_s):
            await _follow(read, url, "POST", body, start_headers, drop_after_tokens, tls)
            dropped = not read.complete and read.error is None and read.tokens >= drop_after_tokens
            if dropped and not read.ids:
                read.error = (
                    "no event carried a number (an id: or a sequence_number), so the reply "
                    "cannot be resumed"
                )
            elif not read.complete and read.error is None and read.ids:
                again = _resume_request(route, cursor, url, read)
                if again is None:
                    read.error = "the reply's id never arrived, so it cannot be resumed"
                else:
                    target, cursor_headers = again
                    sent = time.perf_counter()
                    # The cursor is the reader's own: it replaces one given as a header.
                    resume_headers = with_headers(
                        with_headers({"Accept": "text/event-stream"}, headers), cursor_headers
                    )
                    first = await _follow(read, target, "GET", b"", resume_headers, 0, tls)
                    resumed = read.error is None
                    reconnect_ms = None if first is None else (first - sent) * 1000.0
    except TimeoutError:
        read.error = f"timed out after {timeout_s:g} s"
    except ConnectError as exc:
        # Only the first connection tells whether the server could be reached at all.
        connected = read.status is not None
        read.error = f"read failed: {exc}" if connected else str(exc)
    except (TransportError, SSEError, zlib.error, ValueError, KeyError) as exc:
        read.error = f"read failed: {exc}"
    if not read.complete and read.error is None:
        read.error = "stream ended without an end marker"
    seen = set(read.ids)
    # Numbers run without a hole from the first: 1 (ours), or 0 (OpenAI's sequence numbers).
    origin = 0 if read.first_number == 0 else 1
    timing = ReplyTiming(
        url=url,
        streamed=True,
        complete=read.complete and read.error is None,
        error=read.error,
        status=read.status,
        headers_ms=read.headers_ms,
        first_chunk_ms=read.first_chunk_ms,
        first_text_ms=read.event_ms[0] if read.event_ms else None,
        last_text_ms=read.event_ms[-1] if read.event_ms else None,
        closed_ms=read.ms(time.perf_counter()),
        body_bytes=read.body_bytes,
        text="".join(read.text),
        tokens=read.tokens if read.reported_tokens is None else read.reported_tokens,
        tokens_counted=read.reported_tokens is not None or not read.estimated,
        text_event_ms=tuple(read.event_ms),
        text_event_chars=tuple(read.event_chars),
        reply_id=read.reply_id,
        connected=connected,
        thinking="".join(read.thoughts),
        first_answer_ms=read.first_answer_ms,
    )
    outcome = ResumeOutcome(
        dropped_after_tokens=drop_after_tokens,
        dropped=dropped,
        resumed=resumed,
        reconnect_ms=reconnect_ms,
        lost=_lost(seen, origin, read.announced),
        duplicated=len(read.ids) - len(seen),
    )
    return timing, outcome
