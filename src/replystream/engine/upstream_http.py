"""The relay's HTTP/1.1 client: one upstream origin, a keep-alive pool, a body pushed as read.

This file decides how a relayed request goes over the wire: a request is one
``transport.write`` (head and body, bytes built here) on a connection of the origin's pool,
and the caller gets the ``Response`` once its head is complete; its body is then pushed to
the receiver set on it as the connection reads it (``upstream_http_connection``).

Connections are kept per origin and reused (last in, first out) once a reply's body ended in
full on a connection the upstream keeps alive; at most ``MAX_IDLE`` are kept idle, none for
longer than its keep-alive time (a NAT or load balancer on the way may drop an idle connection
without a word, and a request sent on it would wait for an answer never coming; one timer per
origin closes them as they expire). Bytes after a whole response (another response, or
anything) are not parsed: the response is delivered whole and its connection closed, since it
holds what nobody asked for. One the upstream closed while idle leaves the pool; a request on
a reused connection that fails before any byte of the answer (the upstream closed it as the
request went) is sent once more on a new connection, as browsers and other clients do. A body
not read to its end (a reply cancelled, or failed) closes its connection: that is how a model
server learns to abort.

One connection and the response read over it are ``upstream_http_connection``'s; the
failures (``PeerClosed``, ``NotHttp``, ``BodyCut``, ``BadFraming``, ``ConnectFailed``,
``ProxyFailed``) are ``upstream_http_failures``'s, besides ``OSError`` and ``ssl.SSLError``;
``upstream_errors`` names them in our words; a proxy is ``upstream_proxy``'s. It must not
know what the request or the body means.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from replystream.engine.upstream_http_connection import Connection, Response
from replystream.engine.upstream_http_failures import ConnectFailed, PeerClosed, Stale
from replystream.engine.upstream_proxy import (
    PROXY_TLS_HANDSHAKE_S,
    Proxy,
    connect_to,
    open_tunnel,
)

MAX_IDLE = 1024  # idle keep-alive connections kept per origin (a burst of replies reuses them)
KEEPALIVE_S = 60.0  # the longest one is kept idle (``UpstreamConfig.keepalive_s``)


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

    def __init__(
        self,
        url: str,
        *,
        max_idle: int = MAX_IDLE,
        keepalive_s: float = KEEPALIVE_S,
        tls: ssl.SSLContext | None = None,
        proxy: Proxy | None = None,
        proxy_handshake_s: float = PROXY_TLS_HANDSHAKE_S,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.origin = Origin(url)
        # Reached through a proxy: an https origin through a tunnel it opens; an http one by
        # requests to the proxy in absolute form, which carry its credentials.
        self.proxy = proxy
        self._proxy_handshake_s = proxy_handshake_s  # a TLS handshake with it, at most
        origin = self.origin
        self._target = origin.path
        self._proxy_line = ""
        if proxy is not None and not origin.tls:
            self._target = f"http://{origin.host_header}{origin.path}"
            if proxy.authorization:
                self._proxy_line = f"Proxy-Authorization: {proxy.authorization}\r\n"
        self._max_idle = max_idle
        self._keepalive_s = keepalive_s
        self._idle: list[Connection] = []  # the longest idle first
        self._sweep: asyncio.TimerHandle | None = None  # closes what expires while left alone
        self._open: set[Connection] = set()
        # An https origin's TLS: a routes file's (its CAs, a client certificate), else the
        # system's CAs, made at the first connection. New connections use what it is now.
        self.tls = tls
        self._retired = False  # out of the routes: no connection is kept for another request
        self._on_connect = on_connect  # told of each connection opened (for its count)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """``POST`` ``body`` (JSON) to the origin's ``path``; the response once its head is
        complete. Cancelling the wait closes the connection."""
        framing = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return await self._exchange(self._head("POST", path, framing, headers) + body)

    async def get(self, path: str, headers: Mapping[str, str]) -> Response:
        """``GET`` the origin's ``path`` (a health probe's); as ``post``."""
        return await self._exchange(self._head("GET", path, "", headers))

    def _head(self, method: str, path: str, framing: str, headers: Mapping[str, str]) -> bytes:
        return (
            f"{method} {self._target}{path} HTTP/1.1\r\nHost: {self.origin.host_header}\r\n"
            f"{framing}{self._proxy_line}{_header_lines(headers)}\r\n"
        ).encode("latin-1")

    async def _exchange(self, request: bytes) -> Response:
        connection = self._take_idle()
        if connection is not None:
            try:
                return await _answer(connection.send(request))
            except Stale:
                pass  # it was closed as the request went: a new connection, once
        connection = await self._connect()
        try:
            return await _answer(connection.send(request))
        except Stale:  # not reused, so not stale: the upstream closed it
            raise PeerClosed("closed before answering") from None

    def _take_idle(self) -> Connection | None:
        idle = self._idle
        self._expire(time.monotonic())
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
            if self.tls is None:
                self.tls = ssl.create_default_context()
            tls = self.tls
        proxy = self.proxy
        if proxy is not None:
            connection = Connection(self)
            if tls is None:
                await connect_to(proxy, connection, handshake_s=self._proxy_handshake_s)
            else:
                tunnel = await open_tunnel(
                    proxy, origin.host, origin.port, handshake_s=self._proxy_handshake_s
                )
                try:
                    # asyncio calls no connection_made on a protocol it starts TLS for.
                    inside = await loop.start_tls(
                        tunnel, connection, tls, server_hostname=origin.host
                    )
                except BaseException:
                    tunnel.close()
                    raise
                assert inside is not None
                connection.connection_made(inside)
            self._connected()
            return connection
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
        self._connected()
        return connection

    def _connected(self) -> None:
        if self._on_connect is not None:
            self._on_connect()

    def opened(self, connection: Connection) -> None:
        self._open.add(connection)

    def lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)

    def give_back(self, connection: Connection) -> None:
        now = time.monotonic()
        self._expire(now)
        if self._retired or len(self._idle) >= self._max_idle:
            connection.close()
            return
        connection.idle_since = now
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive_s, self._swept)

    def _expire(self, now: float) -> None:
        """Close the connections idle longer than ``keepalive_s``: one that a NAT or a load
        balancer dropped without a word would take a request and never answer it."""
        idle = self._idle
        expired = 0
        while expired < len(idle) and now - idle[expired].idle_since >= self._keepalive_s:
            expired += 1
        if expired:
            gone, idle[:expired] = idle[:expired], []
            for connection in gone:
                connection.close()

    def _swept(self) -> None:
        """A pool left alone closes its expired connections all the same (a socket each), on
        one timer per origin, armed again while some are idle."""
        self._sweep = None
        now = time.monotonic()
        self._expire(now)
        if self._idle:  # the oldest expires first: the timer for it
            wait = self._idle[0].idle_since + self._keepalive_s - now
            self._sweep = asyncio.get_running_loop().call_later(max(wait, 0.0), self._swept)

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
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._idle.clear()
        for connection in list(self._open):
            connection.close()
