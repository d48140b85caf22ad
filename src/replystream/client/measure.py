"""Timed reads of one reply, buffered or streamed, as a reader experiences it.

Every timestamp is milliseconds from the moment the request was sent (``perf_counter``).
A reply counts as complete only with an explicit terminal marker: a parsed 2xx JSON body, or
the stream's end marker (``[DONE]`` or a ``done`` event). A clean end of file without one, an
in-band error, a truncated body or a reset connection is reported as incomplete, with the
reason, and never as a timing result.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from replystream.client.formats import (
    MAX_EVENT_CHARS,
    interpret_body,
    interpret_event,
    words_added,
)
from replystream.client.transport import (
    MAX_BODY_BYTES,
    ConnectError,
    Connection,
    Headers,
    HTTPResponse,
    TransportError,
    http_request,
    with_headers,
)
from replystream.sse import EventParser, SSEError


@dataclass(frozen=True, slots=True)
class ReplyTiming:
    """What one reader saw of one reply. Times are ms from request start; None if never.

    ``headers_ms``: the response head (status line and headers) arrived, what ``doctor`` and
    ``bench`` report as ``first_byte_ms``; ``first_chunk_ms``: the first body bytes arrived
    (for a compressed body, the first that decompressed to any), their ``first_chunk_ms``
    too (docs/metrics.md)."""

    url: str
    streamed: bool
    complete: bool
    error: str | None
    status: int | None
    headers_ms: float | None
    first_chunk_ms: float | None
    first_text_ms: float | None
    last_text_ms: float | None
    closed_ms: float
    body_bytes: int
    text: str
    tokens: int
    # ``tokens`` is the server's count (its usage, or events that each say theirs); False: a
    # reader's estimate, one per event or the text's words, which a server batching tokens
    # into events, or a tokenizer that is not words, makes differ from what it sent.
    tokens_counted: bool = True
    text_event_ms: tuple[float, ...] = ()
    text_event_chars: tuple[int, ...] = ()
    # Per text event, the body bytes read before and after the read that completed it: the
    # bytes that arrived together with it, whatever other events (a Responses stream's
    # closing ones, which repeat the whole reply) the body holds elsewhere.
    text_event_reads: tuple[tuple[int, int], ...] = ()
    reply_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cancelled: bool = False  # the reader hung up on purpose (``stop_after_tokens``)
    # A reasoning model's thinking, apart from ``text`` (the answer). Its events are text
    # events for every timing (``first_text_ms`` is the first of either, as a reader sees
    # output begin and as vLLM's benchmark counts it); ``first_answer_ms``: the answer's.
    thinking: str = ""
    first_answer_ms: float | None = None
    # False when no connection could be made: the request never reached a server.
    connected: bool = True

    @property
    def gaps_ms(self) -> list[float]:
        """Time between consecutive text events."""
        times = self.text_event_ms
        return [b - a for a, b in itertools.pairwise(times)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "streamed": self.streamed,
            "complete": self.complete,
            "error": self.error,
            "status": self.status,
            "headers_ms": self.headers_ms,
            "first_chunk_ms": self.first_chunk_ms,
            "first_text_ms": self.first_text_ms,
            "last_text_ms": self.last_text_ms,
            "closed_ms": self.closed_ms,
            "body_bytes": self.body_bytes,
            "tokens": self.tokens,
            "tokens_counted": self.tokens_counted,
            "cancelled": self.cancelled,
            "first_answer_ms": self.first_answer_ms,
            "thinking_chars": len(self.thinking),
            "text_events": len(self.text_event_ms),
            "text_event_ms": list(self.text_event_ms),
        }


class _Reading:
    """Mutable state of one read in progress; frozen into a ``ReplyTiming`` at the end."""

    def __init__(
        self,
        url: str,
        started: float,
        stop_after_tokens: int | None = None,
        max_event_size: int = MAX_EVENT_CHARS,
    ) -> None:
        self.url = url
        self.max_event_size = max_event_size
        self.started = started
        self.stop_after_tokens = stop_after_tokens
        self.cancelled = False
        self.streamed = False
        self.complete = False
        self.error: str | None = None
        self.status: int | None = None
        self.headers_ms: float | None = None
        self.first_chunk_ms: float | None = None
        self.body_bytes = 0
        self.read_from = 0  # the body bytes read before the current read
        self.parts: list[str] = []
        self.thoughts: list[str] = []
        self.first_answer_ms: float | None = None
        self.tokens = 0
        self.reported_tokens: int | None = None  # the server's own count, when it sends one
        self.estimated = False  # a text event's tokens were counted here, not by the server
        self.event_ms: list[float] = []
        self.event_chars: list[int] = []
        self.event_reads: list[tuple[int, int]] = []
        self.headers: dict[str, str] = {}
        self.connected = True
        self.lost: str | None = None  # a gap the server announced: text is missing

    def ms(self, at: float) -> float:
        """``perf_counter()`` time ``at`` as ms since the request started."""
        return (at - self.started) * 1000.0

    def on_text(self, text: str, tokens: int, at_ms: float, thinking: bool = False) -> None:
        if not text:
            return
        if thinking:
            self.thoughts.append(text)
        else:
            self.parts.append(text)
            if self.first_answer_ms is None:
                self.first_answer_ms = at_ms
        self.tokens += tokens
        self.event_ms.append(at_ms)
        self.event_chars.append(len(text))
        self.event_reads.append((self.read_from, self.body_bytes))

    def finish(self) -> ReplyTiming:
        if self.error is None and self.lost is not None:
            self.error = self.lost
        if not self.complete and self.error is None:
            self.error = "stream ended without an end marker" if self.streamed else "no reply"
        return ReplyTiming(
            url=self.url,
            streamed=self.streamed,
            complete=self.complete and self.error is None,
            error=self.error,
            status=self.status,
            headers_ms=self.headers_ms,
            first_chunk_ms=self.first_chunk_ms,
            first_text_ms=self.event_ms[0] if self.event_ms else None,
            last_text_ms=self.event_ms[-1] if self.event_ms else None,
            closed_ms=self.ms(time.perf_counter()),
            body_bytes=self.body_bytes,
            text="".join(self.parts),
            # Servers that put several tokens in one chunk (without saying so per event) do
            # report the total in their usage; it is the better count.
            tokens=self.reported_tokens if self.reported_tokens is not None else self.tokens,
            tokens_counted=self.reported_tokens is not None or not self.estimated,
            text_event_ms=tuple(self.event_ms),
            text_event_chars=tuple(self.event_chars),
            text_event_reads=tuple(self.event_reads),
            reply_id=self.headers.get("x-reply-id"),
            headers=self.headers,
            cancelled=self.cancelled,
            thinking="".join(self.thoughts),
            first_answer_ms=self.first_answer_ms,
            connected=self.connected,
        )


async def _read_stream(reading: _Reading, response: HTTPResponse) -> None:
    # A stream measured may be any server's: llama.cpp's server (its builds before October
    # 2025) wrote an error mid-reply as an ``error:`` line, then ``data: [DONE]``, which read
    # by the standard alone is a whole reply.
    parser = EventParser(reading.max_event_size, error_field=True)
    async for chunk in response:
        at = reading.ms(chunk.at)
        if reading.first_chunk_ms is None:
            reading.first_chunk_ms = at
        reading.read_from = reading.body_bytes
        reading.body_bytes += len(chunk.data)
        for event in parser.feed(chunk.data):
            meaning = interpret_event(event)
            if meaning.kind in ("text", "thinking"):
                tokens = meaning.tokens
                if meaning.in_words and reading.parts:
                    tokens = words_added(reading.parts[-1], meaning.text)
                reading.on_text(meaning.text, tokens, at, meaning.kind == "thinking")
                reading.estimated = reading.estimated or (
                    bool(meaning.text) and not meaning.counted
                )
                if meaning.usage is not None:
                    reading.reported_tokens = meaning.usage
                stop = reading.stop_after_tokens
                if stop is not None and reading.tokens >= stop:
                    # Hang up as a user who stops reading does: leaving closes the socket.
                    reading.cancelled = True
                    reading.error = f"cancelled by the reader after {reading.tokens} tokens"
                    return
            elif meaning.kind == "done":
                reading.complete = True
                if meaning.usage is not None:
                    reading.reported_tokens = meaning.usage
                # The reply has ended: leaving hangs up, as a reader that has its reply does
                # (and as the resuming reader does). A server that holds the connection open
                # after its end marker would otherwise turn a whole reply into a time-out.
                return
            elif meaning.kind == "usage":
                reading.reported_tokens = meaning.tokens
            elif meaning.kind == "gap":
                # The text goes on after the hole, and is read, but it is no whole reply.
                reading.lost = reading.lost or meaning.error
            elif meaning.kind == "error":
                reading.error = meaning.error
                return
    parser.close()


async def _read_body(reading: _Reading, response: HTTPResponse) -> None:
    body = bytearray()  # grown in place: the body is held once, not again when joined
    at = 0.0
    async for chunk in response:
        at = reading.ms(chunk.at)
        if reading.first_chunk_ms is None:
            reading.first_chunk_ms = at
        reading.body_bytes += len(chunk.data)
        body += chunk.data
    meaning = interpret_body(body)
    location = response.headers.get("location")
    if 300 <= response.status < 400 and location:
        # Not followed (a measured hop must be named, not skipped): say where it points.
        reading.error = f"HTTP {response.status}: redirected to {location} (not followed)"
    elif not 200 <= response.status < 300:
        reading.error = f"HTTP {response.status}: {meaning.error or 'error'}"
    elif meaning.kind == "done":
        # The body's usage when it has one; a body without (the lab's ``/wait``) is
        # counted in words, the nearest a reader can tell.
        reading.on_text(meaning.text, max(1, len(meaning.text.split())), at)
        reading.reported_tokens = meaning.usage
        reading.estimated = meaning.usage is None
        reading.complete = True
    else:
        reading.error = meaning.error


async def measure_reply(
    url: str,
    *,
    method: str = "GET",
    json_body: Any = None,
    headers: Headers | None = None,
    timeout_s: float = 300.0,
    connection: Connection | None = None,
    stop_after_tokens: int | None = None,
    tls: ssl.SSLContext | None = None,
    max_event_size: int = MAX_EVENT_CHARS,
    max_body_size: int = MAX_BODY_BYTES,
) -> ReplyTiming:
    """Send one request and time how its reply arrives; never raises for a failed reply.

    With an open ``connection`` (see ``transport.connect``), timing starts when the request is
    written, so connection setup is not counted; otherwise it starts before connecting. A
    connection carries one request: one given again raises ``ValueError``.
    ``stop_after_tokens``: hang up once that many streamed tokens arrived (``cancelled``).
    ``tls``: the TLS context for an ``https://`` URL (see ``transport.connect``).
    ``max_event_size``: the largest event read, in characters (see ``EventParser``); a
    larger one fails the read.
    ``max_body_size``: the most the body may hold, in bytes once its gzip or deflate is
    undone (1 GiB by default); a larger one fails the read.
    """
    if max_event_size < 1:
        raise ValueError(f"max_event_size must be positive, got {max_event_size}")
    if max_body_size < 1:
        raise ValueError(f"max_body_size must be positive, got {max_body_size}")
    body = b"" if json_body is None else json.dumps(json_body).encode()
    ours = {"Accept": "text/event-stream, application/json", "Accept-Encoding": "gzip, deflate"}
    if json_body is not None:
        ours["Content-Type"] = "application/json"
    sent = with_headers(ours, headers)
    reading = _Reading(url, time.perf_counter(), stop_after_tokens, max_event_size)
    try:
        async with asyncio.timeout(timeout_s):
            async with http_request(
                url,
                method=method,
                body=body,
                headers=sent,
                connection=connection,
                tls=tls,
                max_body_size=max_body_size,
            ) as response:
                reading.headers_ms = reading.ms(response.head_at)
                reading.status = response.status
                reading.headers = response.headers
                reading.streamed = response.content_type == "text/event-stream"
                if reading.streamed and 200 <= response.status < 300:
                    await _read_stream(reading, response)
                else:
                    await _read_body(reading, response)
    except TimeoutError:
        reading.error = f"timed out after {timeout_s:g} s"
    except ConnectError as exc:
        reading.connected = False
        reading.error = str(exc)
    except (TransportError, SSEError) as exc:
        reading.error = f"read failed: {exc}"
    return reading.finish()
