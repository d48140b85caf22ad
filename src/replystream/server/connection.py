"""One HTTP/1.1 connection: aiohttp's, with our rules for what arrives before a request.

This file is the only place that reaches into aiohttp's connection class (``RequestHandler``).
It decides two things:

- **A deadline for every request's headers.** The headers of a connection's first request
  must arrive within ``header_timeout_s`` of the accept; on a kept-alive connection, those of
  each later request within ``header_timeout_s`` of its first byte. A client that trickles a
  header line a second is closed then, whichever request it is on. (An idle kept-alive
  connection, silent between requests, is closed by aiohttp's keep-alive timeout, which
  ``serve`` sets from ``idle_timeout_s``.)
- **Requests aiohttp's parser refuses** (framing in doubt: Content-Length with
  Transfer-Encoding, a duplicate Content-Length, a line over the size limit, a bad method)
  are answered in the API's JSON error shape, echo none of the bytes they were sent, are
  logged in one line without a traceback, and close the connection: after a framing error
  nothing on it can be trusted. The refusal takes the shape its route's clients read
  (``errors.in_route_shape``: Anthropic's on ``/v1/messages``), so the first bytes of each
  request are kept until its head is parsed, to read its path from when the parser refuses
  the head: aiohttp hands a refusal over without one.

Its site listens through ``accepting``'s server on every loop: on uvloop, whose own server
takes one connection per turn, it takes a burst in at once as asyncio's does; on asyncio's,
whose own server logs a traceback for every accept that finds no file descriptor left (many a
second, more each second the shortage lasts), it pauses and says so in one line.

It must not know about routes or replies.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import HttpVersion10, HttpVersion11, http_exceptions, web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from replystream.server.accepting import BatchAcceptingServer
from replystream.server.access_log import log_refused
from replystream.server.errors import error_response, in_route_shape
from replystream.stalls import LOOK_AGAIN_S, Deadline, fired_late

log = logging.getLogger("replystream.server")

# What the client is told for each kind of parser refusal: fixed words, never its bytes.
Refusal = tuple[int, str, str]  # status, code, message
_HEADER_TOO_LARGE: Refusal = (
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    "header_too_large",
    "the request line or a header field is longer than the server accepts",
)
_URI_TOO_LONG: Refusal = (
    HTTPStatus.REQUEST_URI_TOO_LONG,
    "uri_too_long",
    "the request target (its path and query) is longer than the server accepts",
)
_TOO_MANY_HEADERS: Refusal = (
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    "header_too_large",
    "the request has more header fields than the server accepts",
)
_BAD_METHOD: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "bad_method",
    "the request method is not a valid HTTP method",
)
_BAD_TARGET: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "bad_target",
    "the request target is not a valid URL",
)
_BAD_HEADER: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "bad_header",
    "a header name or value is not valid HTTP",
)
_UNSUPPORTED_ENCODING: Refusal = (
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
    "unsupported_content_encoding",
    "the body's Content-Encoding is not one this server decodes (gzip, deflate, identity)",
)
_BAD_ENCODED_BODY: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "invalid_content_encoding",
    "the body is not valid data of the Content-Encoding it names",
)
_BAD_FRAMING: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "bad_body_framing",
    "the request body's framing (Content-Length or Transfer-Encoding) is not valid",
)
_MALFORMED: Refusal = (
    HTTPStatus.BAD_REQUEST,
    "malformed_request",
    "the request is not valid HTTP/1.1 (its framing cannot be trusted)",
)
_REFUSALS: tuple[tuple[type[BaseException], Refusal], ...] = (
    (http_exceptions.LineTooLong, _HEADER_TOO_LARGE),
    (http_exceptions.BadHttpMethod, _BAD_METHOD),
    (http_exceptions.InvalidURLError, _BAD_TARGET),
    (http_exceptions.InvalidHeader, _BAD_HEADER),
    (http_exceptions.ContentEncodingError, _UNSUPPORTED_ENCODING),
    (http_exceptions.PayloadEncodingError, _BAD_FRAMING),
)
# aiohttp's C parser (llhttp) raises a plain ``BadHttpMessage`` for most of what it refuses,
# framing and header errors alike; llhttp's reason, the message's first line, is all that tells
# them apart ("Content-Length can't be present with Transfer-Encoding", "Invalid character in
# chunk size", "Invalid header value char"). aiohttp's pure-Python parser raises the classes
# above for most of these, and the same words for the rest.
_FRAMING_WORDS = ("content-length", "transfer-encoding", "chunk")


def refusal(exc: BaseException | None) -> Refusal:
    """The status, code and message for a request aiohttp's parser refused with ``exc``."""
    if isinstance(exc, http_exceptions.ContentEncodingError) and _decodes_badly(exc):
        return _BAD_ENCODED_BODY
    for kind, answer in _REFUSALS:
        if isinstance(exc, kind):
            return answer
    if isinstance(exc, http_exceptions.BadHttpMessage):
        reason = exc.message.partition(":\n")[0].lower()  # llhttp's words, not the bytes sent
        if reason.startswith(("too many headers", "too many trailers")):  # aiohttp's count
            return _TOO_MANY_HEADERS
        if any(word in reason for word in _FRAMING_WORDS):
            return _BAD_FRAMING
        if reason.startswith("invalid header"):
            return _BAD_HEADER
    return _MALFORMED


