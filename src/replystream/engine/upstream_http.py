"""The relay's HTTP/1.1 client: one upstream origin, a keep-alive pool, a body pushed as read.

This file decides how a relayed request goes over the wire and how its answer comes back.
A request is one ``transport.write`` (head and body, bytes built here). The response is
parsed by ``httptools`` (llhttp) as the connection's ``data_received`` takes it off the
socket; once its head is complete the caller gets a ``Response``, and from then on each
socket read's body bytes (a ``Content-Length``, chunked or close-delimited body, its framing
taken off) go to the ``BodyReceiver`` set on it in that same call: no task, no queue, no
extra turn of the loop per read. A receiver that cannot take more pauses the connection's
reading (``pause_reading``), and resumes it.

Connections are kept per origin and reused (last in, first out) once a reply's body ended
in full on a connection the upstream keeps alive; at most ``MAX_IDLE`` are kept idle. Bytes
after a whole response (another response, or anything) are not parsed: the response is
delivered whole and its connection closed, since it holds what nobody asked for. One
the upstream closed while idle leaves the pool; a request on a reused connection that fails
before any byte of the answer (the upstream closed it as the request went) is sent once more
on a new connection, as browsers and other clients do. A body not read to its end (a reply
cancelled, or failed) closes its connection: that is how a model server learns to abort.

Failures are exceptions of this file (``PeerClosed``, ``NotHttp``, ``BodyCut``,
``BadFraming``, ``ConnectFailed``), ``OSError`` and ``ssl.SSLError``; ``upstream_errors``
names them in our words. It must not know what the request or the body means.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

MAX_IDLE = 1024  # idle keep-alive connections kept per origin (a burst of replies reuses them)
# The most bytes a response head (interim responses before it included) may take: llhttp
# keeps no bound of its own, and httptools joins a header's pieces as they come.
MAX_HEAD_BYTES = 64 * 1024


class HttpFailure(Exception):
    """A failure this client names itself."""


class ConnectFailed(HttpFailure):
    """The connection could not be made (refused, unreachable, unresolvable)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class PeerClosed(HttpFailure):
    """The upstream closed the connection before a complete response head."""


class NotHttp(HttpFailure):
    """What came back is not an HTTP/1.x response head."""


class HeadTooLarge(HttpFailure):
    """The response head grew past ``MAX_HEAD_BYTES`` (ended or not)."""


class BodyCut(HttpFailure):
    """The connection ended before the body's framing says the body ends."""


class BadFraming(HttpFailure):
    """The body's framing is broken (a bad chunk size line...), or bytes followed its end."""


class _Stale(HttpFailure):
    """A reused connection closed before any byte of the answer: send again, once."""


class BodyReceiver(Protocol):
    """Where a response's body goes, as the connection reads it (on the event loop)."""

    def body_data(self, data: bytes) -> None:
        """Body bytes, framing removed (all of one socket read's, together)."""
        ...

    def body_end(self, failure: Exception | None) -> None:
        """The body ended: in full (None), or not (the failure)."""
        ...


