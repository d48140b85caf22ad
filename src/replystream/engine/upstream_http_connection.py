"""One connection of the relay's HTTP/1.1 client, and the response read over it.

This file decides how an answer comes back: the response is parsed by ``httptools``
(llhttp) as the connection's ``data_received`` takes it off the socket; once its head is
complete the caller gets a ``Response``, and from then on each socket read's body bytes (a
``Content-Length``, chunked or close-delimited body, its framing taken off) go to the
``BodyReceiver`` set on it in that same call: no task, no queue, no extra turn of the loop
per read. A receiver that cannot take more pauses the connection's reading
(``pause_reading``), and resumes it. Bytes after a whole response (another response, or
anything) are not parsed: the response is delivered whole and its connection closed, since
it holds what nobody asked for. A body not read to its end closes its connection. A
connection whose body ended in full goes back to its ``Pool`` (``upstream_http.HttpOrigin``),
which decides whether it is kept. It must not know what the request or the body means.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Protocol, cast

import httptools

from replystream.engine.upstream_http_failures import (
    BadFraming,
    BodyCut,
    HeadTooLarge,
    NotHttp,
    PeerClosed,
    Stale,
)

# The most bytes a response head (interim responses before it included) may take: llhttp
# keeps no bound of its own, and httptools joins a header's pieces as they come.
MAX_HEAD_BYTES = 64 * 1024


class BodyReceiver(Protocol):
    """Where a response's body goes, as the connection reads it (on the event loop)."""

    def body_data(self, data: bytes) -> None:
        """Body bytes, framing removed (all of one socket read's, together)."""
        ...

    def body_end(self, failure: Exception | None) -> None:
        """The body ended: in full (None), or not (the failure)."""
        ...


class Pool(Protocol):
    """Where a connection belongs (``upstream_http.HttpOrigin``): told when it opens and when
    it is lost, and given it back once a response ended in full on it."""

    def opened(self, connection: Connection) -> None: ...

    def lost(self, connection: Connection) -> None: ...

    def give_back(self, connection: Connection) -> None: ...


class Response:
    """A response whose head arrived; its body goes to the receiver set on it."""

    __slots__ = (
        "_connection",
        "content_encoding",
        "content_type",
        "location",
        "retry_after",
        "status",
    )

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
        self.location = ""  # its Location header as sent ("" if none): where a 3xx points

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

    async def read_whole(self, limit: int) -> bytes | None:
        """The whole body, or None when it runs past ``limit`` bytes (the rest is not read).
        A body read whole leaves its connection to be used again.

        Raises:
            BodyCut, OSError: the body did not end in full.
        """
        collected = _Collected(limit + 1, asyncio.get_running_loop().create_future())
        self.set_receiver(collected)
        whole = False
        try:
            body = await collected.done
            if collected.failure is not None:
                raise collected.failure
            whole = len(body) <= limit
            return body if whole else None
        finally:
            if whole:
                self.release(0.0)
            else:
                self.close()


class _Collected:
    """A receiver that keeps the first ``limit`` bytes of a body (an error body), and what
    cut it short, if something did before then."""

    def __init__(self, limit: int, done: asyncio.Future[bytes]) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self.done = done
        self.failure: Exception | None = None

    def body_data(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._limit:
            self.body_end(None)

    def body_end(self, failure: Exception | None) -> None:
        if not self.done.done():
            self.failure = failure
            self.done.set_result(b"".join(self._parts)[: self._limit])


class Connection(asyncio.Protocol):
    """One connection to the origin: one request and its response at a time."""

    def __init__(self, origin: Pool) -> None:
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
        self._transfer_coding = b""  # a transfer coding besides chunked (gzip...), if any
        self._location = b""
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
        self.idle_since = 0.0  # when it went back to its pool (time.monotonic())

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio's, so no isinstance).
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._origin.opened(self)

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
                    # A TLS record's first byte (an alert's, a handshake's) where a status
                    # line should begin: plain HTTP was sent to a TLS port.
                    # An HTTP/2 frame (SETTINGS, GOAWAY: on stream 0) is an h2-only server's.
                    h2 = len(data) >= 9 and data[3] in (0x04, 0x07) and data[5:9] == bytes(4)
                    tls = data[:1] in (b"\x15", b"\x16")
                    self._broken(NotHttp("not HTTP", tls=tls, h2=h2))
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
        self._origin.lost(self)
        if self._releasing is not None:
            self._releasing.cancel()
            self._releasing = None
        head = self._head
        if head is not None and not head.done():
            if not self._got_bytes and self._requests > 1:
                head.set_exception(Stale("closed"))
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
        elif name == b"location":
            self._location = value
        elif name == b"transfer-encoding":
            codings = [coding.strip() for coding in value.lower().split(b",")]
            if b"chunked" in codings:
                self._framed = True
            # One besides chunked compresses the body as a Content-Encoding would.
            other = [coding for coding in codings if coding not in (b"", b"chunked", b"identity")]
            if other:
                self._transfer_coding = other[0]
        elif name == b"content-length":
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
        if not encoding or encoding == b"identity":
            encoding = self._transfer_coding
        if encoding and encoding != b"identity":
            response.content_encoding = encoding.decode("latin-1")
        if self._location:
            response.location = self._location.decode("latin-1")
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
            self._content_type = self._retry_after = self._content_encoding = self._location = b""
            self._transfer_coding = b""
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
        self._content_type = self._retry_after = self._content_encoding = self._location = b""
        self._transfer_coding = b""
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
            if self._transport.get_write_buffer_size():
                # Part of a request given up on is still unsent (an upstream gone dark
                # acknowledges nothing): a close would wait to send it, holding the socket
                # and the request until the kernel gives up, a quarter of an hour later,
                # and deliver it, for nobody, if the network healed meanwhile.
                self._transport.abort()
            else:
                self._transport.close()
        self._origin.lost(self)

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
        self._origin.give_back(self)