def _decodes_badly(exc: http_exceptions.ContentEncodingError) -> bool:
    """Whether ``exc`` says the body is not in a coding aiohttp decodes (gzip, deflate), as
    its ``Content-Encoding`` claims, rather than that the coding is one it does not decode
    (``br``, ``zstd``). A deflate body that ends before its stream does is said once the
    whole body has come, as the request's refusal: "deflate" and nothing more."""
    words = exc.message.strip().lower()
    return words in ("gzip", "deflate") or words.endswith((": gzip", ": deflate"))


def target_too_long(exc: BaseException | None, head: bytes | bytearray) -> bool:
    """Whether ``exc``, the parser's ``LineTooLong``, is about the request target of the
    request whose first bytes are ``head`` (a ``414``), not a header field (a ``431``): the
    request line does not end within them, and the line the parser shows begins as the
    target (llhttp's) or the request line (aiohttp's own parser's) does."""
    if not isinstance(exc, http_exceptions.LineTooLong) or not exc.args:
        return False
    line, ended, _ = head.lstrip(b"\r\n").partition(b"\r\n")
    parts = line.split(b" ", 2)
    if ended or len(parts) < 2:
        return False
    shown = exc.args[0]
    shown = shown.encode("latin-1") if isinstance(shown, str) else bytes(shown)
    shown = shown.removesuffix(b"...")[:64]
    return bool(shown) and (parts[1].startswith(shown) or line.startswith(shown))


# The HTTP versions this server answers in (any other request is refused, in HTTP/1.0).
_SPOKEN = (HttpVersion10, HttpVersion11)

# How much of a request's first bytes is kept to read its path from: enough for every route's
# path after a method (a longer target is cut, which a match on the path's start does not mind).
_HEAD_BYTES = 256


def target_path(head: bytes | bytearray) -> str:
    """The path of the request whose first bytes are ``head``; "" when they show none."""
    line = head.lstrip(b"\r\n").partition(b"\r\n")[0]
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[1].startswith(b"/"):
        return ""
    return parts[1].partition(b"?")[0].decode("latin-1")


def _encoded(request: web.BaseRequest) -> bool:
    """Whether the request's body is compressed (aiohttp decodes it as it arrives)."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    return coding not in ("", "identity")


def _upgrade_served(message: RawRequestMessage) -> bool:
    """Whether aiohttp's parser keeps the bytes after ``message``, an upgrade request: a
    WebSocket's (its frames, or the next request when a route declines it) or a CONNECT's."""
    return message.method == "CONNECT" or message.headers.get("Upgrade", "").lower() == "websocket"


class HeaderDeadlines:
    """The header deadlines of one listening site, swept by one timer.

    Every deadline is ``timeout`` after it was set, so they fall due in the order they were
    set: a deque, and one timer for the oldest. A connection's entry is stale once it set a
    newer deadline or its headers arrived (its ``header_deadline`` no longer matches)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._due: collections.deque[tuple[float, Connection]] = collections.deque()
        # Put off once if this process itself stood still: headers sent meanwhile are read
        # before they are judged late (``stalls.Deadline``).
        self._timer: Deadline | None = None

    def arm(self, connection: Connection) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        connection.header_deadline = deadline
        self._due.append((deadline, connection))
        if self._timer is None:
            self._timer = Deadline(loop, deadline, self._sweep)

    def _sweep(self) -> None:
        """Close the connections whose headers are overdue."""
        self._timer = None
        loop = asyncio.get_running_loop()
        due, now = self._due, loop.time()
        while due and due[0][0] <= now:
            deadline, connection = due.popleft()
            if connection.header_deadline == deadline:
                connection.header_deadline = None
                transport = connection.transport
                if transport is not None and not transport.is_closing():
                    log.info("closed a connection whose request headers took too long")
                    transport.close()
        if due:
            self._timer = Deadline(loop, due[0][0], self._sweep)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, connection in self._due:
            connection.header_deadline = None
        self._due.clear()


