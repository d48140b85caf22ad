"""The measuring client's HTTP/1.1 transport: one request per connection, timed at arrival.

``http://`` and ``https://`` URLs: over TLS the server's certificate is verified against the
system's CAs (or a CA file, ``tls_context``) for the URL's host, which is also sent as SNI,
unless the caller asked for an unverified context; ALPN offers ``http/1.1`` only, the one
protocol spoken here.

Each body chunk is stamped with ``perf_counter()`` inside ``data_received``, the moment the
event loop hands the bytes over, not when a consumer task next runs; that keeps timings honest
when many replies are read at once. HTTP framing (status line, headers, chunked coding) is
parsed by h11, a sans-IO HTTP/1.1 library; content encodings are undone here so a compressed
event stream is still readable (and visible, through the ``content-encoding`` header).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import h11

# The content codings undone here (x-gzip is gzip's old name, RFC 9110 section 8.4.1.3); the
# decoder tells gzip from zlib-wrapped deflate by the header.
DECODED_ENCODINGS = frozenset({"gzip", "x-gzip", "deflate"})
# The most a body may hold, counted after its coding is undone, unless a reader says
# otherwise: a bound against a server that sends without end, and against a small compressed
# body that inflates without end (a gzip "bomb": 10 MB of gzip holds 10 GB of zeros). Far
# above a reply's body: the largest a server here makes (128 choices of 1,000 tokens, each
# with 20 log probabilities) is about 210 MB.
MAX_BODY_BYTES = 1 << 30
# How many body bytes a connection holds that its reader has not taken yet before it stops
# reading from the socket (the kernel's buffers fill, then the server waits), reading again
# below a quarter of that. Far above what a reader that keeps up holds, so chunks are still
# stamped as they arrive; a bound for one that falls behind a server sending faster.
HELD_BYTES = 16 << 20
# The most one step of the decoder makes: a read of compressed bytes is handed on in pieces
# of at most this size, so what a read holds in memory does not grow with how far it inflates.
DECODED_PIECE = 1 << 20


class TransportError(ConnectionError):
    """The connection failed or broke the HTTP framing before the response ended."""


class BodyTooLarge(TransportError):
    """The body passed the reader's ``max_body_size`` (bytes, after its coding is undone)."""


