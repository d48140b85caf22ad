"""A reader that survives dropped connections: it resumes a reply where it left off.

Start a reply (``POST``, or ``GET /stream?resumable=1``), then read its events. When the
connection drops, or ends without the reply's end marker, reconnect to the reply's resume URL
(``GET /v1/replies/{id}/stream``) with ``Last-Event-ID`` set to the last event seen; the prompt
is never sent twice. Between attempts it waits with capped exponential backoff and full
jitter, never less than the server's ``retry:`` value. A resume refused for now (429, 502,
503, 504: the server or a proxy in front of it is busy or restarting) is an attempt like a
dropped connection, and waits at least the ``Retry-After`` it came with. Either wait is
bounded (``Backoff.server_wait_cap_s``, a minute by default). An event id is any string, as
the SSE standard has it (``0`` and ``a7f3`` are ids like ``12``), and the last one read is
sent back as ``Last-Event-ID``. Events are yielded once each: one whose id is the id resumed
after is that event again, and so is, while ids are numbers (ASCII digits), one numbered at
or below the last; ``gap`` events and the
``generator_lost`` error are yielded for the caller to see. It stops after the end marker
(``[DONE]`` or ``done``), an ``error`` or ``moderated`` event, when the server answers a
resume with 409 ``reply_ended`` (the reply ended with the last event it holds: there is
nothing more to read), or when attempts run out (``ResumeFailed``, which names the last
failure, or an event past ``max_event_size`` characters, or a body past ``max_body_size``
bytes, which a resume would send again). The end marker is each dialect's own: ``[DONE]``,
``done``, a Responses stream's ``response.completed``, ``response.incomplete`` or
``response.failed``, a Messages stream's ``message_stop``. A connection that carries no byte
for ``idle_timeout_s`` (a peer gone without closing: a dead host, a NAT that forgot the flow)
counts as dropped; the server's keep-alive comments keep a live one busy. An unnumbered
``slow_client`` or ``shutdown`` error is about the connection, not the reply, so it leads to
a resume too, in the native shape and in the Responses one (``code`` at the top of the
event's data).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from replystream.client.formats import MAX_EVENT_CHARS, RESPONSES_ENDED, server_json
from replystream.client.transport import (
    MAX_BODY_BYTES,
    BodyTooLarge,
    HTTPResponse,
    TransportError,
    http_request,
    with_headers,
)
from replystream.retry_after import retry_after_s
from replystream.sse import Event, EventParser, EventTooLarge, SSEError

# How long a connection may carry nothing before it counts as dropped: a few times the
# server's keep-alive interval (``--keepalive-s``, 15 s by default).
IDLE_TIMEOUT_S = 45.0
# Errors a server sends about one connection, not the reply: reading again may succeed.
RESUMABLE_CUTS = frozenset({"slow_client", "shutdown"})
# Statuses of a resume that say "not now" (too many requests, a proxy without a server, a
# server that cannot serve for the moment): the reply may well go on, so try again.
RETRIED_STATUSES = frozenset({429, 502, 503, 504})
# How much of a refusal's body its message quotes.
DETAIL_BYTES = 300


class ResumeFailed(Exception):
    """The reply could not be read to its end within the allowed attempts.

    ``status``: the HTTP status of the answer that ended the read, when an answer did (a 401
    is the program's to mend, a 429 or 503 its to wait on); ``retry_after_s``: that answer's
    ``Retry-After`` in seconds, when it gave one. Both ``None`` for a read ended by no answer
    (a connection that dropped, an id that never came)."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with full jitter: uniform(0, min(cap, base x 2^n)), or the
    wait the server asked for when longer, up to ``server_wait_cap_s``: a server (or a proxy)
    that asks for hours, or for a number no float holds, must not stall the reader for good."""

    base_s: float = 0.1
    cap_s: float = 5.0
    max_attempts: int = 20
    server_wait_cap_s: float = 60.0

    def delay(self, attempt: int, server_retry_s: float | None, rng: random.Random) -> float:
        # 2^1024 is past a float: a reader told to try for hours (``max_attempts`` in the
        # thousands) would fail with OverflowError at its 1025th attempt. The largest float
        # power of two is past any cap anyway.
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(attempt, 1023))
        wait = rng.uniform(0, ceiling)
        return max(wait, min(server_retry_s or 0.0, self.server_wait_cap_s))


# The routes a resumable reply is started at, whose prefix its resume URL keeps.
_START_ROUTES = (
    "/v1/replies",
    "/stream",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)


def resume_url(start_url: str, reply_id: str) -> str:
    """Where the reply started at ``start_url`` is resumed: ``/v1/replies/{id}/stream`` under
    the same prefix (a proxy's ``/api/v1/replies`` resumes at ``/api/v1/replies/...``)."""
    parts = urlsplit(start_url)
    path = parts.path.rstrip("/")
    prefix = next((path[: -len(r)] for r in _START_ROUTES if path.endswith(r)), "")
    reply = quote(reply_id, safe="")  # an id is one path segment, whatever it holds
    return urlunsplit((parts.scheme, parts.netloc, f"{prefix}/v1/replies/{reply}/stream", "", ""))


class ResumingReader:
    """Reads one reply to its end across reconnects.

    Attributes after (or during) a read: ``reply_id``, ``last_event_id`` (the standard's
    last event ID string: the last ``id`` read, with its event or in a block of its own,
    ``""`` before any), ``reconnects``.
    """

    def __init__(
        self,
        url: str,
        *,
        method: str = "POST",
        json_body: object = None,
        headers: dict[str, str] | None = None,
        backoff: Backoff | None = None,
        seed: int | None = None,
        tls: ssl.SSLContext | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_event_size: int = MAX_EVENT_CHARS,
        max_body_size: int = MAX_BODY_BYTES,
    ) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
        if max_event_size < 1:
            raise ValueError(f"max_event_size must be positive, got {max_event_size}")
        if max_body_size < 1:
            raise ValueError(f"max_body_size must be positive, got {max_body_size}")
        self.url = url
        self.method = method
        self.json_body = json_body
        self.headers = dict(headers or {})
        self.backoff = backoff or Backoff()
        self.tls = tls  # for an https:// URL (see ``transport.connect``)
        self.idle_timeout_s = idle_timeout_s
        self.max_event_size = max_event_size  # characters, see ``EventParser``
        self.max_body_size = max_body_size  # bytes one connection's body may hold, decoded
        self.reply_id: str | None = None
        self.last_event_id = ""
        self.reconnects = 0
        self.finished = False
        self._retry_s: float | None = None
        self._retry_after_s: float | None = None  # the last refusal's Retry-After
        self._refused: int | None = None  # the last failure's status, when it was a refusal
        self._rng = random.Random(seed)

    async def events(self) -> AsyncGenerator[Event, None]:
        """Every event of the reply once, in order, across reconnects.

        A generator: a caller that stops early closes the connection at once with
        ``contextlib.aclosing`` (else when the generator is collected)."""
        attempt = 0
        while not self.finished:
            failure: Exception | None = None
            self._refused = None
            try:
                async for event in self._one_connection():
                    attempt = 0
                    yield event
            except (TransportError, SSEError, OSError) as exc:
                failure = exc  # a dropped or broken connection: resume below
            if self.finished:
                return
            why = f": {failure}" if failure is not None else ": the stream ended early"
            if self.reply_id is None:
                raise ResumeFailed(
                    f"the reply's id never arrived, so it cannot be resumed{why}"
                ) from failure
            attempt += 1
            if attempt > self.backoff.max_attempts:
                raise ResumeFailed(
                    f"gave up after {self.backoff.max_attempts} attempts; the last{why}",
                    status=self._refused,
                    retry_after_s=self._retry_after_s,
                ) from failure
            told = max(self._retry_s or 0.0, self._retry_after_s or 0.0)
            self._retry_after_s = None
            await asyncio.sleep(self.backoff.delay(attempt - 1, told, self._rng))
            self.reconnects += 1

    async def _one_connection(self) -> AsyncIterator[Event]:
        ours = {"Accept": "text/event-stream"}
        given = self.headers
        resumed_from: list[tuple[str, str]] = []
        resumed_after: str | None = None  # the last event ID string this connection resumes
        if self.reply_id is None:
            url, method = self.url, self.method
            body = b"" if self.json_body is None else json.dumps(self.json_body).encode()
            if body:
                ours["Content-Type"] = "application/json"
        else:
            url, method, body = resume_url(self.url, self.reply_id), "GET", b""
            resumed_after = self.last_event_id
            # Where a resume starts is the reader's to say, whatever the caller's headers.
            given = {k: v for k, v in given.items() if k.lower() != "last-event-id"}
            # No header while no id was read, as an EventSource sends none. An id's spaces
            # at either end are none of a header's value (a server reads it without them).
            if sent := resumed_after.strip(" \t"):
                resumed_from = [("Last-Event-ID", sent)]
        # A header of the caller's replaces one of ours in any spelling (``content-type``
        # beside our ``Content-Type`` was sent twice, which a server may refuse).
        headers = with_headers(ours, given) + resumed_from
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    response = await stack.enter_async_context(
                        http_request(
                            url,
                            method=method,
                            body=body,
                            headers=headers,
                            tls=self.tls,
                            max_body_size=self.max_body_size,
                        )
                    )
            except TimeoutError:
                raise TransportError(f"no response head within {self.idle_timeout_s:g} s") from None
            if response.status == 404 and self.reply_id is not None:
                raise ResumeFailed(
                    f"reply {self.reply_id} is gone (expired or never existed)", status=404
                )
            if response.status == 409 and self.reply_id is not None:
                # ``reply_ended``: the reply ended with the last event this reader holds, so
                # it has read everything there is (the drop came after that event).
                self.finished = True
                return
            if response.status in RETRIED_STATUSES and self.reply_id is not None:
                self._retry_after_s = _retry_after(response.headers.get("retry-after", ""))
                self._refused = response.status
                raise TransportError(f"resume refused for now: HTTP {response.status}")
            # An event stream is a 200 (as an EventSource takes it): a 201, a 206 or a
            # redirect not followed is no stream to read, whatever its type.
            if response.status != 200 or response.content_type != "text/event-stream":
                raise ResumeFailed(
                    f"HTTP {response.status}: {await self._detail(response)}",
                    status=response.status,
                    retry_after_s=_retry_after(response.headers.get("retry-after", "")),
                )
            self.reply_id = self.reply_id or response.headers.get("x-reply-id")
            parser = EventParser(self.max_event_size)
            previous_id = ""
            async for data in self._body(response):
                try:
                    events = parser.feed(data)
                except EventTooLarge as exc:
                    # No dropped connection: every resume would send the same event again.
                    raise ResumeFailed(
                        f"an event is larger than this reader takes ({exc}); every resume "
                        "would send it again"
                    ) from exc
                # A ``retry`` field counts as soon as it is read, with or without an event.
                if parser.retry is not None:
                    self._retry_s = parser.retry / 1000.0
                for event in events:
                    # Reply events carry ids of their own; an event that repeats the id in
                    # force carried none: the server sent it about this connection (a gap, a
                    # cut).
                    event_id = event.id or ""
                    own_id = event_id != previous_id
                    previous_id = event_id
                    if own_id:
                        if self._seen(event_id, resumed_after):
                            continue  # already read before the reconnect
                        self.last_event_id = event_id
                    elif event.type == "error" and _code(event) in RESUMABLE_CUTS:
                        return  # this connection was cut; the reply goes on: resume
                    if event.type == "reply" and self.reply_id is None:
                        self.reply_id = _reply_id(event)
                    if _ends_reply(event):
                        self.finished = True
                    yield event
                    if self.finished:
                        return
                # A block with an id and no data sets the last event ID string too (the
                # standard's dispatch sets it at every blank line, before it looks at the
                # data): a resume starts after it, though no event came with it.
                if (dispatched := parser.last_event_id) != previous_id:
                    previous_id = dispatched
                    if not self._seen(dispatched, resumed_after):
                        self.last_event_id = dispatched

    def _seen(self, event_id: str, resumed_after: str | None) -> bool:
        """Whether the event of this id (its own) was read before: it is the event resumed
        after, sent again, or ids are numbers and it is at or below the last read."""
        if resumed_after and event_id == resumed_after:
            return True
        last = self.last_event_id
        return _is_seq(event_id) and _is_seq(last) and _seq_key(event_id) <= _seq_key(last)

    async def _detail(self, response: HTTPResponse) -> str:
        """The start of a refusal's body, for its message: up to ``DETAIL_BYTES``, and only
        what came before the body ended, stopped or broke (the status said what matters)."""
        kept = b""
        with contextlib.suppress(TransportError):
            async with contextlib.aclosing(self._body(response)) as body:
                async for data in body:
                    kept += data
                    if len(kept) >= DETAIL_BYTES:
                        break
        return kept[:DETAIL_BYTES].decode(errors="replace")

    async def _body(self, response: HTTPResponse) -> AsyncGenerator[bytes, None]:
        """The body's bytes; a wait past ``idle_timeout_s`` for the next is a dropped
        connection."""
        chunks = aiter(response)
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except BodyTooLarge as exc:
                # Not resumed: a server that sent that much (or a body that inflates without
                # end) would do it again on every resume.
                raise ResumeFailed(f"the stream is longer than this reader takes: {exc}") from exc
            except TimeoutError:
                raise TransportError(
                    f"the connection carried nothing for {self.idle_timeout_s:g} s"
                ) from None
            yield chunk.data


# The events that end a reply, besides ``data: [DONE]``: native, Messages, and every event
# that ends a Responses stream (each dialect's in-band failure is an ``error`` event).
ENDING_TYPES = frozenset({"done", "error", "moderated", "message_stop", *RESPONSES_ENDED})


def _ends_reply(event: Event) -> bool:
    """The reply's last event, in any dialect: its end marker, or a failure that ends it."""
    return event.type in ENDING_TYPES or event.data == "[DONE]"


def _is_seq(event_id: str) -> bool:
    """An event id that is a reply's sequence number (ASCII digits only: ``"\u00b9"`` is a
    digit to ``str.isdigit`` and no number to ``int``)."""
    return event_id.isascii() and event_id.isdigit()


def _seq_key(number: str) -> tuple[int, str]:
    """An id of ASCII digits as a key that orders as its number does, of any length (``int``
    refuses a string of more than 4,300 digits, and a server may send one)."""
    digits = number.lstrip("0")
    return len(digits), digits


def _reply_id(event: Event) -> str | None:
    """The id a native ``reply`` event names, if its data is the object it should be."""
    try:
        payload = server_json(event.data)
    except ValueError:
        return None
    reply_id = payload.get("reply_id") if isinstance(payload, dict) else None
    return reply_id if isinstance(reply_id, str) and reply_id else None


def _retry_after(value: str) -> float | None:
    """A ``Retry-After`` in seconds: its delay-seconds as given, or its HTTP-date (RFC 9110
    allows either; proxies and CDNs send dates) as seconds from now. A date already past,
    and anything else, is taken as absent."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    return retry_after_s(value, time.time(), math.inf)


def _code(event: Event) -> str | None:
    """An ``error`` event's code, in either shape a server sends: the native one
    (``{"error": {"code": ...}}``) or the Responses one (``{"type": "error", "code": ...}``)."""
    try:
        payload = server_json(event.data)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    code = error.get("code") if isinstance(error, dict) else payload.get("code")
    return code if isinstance(code, str) else None