class Origin:
    """Scheme, host and port of an upstream, and the path its URL starts with."""

    __slots__ = ("host", "host_header", "path", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        default = 443 if self.tls else 80
        self.port = parts.port or default
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self.path = parts.path.rstrip("/")


def _header_lines(headers: Mapping[str, str]) -> str:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\0" in value:
            raise ValueError(f"the {name} header has a line break in it")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


async def _answer(head: asyncio.Future[Response]) -> Response:
    """The response ``head`` brings; closed if the wait is cancelled after it came (in the
    same turn of the loop, before the waiter ran again), since nobody will read it."""
    try:
        return await head
    except asyncio.CancelledError:
        if head.done() and not head.cancelled() and head.exception() is None:
            head.result().close()
        raise


class HttpOrigin:
    """The connections to one upstream origin, and the requests sent over them."""

    def __init__(self, url: str, *, max_idle: int = MAX_IDLE) -> None:
        self.origin = Origin(url)
        self._max_idle = max_idle
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._retired = False  # out of the routes: no connection is kept for another request
        self.connections_made = 0  # for /metrics-free checks: connections opened so far

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """``POST`` ``body`` (JSON) to the origin's ``path``; the response once its head is
        complete. Cancelling the wait closes the connection."""
        origin = self.origin
        request = (
            f"POST {origin.path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{_header_lines(headers)}\r\n"
        ).encode("latin-1") + body
        connection = self._take_idle()
        if connection is not None:
            try:
                return await _answer(connection.send(request))
            except _Stale:
                pass  # it was closed as the request went: a new connection, once
        connection = await self._connect()
        try:
            return await _answer(connection.send(request))
        except _Stale:  # not reused, so not stale: the upstream closed it
            raise PeerClosed("closed before answering") from None

    def _take_idle(self) -> Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.close()
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        origin = self.origin
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            _, connection = await loop.create_connection(
                lambda: Connection(self),
                origin.host,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls is not None else None,
            )
        except ssl.SSLError:
            raise
        except OSError as exc:
            raise ConnectFailed(exc) from None
        self.connections_made += 1
        return connection

    def _opened(self, connection: Connection) -> None:
        self._open.add(connection)

    def _lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)

    def _give_back(self, connection: Connection) -> None:
        if self._retired or len(self._idle) >= self._max_idle:
            connection.close()
        else:
            self._idle.append(connection)

    @property
    def idle(self) -> int:
        """Idle keep-alive connections in the pool."""
        return len(self._idle)

    @property
    def in_use(self) -> bool:
        """Whether some connection is open (a response under way, or idle)."""
        return bool(self._open)

    def retire(self) -> None:
        """No more requests go here: close the idle connections, and each one in use once
        its response is over (the replies under way go on)."""
        self._retired = True
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        """Close every connection (idle or in use)."""
        self._idle.clear()
        for connection in list(self._open):
            connection.close()


