"""Clients on a narrow link to a ``replystream serve`` process: what they are sent waits in a
few kilobytes of buffers, not loopback's megabytes, so one that stops reading (or reads
slowly) soon holds up the server's writes, and the slow-client limits can cut it.

Run as ``python -m tests.narrow_link serve ARGS``, the server is ``replystream serve ARGS``
whose connections from ``NARROW_HOST`` (a loopback address: a client binds its socket to
it) get the smallest kernel send buffer and a small write buffer above it (the transport's
high-water mark), as in-process tests get from ``on_response_prepare`` hooks. Connections
from other addresses are left as they are. ``narrow_connection`` is such a client's
connection (its receive buffer the smallest too, and its reader's own small), on which
``NarrowResponse`` makes an HTTP request and ``RawWebSocket`` a WebSocket, each read only
when asked (aiohttp's WebSocket client reads ahead into a 64 KiB queue).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import sys
from typing import Any

from aiohttp import web

NARROW_HOST = "127.0.0.2"
SEND_BUFFER = 1  # the kernel raises it to its least (some 4 KiB)
HIGH_WATER = 1024  # the transport's own buffer past which a write waits for the socket
READ_LIMIT = 2048  # a narrow client's own buffer: it stops taking from its socket past twice this


async def narrow(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """The server's side of a narrow client's connection: little room for its writes."""
    transport = request.transport
    if transport is None or request.remote != NARROW_HOST:
        return
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    transport.set_write_buffer_limits(high=HIGH_WATER)


async def narrow_connection(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from ``NARROW_HOST``, its receive buffer the smallest the kernel has."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    sock.bind((NARROW_HOST, 0))
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=READ_LIMIT)


def widen(writer: asyncio.StreamWriter) -> None:
    """Let a narrow connection's reader read at full speed: a receive buffer as small as
    the kernel allows, once full, reopens only as far as the sender's zero-window probes
    find it (loopback's segments are 64 KiB), a few hundred bytes a second at their backoff,
    and the server gives up on the last bytes of a reader it cut well before they arrive."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)


class NarrowSocket:
    """A client's end of a narrow connection: widened, or closed, when its test is done."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def widen(self) -> None:
        widen(self.writer)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


class NarrowResponse(NarrowSocket):
    """One HTTP/1.1 request on a narrow connection, its body read only when asked (aiohttp's
    client, its read buffer made as small, was seen to stop taking a paused chat stream
    from its socket for good, though read on)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._left = 0  # of the current chunk
        self._ended = False

    @classmethod
    async def request(
        cls, host: str, port: int, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> NarrowResponse:
        reader, writer = await narrow_connection(host, port)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        response = cls(reader, writer)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            writer.close()
            raise ConnectionError(f"no answer: {exc!r}") from None
        except BaseException:
            writer.close()
            raise
        response.status = int(head[0].split()[1])
        for line in head[1:]:
            name, _, value = line.partition(":")
            response.headers[name.strip().lower()] = value.strip()
        return response

    async def read(self, size: int = 65536) -> bytes:
        """Up to ``size`` bytes of the body (chunked, or up to the end of the connection);
        b"" at its end. Raises ``ConnectionError`` for a chunked body cut short."""
        if self._ended:
            return b""
        try:
            if self.headers.get("transfer-encoding") != "chunked":
                data = await self.reader.read(size)
                self._ended = not data
                return data
            if self._left == 0:
                line = await self.reader.readuntil(b"\r\n")
                self._left = int(line[:-2].split(b";")[0], 16)
                if self._left == 0:
                    await self.reader.readexactly(2)
                    self._ended = True
                    return b""
            data = await self.reader.read(min(size, self._left))
            if not data:
                raise asyncio.IncompleteReadError(b"", self._left)
            self._left -= len(data)
            if self._left == 0:
                if await self.reader.readexactly(2) != b"\r\n":
                    raise ConnectionError("a chunk not ended by CRLF")
            return data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise ConnectionError(f"the body was cut short: {exc!r}") from None


class RawWebSocket(NarrowSocket):
    """A WebSocket client on a narrow socket that reads a frame only when asked."""

    @classmethod
    async def connect(cls, host: str, port: int, path: str) -> RawWebSocket:
        reader, writer = await narrow_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            writer.close()
            raise ConnectionError(f"no answer: {exc!r}") from None
        if not head.startswith(b"HTTP/1.1 101"):
            writer.close()
            raise ConnectionError(f"no upgrade: {head[:200]!r}")
        return cls(reader, writer)

    def send_json(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message).encode()
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            head = struct.pack("!BB", 0x81, 0x80 | length)
        elif length < 1 << 16:
            head = struct.pack("!BBH", 0x81, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", 0x81, 0x80 | 127, length)
        self.writer.write(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    async def receive(self) -> tuple[int, bytes]:
        """The next frame's opcode and payload (the server's are whole, never masked);
        (-1, b"") at the end of the connection."""
        try:
            first, second = await self.reader.readexactly(2)
            length = second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
            return first & 0x0F, await self.reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ConnectionError(f"a frame cut short: {exc.partial[:80]!r}") from None
            return -1, b""


def main() -> int:
    """``replystream`` whose servers narrow ``NARROW_HOST``'s connections."""
    import replystream.server.app as app_module
    from replystream.cli import main as replystream_main

    create_app = app_module.create_app

    def narrowing_app(*args: Any, **kwargs: Any) -> web.Application:
        app = create_app(*args, **kwargs)
        app.on_response_prepare.append(narrow)
        return app

    app_module.create_app = narrowing_app
    return replystream_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