class ConnectError(TransportError):
    """No connection could be made, so the request never reached a server (refused, no
    route, a name that does not resolve, a TLS handshake or certificate that failed, or no
    socket left for this process). ``refused``: the host answered that nothing listens."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True, slots=True)
class Chunk:
    """Body bytes as they arrived: ``at`` is ``perf_counter()`` when the socket delivered them."""

    at: float
    data: bytes


# How much of an answer that is no HTTP response its error quotes.
_QUOTED = 32
# The longest response head (or chunk line, or trailer section) read, as a browser's bound
# (Chromium's is 256 KiB): h11's own, 16 KiB, refuses heads that servers send and browsers
# take (a long Content-Security-Policy, many cookies).
MAX_HEAD_BYTES = 256 * 1024


def _no_head(start: bytes, *, closed: bool, received: int) -> str:
    """Why no response head came: nothing at all, a head cut short or too long, or bytes that
    are none (a TLS record, first byte 0x15 or 0x16, from a server that speaks https)."""
    if not start:
        return "the server closed the connection before answering"
    if received > MAX_HEAD_BYTES and start.startswith(b"HTTP/"):
        return f"the answer's head is longer than {MAX_HEAD_BYTES} bytes, the most read"
    if closed and start.startswith(b"HTTP/"):
        return f"the server closed the connection within its answer's head, begun {start!r}"
    tls = " (a TLS record: the server speaks https)" if start[:1] in (b"\x15", b"\x16") else ""
    return f"the answer is not an HTTP/1.1 response: it begins {start!r}{tls}"


class _ResponseProtocol(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        # Made once a request is written (``response_head``): an unused connection that
        # closes or fails leaves no future whose exception nobody reads.
        self._head: asyncio.Future[h11.Response] | None = None
        self._head_event: h11.Response | None = None
        self._before_head = b""  # the answer's first bytes while its head is incomplete
        self._received = 0  # bytes received, counted while the head is incomplete
        self.head_at = 0.0
        self.chunks: deque[Chunk] = deque()
        self._held = 0  # bytes in ``chunks``
        self._paused = False  # reading stopped: ``chunks`` holds more than ``HELD_BYTES``
        self.ended = False
        self.error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._receive(data, time.perf_counter())

    def eof_received(self) -> bool | None:
        self._receive(b"", time.perf_counter())
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended and self.error is None:
            self._fail(TransportError(f"connection lost before the response ended: {exc}"))

    def _receive(self, data: bytes, at: float) -> None:
        if self._head_event is None:
            self._received += len(data)
            if len(self._before_head) < _QUOTED:
                self._before_head += data[: _QUOTED - len(self._before_head)]
        try:
            self.conn.receive_data(data)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.Response):
                    self.head_at = at
                    self._head_event = event
                    # Not when its waiter was cancelled (Ctrl-C, a timeout) and so the future
                    # with it, and the head came in before the connection was closed.
                    if self._head is not None and not self._head.done():
                        self._head.set_result(event)
                elif isinstance(event, h11.Data):
                    self.chunks.append(Chunk(at, bytes(event.data)))
                    self._held += len(event.data)
                    if self._held > HELD_BYTES and not self._paused and self.transport:
                        self.transport.pause_reading()
                        self._paused = True
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    self.ended = True
                    break
        except h11.RemoteProtocolError as exc:
            # h11 words a failure before the head as its own state's ("illegal request line"
            # for bytes that are no status line): said here in terms of the answer.
            if self._head_event is None:
                said = _no_head(self._before_head, closed=not data, received=self._received)
                self._fail(TransportError(said))
            else:
                self._fail(TransportError(f"response broke HTTP/1.1 framing: {exc}"))
            return
        self._wake()

    def _fail(self, error: TransportError) -> None:
        self.error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def response_head(self) -> asyncio.Future[h11.Response]:
        """The response's head, for the request just written: done at once when it already
        came, or when the connection failed before."""
        if self._head is None:
            self._head = self._loop.create_future()
            if self._head_event is not None:
                self._head.set_result(self._head_event)
            elif self.error is not None:
                self._head.set_exception(self.error)
        return self._head

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_chunk(self) -> Chunk | None:
        while not self.chunks:
            if self.ended:
                return None
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            await self._waiter
        chunk = self.chunks.popleft()
        self._held -= len(chunk.data)
        if self._paused and self._held <= HELD_BYTES // 4 and self.transport:
            self.transport.resume_reading()
            self._paused = False
        return chunk


class _Decoder:
    """Undoes a gzip or deflate body in pieces of at most ``DECODED_PIECE`` bytes."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS | 32)
        self._after_end = b""  # the first bytes after a gzip member's end, while fewer than 2
        self._trailing = False  # what follows the body's end is no gzip member: dropped

    def pieces(self, data: bytes) -> Iterator[bytes]:
        """The decoded bytes that ``data``, the body's next bytes, completes.

        Raises:
            TransportError: the body is not the coding it claims.
        """
        while data and not self._trailing:
            if self._zlib.eof:
                data = self._next_member(data)
                continue
            try:
                piece = self._zlib.decompress(data, DECODED_PIECE)
            except zlib.error as exc:
                claimed = self.encoding
                raise TransportError(f"the body is not the {claimed} it claims: {exc}") from None
            if piece:
                yield piece
            if self._zlib.eof:
                data = self._zlib.unused_data
            elif len(piece) == DECODED_PIECE:
                data = self._zlib.unconsumed_tail
                if not data:  # every byte taken, and output may still wait in the decoder
                    while piece := self._zlib.decompress(b"", DECODED_PIECE):
                        yield piece
            else:
                data = b""

    def _next_member(self, data: bytes) -> bytes:
        """After the end of a gzip member, ``data`` begins the next: a gzip body may hold
        several, one after the other (RFC 1952 section 2.2). Anything else after it is
        dropped, as other clients do. Returns the bytes to decode."""
        seen = self._after_end + data
        if self.encoding == "deflate" or not b"\x1f\x8b".startswith(seen[:2]):
            self._trailing = True
            return b""
        if len(seen) < 2:  # a read may end within the next member's magic number
            self._after_end = seen
            return b""
        self._after_end = b""
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS | 16)
        return seen