class Response:
    """A response whose head arrived; its body goes to the receiver set on it."""

    __slots__ = ("_connection", "content_encoding", "content_type", "retry_after", "status")

    def __init__(
        self, connection: Connection, status: int, content_type: str, retry_after: str
    ) -> None:
        self._connection = connection
        self.status = status
        self.content_type = content_type  # the media type alone, lower case ("" if none)
        self.retry_after = retry_after  # its Retry-After header as sent ("" if none)
        # Its Content-Encoding, lower case ("" if none): compression is refused upstream,
        # and a compressed body is no event stream to parse.
        self.content_encoding = ""

    def set_receiver(self, receiver: BodyReceiver) -> None:
        """Body bytes go to ``receiver`` from now on; what came before, at once."""
        self._connection.set_receiver(self, receiver)

    def pause_reading(self) -> None:
        self._connection.pause(self)

    def resume_reading(self) -> None:
        self._connection.resume(self)

    @property
    def reading(self) -> bool:
        """Whether the connection's transport is reading (not paused by the receiver)."""
        return self._connection.reading()

    def release(self, wait_s: float) -> None:
        """Done with the body: the connection goes back to the pool once the body has
        ended (now, or within ``wait_s``; else it is closed)."""
        self._connection.release(self, wait_s)

    def close(self) -> None:
        """Done with the body, not read to its end: close the connection."""
        self._connection.close_for(self)

    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (the rest is not read); closes the connection."""
        collected = _Collected(limit, asyncio.get_running_loop().create_future())
        self.set_receiver(collected)
        try:
            return await collected.done
        finally:
            self.close()


class _Collected:
    """A receiver that keeps the first ``limit`` bytes of a body (an error body)."""

    def __init__(self, limit: int, done: asyncio.Future[bytes]) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self.done = done

    def body_data(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._limit:
            self.body_end(None)

    def body_end(self, failure: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(b"".join(self._parts)[: self._limit])


class Connection(asyncio.Protocol):
    """One connection to the origin: one request and its response at a time."""

    def __init__(self, origin: HttpOrigin) -> None:
        self._origin = origin
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None  # the current one, once its head came
        self._receiver: BodyReceiver | None = None
        self._early: list[bytes] = []  # body bytes before a receiver was set
        self._parts: list[bytes] = []  # body bytes of the socket read being parsed
        self._content_type = b""
        self._retry_after = b""
        self._content_encoding = b""
        self._framed = False  # the body has a Content-Length or is chunked
        self._interim = False  # the head being read is an interim (1xx) response's
        self._complete = False  # the current response's body ended in full
        self._keep_alive = False  # ... on a connection the upstream keeps open
        self._told_end = False
        self._failure: Exception | None = None  # the body's, kept until a receiver is set
        self._got_bytes = False
        self._head_bytes = 0  # of the reads that ended inside the response head
        self._head_lines = 0  # bytes of its status and header lines, parsed
        self._requests = 0
        self._releasing: asyncio.TimerHandle | None = None
        self._closed = False
        self.paused = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio's, so no isinstance).
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._origin._opened(self)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes while idle: nothing an upstream may send; not reusable
            self.close()
            return
        self._got_bytes = True
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            # (A ``101 Switching Protocols``, whole at its head, raises the latter, which is
            # no parse error: it must not escape into the event loop.)
            if not self._complete:
                self._parts.clear()
                ours = error.__context__  # what a callback here raised, if one did
                if isinstance(ours, HeadTooLarge):
                    self._broken(ours)
                elif self._response is None:
                    self._broken(NotHttp("not HTTP"))
                else:
                    self._broken(BadFraming("bad"))
                return
            # The response is whole, and bytes nobody asked for came after it (the parse
            # stopped there: ``on_message_begin``): it is delivered, and the connection,
            # which may hold more of them, is not used again.
            self._keep_alive = False
        if self._response is None:  # every byte so far is the head's (or an interim's)
            # Counted as read, since a head that never ends is never parsed into lines.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._broken(HeadTooLarge(f"a head past {MAX_HEAD_BYTES} bytes"))
                return
        parts = self._parts
        if parts:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            receiver = self._receiver
            if receiver is not None:
                receiver.body_data(body)
            elif self._response is not None:
                self._early.append(body)
        if self._complete and not self._told_end:
            self._ended(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._origin._lost(self)
        if self._releasing is not None:
            self._releasing.cancel()
            self._releasing = None
        head = self._head
        if head is not None and not head.done():
            if not self._got_bytes and self._requests > 1:
                head.set_exception(_Stale("closed"))
            elif exc is None or isinstance(exc, ConnectionResetError):
                head.set_exception(PeerClosed("closed before answering"))
            else:
                head.set_exception(exc)
            return
        if self._response is None or self._told_end:
            return
        if exc is None and not self._framed:
            self._complete = True  # a close-delimited body ends with its connection
            self._ended(None)
        elif exc is None or isinstance(exc, ConnectionResetError):
            self._ended(BodyCut("closed mid-body"))
        else:
            self._ended(exc if isinstance(exc, OSError) else BodyCut(str(exc)))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            # Another response (or anything) after the whole one: parsed no further, lest its
            # head replace the response being delivered. Raised out of ``feed_data``.
            raise BadFraming("bytes after the response")

    def on_status(self, reason: bytes) -> None:
        self._head_lines += len(reason) + 15  # with "HTTP/1.1 200 " and CRLF

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += len(name) + len(value) + 4  # with ": " and CRLF
        name = name.lower()
        if name == b"content-type":
            self._content_type = value
        elif name == b"retry-after":  # an upstream's back-off, which a 429 or 503 may carry
            self._retry_after = value
        elif name == b"content-encoding":
            self._content_encoding = value
        elif name == b"content-length" or (
            name == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        if self._head_lines > MAX_HEAD_BYTES:  # one that ended in a read is not counted as read
            raise HeadTooLarge(f"a head past {MAX_HEAD_BYTES} bytes")
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim response (``100 Continue``, ``103 Early Hints``): no body, and the
            # real response follows on the same connection. Its headers are forgotten.
            self._interim = True
            return
        media = self._content_type.split(b";", 1)[0].strip().lower()
        response = Response(
            self, status, media.decode("latin-1"), self._retry_after.decode("latin-1")
        )
        encoding = self._content_encoding.strip().lower()
        if encoding and encoding != b"identity":
            response.content_encoding = encoding.decode("latin-1")
        self._response = response
        if parser.should_upgrade():
            self._framed = True
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._content_type = self._retry_after = self._content_encoding = b""
            self._framed = False
            return
        parser = self._parser
        # Asked now: llhttp forgets once the message is over.
        self._keep_alive = parser is not None and parser.should_keep_alive()
        self._complete = True

    # -- Used by HttpOrigin and Response ----------------------------------------------------

    def reading(self) -> bool:
        transport = self._transport
        return transport is not None and transport.is_reading()

    def usable(self) -> bool:
        transport = self._transport
        return not self._closed and transport is not None and not transport.is_closing()

    def send(self, request: bytes) -> asyncio.Future[Response]:
        transport = self._transport
        assert transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._response = self._receiver = None
        self._content_type = self._retry_after = self._content_encoding = b""
        self._framed = self._complete = self._told_end = self._got_bytes = False
        self._head_bytes = self._head_lines = 0
        self._keep_alive = self._interim = False
        self._failure = None
        self._early = []
        self._requests += 1
        head = self._head = asyncio.get_running_loop().create_future()
        transport.write(request)
        return self._waited(head)

    def _waited(self, head: asyncio.Future[Response]) -> asyncio.Future[Response]:
        """``head``, closing the connection if the waiter gives up (cancelled, timed out)."""

        def settled(future: asyncio.Future[Response]) -> None:
            if future.cancelled():
                self.close()

        head.add_done_callback(settled)
        return head

    def set_receiver(self, response: Response, receiver: BodyReceiver) -> None:
        if response is not self._response:
            return
        self._receiver = receiver
        early, self._early = self._early, []
        if early:
            receiver.body_data(b"".join(early))
        if self._receiver is receiver and (self._complete or self._failure is not None):
            if not self._told_end:
                self._ended(self._failure)

    def pause(self, response: Response) -> None:
        if response is self._response and not self.paused and self._transport is not None:
            self.paused = True
            self._transport.pause_reading()

    def resume(self, response: Response) -> None:
        if response is self._response:
            self._resume()

    def _resume(self) -> None:
        if self.paused and self._transport is not None:
            self.paused = False
            if not self._transport.is_closing():
                self._transport.resume_reading()

    def release(self, response: Response, wait_s: float) -> None:
        if response is not self._response:
            return
        self._receiver = None
        self._early = []
        self._resume()  # a paused connection would not see the body's end (or its close)
        if self._complete:
            self._to_pool()
        elif not self._closed:
            self._releasing = asyncio.get_running_loop().call_later(wait_s, self.close)

    def close_for(self, response: Response) -> None:
        if response is self._response:
            self._receiver = None
            self.close()

    def close(self) -> None:
        self._receiver = None
        if self._releasing is not None:
            self._releasing.cancel()
            self._releasing = None
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()
        self._origin._lost(self)

    def _ended(self, failure: Exception | None) -> None:
        """The current body ended (``failure`` None: in full)."""
        receiver = self._receiver
        if receiver is None:
            self._failure = failure
            if self._response is not None and self._releasing is not None:
                # released while its body's last bytes were on their way: they came
                self._releasing.cancel()
                self._releasing = None
                if failure is None:
                    self._to_pool()
                else:
                    self.close()
            return
        self._told_end = True
        receiver.body_end(failure)

    def _broken(self, failure: Exception) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(failure)
            self.close()
            return
        receiver = self._receiver
        self.close()
        if receiver is not None and not self._told_end:
            self._told_end = True
            receiver.body_end(failure)
        elif receiver is None:
            self._failure = failure

    def _to_pool(self) -> None:
        self._told_end = True
        if self._closed or not self._keep_alive:
            self.close()
            return
        self._parser = None
        self._response = self._head = None
        self._receiver = None
        self._origin._give_back(self)
