"""The drop-and-resume scenario: a reader that loses its connection and resumes with
``Last-Event-ID``, and what it found on the way back.

This file decides how a dropped read is done and judged on replystream's native route: start
a resumable reply, read until ``drop_after`` tokens arrived, close the socket, then ask the
reply's resume URL for the events after the last id seen and read to the end. It reports the
time from sending the resume request to the first replayed event, and the events lost (an id
that never arrived, or one the server announced in a ``gap`` event) and duplicated (an id
that arrived twice); both must be 0. The whole read, both connections, is one
``ReplyTiming`` so its latencies sit beside every other request's. It must not know what
the figures mean for a run (``benchstats``).
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from replystream.client import ReplyTiming
from replystream.client.formats import interpret_event
from replystream.client.resume import resume_url
from replystream.client.transport import TransportError, http_request
from replystream.sse import EventParser, SSEError


@dataclass(frozen=True, slots=True)
class ResumeOutcome:
    """What one drop and resume found."""

    dropped_after_tokens: int
    resumed: bool  # the resume request was answered with the rest of the reply
    reconnect_ms: float | None  # resume request sent -> first replayed event
    lost: int
    duplicated: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "dropped_after_tokens": self.dropped_after_tokens,
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
    announced_lost: int = 0
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    event_ms: list[float] = field(default_factory=list)
    event_chars: list[int] = field(default_factory=list)
    complete: bool = False
    error: str | None = None
    status: int | None = None
    headers_ms: float | None = None
    first_byte_ms: float | None = None
    body_bytes: int = 0
    reply_id: str | None = None

    def ms(self, at: float) -> float:
        return (at - self.started) * 1000.0


async def _follow(
    read: _Read, url: str, method: str, body: bytes, headers: dict[str, str], stop_after: int
) -> float | None:
    """Read one connection's events until the end, an error or ``stop_after`` tokens (0: no
    stop); return the time of its first numbered event (perf_counter) or None."""
    first_at: float | None = None
    async with http_request(url, method=method, body=body, headers=headers) as response:
        if read.status is None:
            read.status = response.status
            read.headers_ms = read.ms(response.head_at)
            read.reply_id = response.headers.get("x-reply-id")
        if response.status != 200 or response.content_type != "text/event-stream":
            detail = b"".join([c.data async for c in response])[:200].decode(errors="replace")
            read.error = f"HTTP {response.status}: {detail}"
            return None
        parser = EventParser()
        async for chunk in response:
            if read.first_byte_ms is None:
                read.first_byte_ms = read.ms(chunk.at)
            read.body_bytes += len(chunk.data)
            for event in parser.feed(chunk.data):
                if (event.id or "").isdigit():
                    read.ids.append(int(event.id or "0"))
                    first_at = chunk.at if first_at is None else first_at
                if event.type == "gap":
                    gap = json.loads(event.data)
                    read.announced_lost += int(gap["lost_to"]) - int(gap["lost_from"]) + 1
                meaning = interpret_event(event)
                if meaning.kind == "text" and meaning.text:
                    read.text.append(meaning.text)
                    read.tokens += meaning.tokens
                    read.event_ms.append(read.ms(chunk.at))
                    read.event_chars.append(len(meaning.text))
                    if stop_after and read.tokens >= stop_after:
                        return first_at
                elif meaning.kind == "done":
                    read.complete = True
                    return first_at
                elif meaning.kind == "error":
                    read.error = meaning.error
                    return first_at
    return first_at


async def drop_and_resume(
    url: str,
    json_body: dict[str, Any],
    drop_after_tokens: int,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> tuple[ReplyTiming, ResumeOutcome]:
    """Start a resumable reply at ``url`` (the native route), drop it after
    ``drop_after_tokens`` tokens, resume it and read it to the end (``headers`` sent on
    both connections)."""
    read = _Read(time.perf_counter())
    body = json.dumps({**json_body, "resumable": True}).encode()
    extra = headers or {}
    start_headers = {"Accept": "text/event-stream", "Content-Type": "application/json", **extra}
    reconnect_ms: float | None = None
    resumed = False
    try:
        async with asyncio.timeout(timeout_s):
            await _follow(read, url, "POST", body, start_headers, drop_after_tokens)
            if not read.complete and read.error is None and read.reply_id and read.ids:
                again = {
                    "Accept": "text/event-stream",
                    **extra,
                    "Last-Event-ID": str(read.ids[-1]),
                }
                sent = time.perf_counter()
                first = await _follow(read, resume_url(url, read.reply_id), "GET", b"", again, 0)
                resumed = read.error is None
                reconnect_ms = None if first is None else (first - sent) * 1000.0
    except TimeoutError:
        read.error = f"timed out after {timeout_s:g} s"
    except (TransportError, SSEError, zlib.error, ValueError, KeyError) as exc:
        read.error = f"read failed: {exc}"
    if not read.complete and read.error is None:
        read.error = "stream ended without an end marker"
    seen = set(read.ids)
    missing = (max(seen) - len(seen)) if seen else 0  # ids run 1, 2, 3 ... without a hole
    timing = ReplyTiming(
        url=url,
        streamed=True,
        complete=read.complete and read.error is None,
        error=read.error,
        status=read.status,
        headers_ms=read.headers_ms,
        first_byte_ms=read.first_byte_ms,
        first_text_ms=read.event_ms[0] if read.event_ms else None,
        last_text_ms=read.event_ms[-1] if read.event_ms else None,
        closed_ms=read.ms(time.perf_counter()),
        body_bytes=read.body_bytes,
        text="".join(read.text),
        tokens=read.tokens,
        text_event_ms=tuple(read.event_ms),
        text_event_chars=tuple(read.event_chars),
        reply_id=read.reply_id,
    )
    outcome = ResumeOutcome(
        dropped_after_tokens=drop_after_tokens,
        resumed=resumed,
        reconnect_ms=reconnect_ms,
        lost=missing + read.announced_lost,
        duplicated=len(read.ids) - len(seen),
    )
    return timing, outcome
