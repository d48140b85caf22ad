"""The load client's WebSocket streams: one reply per ``GET /v1/ws`` socket, frames walked by hand.

What this file decides: how a WebSocket stream is opened, read and timed, at the least work per
message. Each connection is an asyncio ``Protocol`` (like the SSE streams) that writes a
pre-built upgrade request, waits for ``101``, then writes its pre-built, pre-masked ``reply``
message: the token due times count from that write. Server frames are walked by their headers,
without copying a payload or decoding JSON: a text frame whose payload starts with
``{"type":"token"`` is one token event, stamped when ``data_received`` hands over the read that
completes it; ``done`` ends the stream (the client then sends its close frame and lets the
server close the connection); an ``error`` message, a close frame or any frame this benchmark
does not expect is a failure. A ping is answered, so a run longer than the server's heartbeat
keeps its sockets. An incomplete frame at the end of a read is kept for the next one.

The client offers no extension, so messages are not compressed (a browser would offer
permessage-deflate, which aiohttp's server accepts: more CPU on both sides than measured here).
"""

from __future__ import annotations

import base64
import os
import time

from clientstream import Run, Stream
from workload import WS_DONE_MARKER, WS_ERROR_MARKER, WS_TOKEN_MARKER

TEXT = 0x81  # FIN and the text opcode: a whole text message in one frame
CLOSE = 0x88
PING = 0x89
PONG = 0x8A
NORMAL_CLOSURE = (1000).to_bytes(2, "big")
CODE = b'"code": "'  # the error event's data, as the reply log holds it


def upgrade_request(host: str, port: int, path: str) -> bytes:
    """A WebSocket opening handshake with a fresh key and no extension offered."""
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def masked_frame(first: int, payload: bytes) -> bytes:
    """A client frame: first byte ``first``, ``payload`` masked with a fresh key (RFC 6455 5.3)."""
    size = len(payload)
    if size < 126:
        head = bytes([first, 0x80 | size])
    elif size < 1 << 16:
        head = bytes([first, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([first, 0x80 | 127]) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    key = (mask * (size // 4 + 1))[:size]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(size, "big")
    return head + mask + masked


class WsStream(Stream):
    """One reply over a WebSocket: upgrade, send the reply message, count token messages."""

    def __init__(self, run: Run, upgrade: bytes, reply: bytes) -> None:
        super().__init__(run)
        self.upgrade = upgrade
        self.reply_frame = masked_frame(TEXT, reply)
        self.close_frame = masked_frame(CLOSE, NORMAL_CLOSURE)
        self.head = b""
        self.pending = b""  # the start of a frame the last read did not complete

    def transport_ready(self) -> None:
        assert self.transport is not None
        self.transport.write(self.upgrade)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.ended:
            return  # the server's close frame after done, or a failed stream being closed
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.head[: self.head.find(b"\r\n")]
            if not status.startswith(b"HTTP/1.1 101"):
                self.finish(f"status {status[9:12].decode(errors='replace')}")
                return
            self.opened()
            assert self.transport is not None
            self.transport.write(self.reply_frame)
            self.sent = now
            data = self.head[end + 4 :]
            self.head = b""
        if self.pending:
            data = self.pending + data
        self.pending = self.frames(data, now)

    def frames(self, data: bytes, now: float) -> bytes:
        """Count the whole frames in ``data``; return the incomplete frame at its end."""
        pos = 0
        size = len(data)
        found = 0
        failure: str | None = None
        while size - pos >= 2:
            first = data[pos]
            length = data[pos + 1]
            start = pos + 2
            if length > 125:
                if length > 127:
                    failure = "a masked frame from the server"
                    break
                width = 2 if length == 126 else 8
                if start + width > size:
                    break
                length = int.from_bytes(data[start : start + width], "big")
                start += width
            stop = start + length
            if stop > size:
                break
            pos = stop
            if first == TEXT:
                if data.startswith(WS_TOKEN_MARKER, start):
                    found += 1
                elif data.startswith(WS_DONE_MARKER, start):
                    self.arrivals.extend([now] * found)
                    self.done_at = now
                    assert self.transport is not None
                    self.transport.write(self.close_frame)
                    self.finish(None)
                    return b""
                elif data.startswith(WS_ERROR_MARKER, start):
                    failure = f"error message: {error_code(data, start, stop)}"
                    break
            elif first == PING:
                assert self.transport is not None
                self.transport.write(masked_frame(PONG, data[start:stop]))
            elif first == CLOSE:
                code = int.from_bytes(data[start : start + 2], "big") if length >= 2 else 1005
                failure = f"closed by the server with code {code}"
                break
            else:
                failure = f"unexpected frame 0x{first:02x}"
                break
        if found:
            self.arrivals.extend([now] * found)
        if failure is not None:
            self.finish(failure)
            return b""
        return data[pos:]


def error_code(data: bytes, start: int, stop: int) -> str:
    """The ``code`` of the error message in ``data[start:stop]``, or ``?``."""
    at = data.find(CODE, start, stop)
    if at < 0:
        return "?"
    at += len(CODE)
    return data[at : data.find(b'"', at, stop)].decode(errors="replace")