class HTTPResponse:
    """A response being read: status and headers at once, then the body chunk by chunk.

    ``max_body_size``: the most the body may hold, in bytes after its coding is undone; past
    it, reading fails with ``BodyTooLarge``."""

    def __init__(
        self, protocol: _ResponseProtocol, head: h11.Response, max_body_size: int = MAX_BODY_BYTES
    ) -> None:
        self._protocol = protocol
        self.status = head.status_code
        self.head_at = protocol.head_at
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        self._encoding = self.headers.get("content-encoding", "identity").strip().lower()
        self._decoder = _Decoder(self._encoding) if self._encoding in DECODED_ENCODINGS else None
        self._max_body_size = max_body_size
        self.body_bytes = 0  # read so far, after decoding

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while (chunk := await self._protocol.next_chunk()) is not None:
            if self._decoder is None and self._encoding not in ("identity", ""):
                # Read as it is, a br (or any other) body is garbage to every parser after.
                raise TransportError(
                    f"the body is in the {self._encoding} encoding, which this client does "
                    "not decode (it asks for gzip or deflate)"
                )
            if self._decoder is None:
                yield self._counted(chunk)
                continue
            for piece in self._decoder.pieces(chunk.data):
                yield self._counted(Chunk(chunk.at, piece))

    def _counted(self, chunk: Chunk) -> Chunk:
        self.body_bytes += len(chunk.data)
        if self.body_bytes > self._max_body_size:
            coded = (
                "" if self._decoder is None else f", counted once its {self._encoding} is undone"
            )
            raise BodyTooLarge(
                f"the body is larger than max_body_size={self._max_body_size} bytes{coded}"
            )
        return chunk


class Connection:
    """An open connection to one server, ready to carry one request.

    One: the request asks the server to close the connection after its answer (each reply
    is timed on a connection of its own, whatever came before on it), and the connection is
    closed once the answer is read or left. A second request on it is refused with
    ``ValueError``; open another with ``connect``."""

    def __init__(self, url: str, transport: asyncio.Transport, protocol: _ResponseProtocol):
        self.netloc = urlsplit(url).netloc
        self.transport = transport
        self.protocol = protocol
        self.used = False  # a request was sent on it (or tried)

    def close(self) -> None:
        self.transport.close()


def tls_context(cafile: Path | None = None, *, verify: bool = True) -> ssl.SSLContext:
    """A client TLS context: the system's CAs, or ``cafile``'s (PEM), checking the host name;
    ``verify=False`` checks nothing (a self-signed test server, on purpose)."""
    context = ssl.create_default_context(cafile=None if cafile is None else str(cafile))
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context


@functools.cache
def _default_tls() -> ssl.SSLContext:
    # Loading the system's CAs takes milliseconds: once per process, not per request.
    return tls_context()