class Connection(RequestHandler):
    """aiohttp's connection protocol with a header deadline per request and parser
    refusals in the API's error shape."""

    __slots__ = (
        "_body",
        "_deadlines",
        "_head",
        "_refused_head",
        "_refused_path",
        "header_deadline",
    )

    def __init__(self, manager: web.Server, *, deadlines: HeaderDeadlines, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._deadlines = deadlines
        self.header_deadline: float | None = None  # set while a request's headers are due
        # The first bytes of the request whose head is arriving (None: no head is, or where
        # it began is unknown); the body of the last request whose head was parsed; the path
        # of the request the parser refused ("": unknown).
        self._head: bytearray | None = None
        self._body: StreamReader | None = None
        self._refused_path = ""
        self._refused_head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._deadlines.arm(self)

    def _process_keepalive(self) -> None:
        """aiohttp's idle timeout, unless it fired long past its time: this process did not
        run meanwhile (stopped, frozen), and the request the client sent then is still
        unread; closed now, it would be lost. Looked at again once the loop has read it."""
        loop = self._loop
        if fired_late(self._next_keepalive_close_time, loop.time()):
            self._keepalive_handle = loop.call_later(LOOK_AGAIN_S, super()._process_keepalive)
            return
        super()._process_keepalive()

    def data_received(self, data: bytes) -> None:
        # Between requests, the first byte of the next one starts its header deadline. Bytes
        # of a body still arriving are not one: read after aiohttp took its request from the
        # queue but before its handler began (a body in two reads), they would arm a deadline
        # no head clears, and the connection would be closed mid-reply.
        between = not self._upgraded and (self._body is None or self._body.is_eof())
        if (
            self.header_deadline is None
            and data
            and between
            and not self._request_in_progress
            and not self._messages
        ):
            self._deadlines.arm(self)
            # No longer idle: the header deadline bounds the request from here on, not
            # what was left of the idle timeout (aiohttp's would close it mid-request).
            if self._keepalive_handle is not None:
                self._keepalive_handle.cancel()
                self._keepalive_handle = None
        head = self._head
        if head is None and between:
            # The last request has all arrived: these bytes begin the next one. (Bytes of a
            # request that began after a body, within one read, are not seen as its start.)
            head = self._head = bytearray()
        if head is not None and len(head) < _HEAD_BYTES:
            head += data[: _HEAD_BYTES - len(head)]
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            self._parsed(self._request_count - parsed)
        if self._messages or self._upgraded:
            self.header_deadline = None  # a whole request (or a refusal) has arrived

    def _parsed(self, count: int) -> None:
        """The parser ended ``count`` request heads: the last was a request or a refusal."""
        self._refuse_versions(count)
        message, body = self._messages[-1]
        head, self._head = self._head, None
        if isinstance(message, RawRequestMessage):
            self._body = body
            if message.upgrade and not _upgrade_served(message):
                # aiohttp's parser drops the bytes that follow a request asking to switch to
                # a protocol it does not switch to (``Upgrade: h2c``): a request pipelined
                # after it would never be answered. It is answered; then the connection ends,
                # which tells the client to send again what it sent after it.
                self.close()
        elif head is None and self._body is not None and not self._body.is_eof():
            self._refuse_body(self._body, message.exc)
        elif count == 1 and head is not None:  # the refused request began with ``head``
            self._refused_path = target_path(head)
            self._refused_head = bytes(head)

    def _refuse_versions(self, count: int) -> None:
        """Refuse the first of the last ``count`` requests whose version is neither HTTP/1.1
        nor HTTP/1.0 (``GET / HTTP/2.0`` in text, an HTTP/0.9 request line alone), and drop
        what follows it. aiohttp's parser takes them, and its response would repeat their
        version in its status line ("HTTP/2.0 200 OK", a status line to an HTTP/0.9 client):
        a version this server does not speak (RFC 9112, 2.3)."""
        messages = self._messages
        for index in range(max(0, len(messages) - count), len(messages)):
            message = messages[index][0]
            if isinstance(message, RawRequestMessage) and message.version not in _SPOKEN:
                exc = http_exceptions.BadHttpMessage("unsupported HTTP version")
                refused = _ErrInfo(status=400, exc=exc, message=exc.message)
                while len(messages) > index:
                    messages.pop()
                messages.append((refused, EMPTY_PAYLOAD))
                self._refused_path = message.path.partition("?")[0]
                self._head = None  # the refusal's path is known: not read from the head
                return

    def _refuse_body(self, body: StreamReader, exc: BaseException) -> None:
        """The body of the request being read broke its framing (a bad chunk in a later read
        than its head). aiohttp queues the refusal as a request of its own, after this one,
        and leaves the body waiting for bytes that will never come (its handler would wait
        for the body timeout). The refusal is this request's answer instead: its handler, if
        it reads the body, gets the error (``server.validation`` answers it in the route's
        shape), and the connection closes after its response."""
        self._messages.pop()  # the refusal aiohttp queued
        handler_may_read = self._request_in_progress or any(b is body for _, b in self._messages)
        if handler_may_read and body.exception() is None:
            error = RequestPayloadError("the request body's framing is broken")
            error.__cause__ = exc  # what broke (a reader not waiting now gets no other way)
            body.set_exception(error)
        # Nothing more of it will come: aiohttp, after a handler that left it unread, stops
        # reading it instead of waiting.
        body.feed_eof()
        self.close()  # read nothing more; close once the response is sent

    async def _handle_request(
        self,
        request: web.BaseRequest,
        start_time: float | None,
        request_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        answer = await super()._handle_request(request, start_time, request_handler)
        body = request.content
        if not answer[1] and not body.is_eof() and _encoded(request):
            await self._drain_encoded(body)
        return answer

    async def _drain_encoded(self, body: StreamReader) -> None:
        """Read the rest of a compressed body the handler left unread (a ``404``, a ``405``, a
        route that takes no body), as aiohttp would after the response, so that the
        connection may go on; a body that is not in its ``Content-Encoding`` ends it quietly.
        aiohttp's own reading would log the decoding error as an unhandled exception, with
        its traceback, for a request already answered."""
        try:
            async with asyncio.timeout(self._lingering_time):
                while not body.is_eof():
                    await body.readany()
        except TimeoutError:
            pass  # aiohttp's drain finds the body unfinished too and closes the connection
        except RequestPayloadError:
            body.feed_eof()  # nothing more of it can be read
            self.close()  # where the next request would begin is unknown

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not hand to the application, in the API's error shape."""
        if request.writer.output_size > 0:  # part of a response left: nothing may follow it
            raise ConnectionError("a response already started; closing the connection")
        if status >= 500:
            log.error(
                "request from %s failed outside the application", request.remote, exc_info=exc
            )
            path = request.path
            error = error_response(status, "internal server error", code="internal_error")
        else:
            refused = refusal(exc)
            if target_too_long(exc, self._refused_head):
                refused = _URI_TOO_LONG
            status, code, text = refused
            log.info("refused a malformed request from %s: %s", request.remote, code)
            log_refused(request.remote, status, code)
            path, error = self._refused_path, error_response(status, text, code=code)
        response = in_route_shape(path, error)
        response.force_close()
        return response


class GuardedSockSite(web.SockSite):
    """A listening site whose connections are ``Connection``s sharing one set of header
    deadlines (and, given ``unacknowledged_s``, dropped by the kernel when what they send
    goes unacknowledged that long: see ``accepting``)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: object,
        *,
        header_timeout_s: float,
        backlog: int,
        unacknowledged_s: float | None = None,
    ) -> None:
        super().__init__(runner, sock, backlog=backlog)  # type: ignore[arg-type]
        self.deadlines = HeaderDeadlines(header_timeout_s)
        self._unacknowledged_s = unacknowledged_s

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        # The arguments aiohttp's own server would make its connections with.
        options = server._kwargs  # aiohttp keeps them only here

        def connection() -> asyncio.Protocol:
            return Connection(server, loop=loop, deadlines=self.deadlines, **options)

        self._server = BatchAcceptingServer(
            loop, self._sock, connection, self._backlog, self._unacknowledged_s
        )

    async def stop(self) -> None:
        self.deadlines.close()
        await super().stop()