async def connect(url: str, tls: ssl.SSLContext | None = None) -> Connection:
    """Open a TCP connection to the server of ``url``, with TLS for ``https://`` (``tls``:
    the context to use, else one that verifies against the system's CAs).

    Raises:
        ConnectError: the connection could not be made (a TLS handshake or a certificate
        that failed verification among the reasons).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"want an http:// or https:// URL, got {url!r}")
    if "@" in parts.netloc:
        # They would be sent nowhere (no Basic auth here): refused rather than dropped.
        raise ValueError("credentials in the URL are not sent; give an Authorization header")
    secure = parts.scheme == "https"
    # A link-local IPv6 address's zone is written %25eth0 in a URL (RFC 6874): %eth0 for the
    # resolver.
    host = parts.hostname.replace("%25", "%", 1) if "[" in parts.netloc else parts.hostname
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_connection(
            lambda: _ResponseProtocol(loop),
            host,
            (443 if secure else 80) if parts.port is None else parts.port,
            # The host is sent as SNI and checked against the certificate (asyncio's default
            # server_hostname when ssl is given).
            ssl=(tls or _default_tls()) if secure else None,
        )
    except OSError as exc:  # ssl.SSLError and certificate failures are OSErrors too
        refused = isinstance(exc, ConnectionRefusedError)
        raise ConnectError(f"cannot connect to {parts.netloc}: {exc}", refused=refused) from exc
    return Connection(url, transport, protocol)


# The characters a path keeps as they are, besides letters, digits and "-._~" (RFC 3986
# section 3.3: sub-delims, ":", "@", and "%" of what is encoded already).
_IN_PATH = "/%:@!$&'()*+,;="

# Request headers: a mapping, or pairs, which may name a header more than once.
Headers = Mapping[str, str] | Sequence[tuple[str, str]]


def _pairs(headers: Headers | None) -> list[tuple[str, str]]:
    if headers is None:
        return []
    return list(headers.items()) if isinstance(headers, Mapping) else list(headers)


def with_headers(defaults: Headers, given: Headers | None) -> list[tuple[str, str]]:
    """``defaults`` with ``given`` after them: a header given replaces a default of the same
    name in any case (HTTP names are case-insensitive, and a server may read either copy),
    and one given twice is sent twice."""
    extra = _pairs(given)
    named = {name.lower() for name, _ in extra}
    return [(k, v) for k, v in _pairs(defaults) if k.lower() not in named] + extra


@asynccontextmanager
async def http_request(
    url: str,
    *,
    method: str = "GET",
    body: bytes = b"",
    headers: Headers | None = None,
    connection: Connection | None = None,
    tls: ssl.SSLContext | None = None,
    max_body_size: int = MAX_BODY_BYTES,
) -> AsyncIterator[HTTPResponse]:
    """Send one request (on ``connection`` if given) and yield the response once its head
    arrived. The connection is closed on exit. ``tls``: see ``connect``; ``max_body_size``:
    see ``HTTPResponse``.

    Raises:
        TransportError: the connection failed (or was closed before the request was sent) or
            the response broke HTTP framing.
        ValueError: ``connection`` already carried a request (see ``Connection``).
    """
    if connection is not None and connection.used:
        raise ValueError(
            "this Connection already carried a request and is closed: a Connection carries "
            "one; open another with connect()"
        )
    conn = connection or await connect(url, tls)
    conn.used = True
    try:
        if conn.transport.is_closing():
            # Opened ahead of its request, the connection was let go meanwhile: a server
            # closes one that stays idle (nginx after 60 s without a request).
            raise TransportError("the connection was closed before the request was sent")
        parts = urlsplit(url)
        # A URL as a person writes it (a space, a letter past ASCII) goes percent-encoded, as
        # browsers and other clients send it; what is encoded already is sent as it is.
        target = quote(parts.path or "/", safe=_IN_PATH)
        if parts.query:
            target += "?" + quote(parts.query, safe=_IN_PATH + "?")
        # A Host of the caller's replaces ours (a name served at another address).
        fields = with_headers([("Host", conn.netloc)], headers)
        fields.insert(1, ("Connection", "close"))
        if body:
            fields.append(("Content-Length", str(len(body))))
        h11_conn = conn.protocol.conn
        # Values go as UTF-8 (h11 would take ASCII alone): a resume's Last-Event-ID is any
        # string a server sent as an event's id, and the SSE standard sends it so.
        encoded = [(name.encode(), value.encode()) for name, value in fields]
        out = h11_conn.send(h11.Request(method=method, target=target, headers=encoded))
        if body:
            out += h11_conn.send(h11.Data(data=body))
        out += h11_conn.send(h11.EndOfMessage())
        conn.transport.write(out)
        head = await conn.protocol.response_head()
        yield HTTPResponse(conn.protocol, head, max_body_size)
    finally:
        conn.close()
