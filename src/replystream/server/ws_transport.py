"""One reply's messages on a WebSocket: the frame transport of ``GET /v1/ws``.

Every log entry becomes one text message, built from the entry's fields (its data is JSON
already, so nothing is parsed back): ``{"type": <event>, "id": <the client's tag>,
"reply_id": ..., "seq": n, "data": <data>}``. Several replies share one socket, each with its
own transport; each message is one whole frame written straight to the socket (the socket
is opened without compression, so frames are plain), which lets the follower's direct path
work here as over SSE. This file is the only place that knows WebSocket framing and the
parts of aiohttp's connection it reaches into (its drain, and the bytes it holds from before
the upgrade). It must not know about replies.

What the client sends is checked here too, before aiohttp reads it (``MaskedFramesOnly``):
aiohttp's frame reader takes an unmasked client frame as a masked one, but RFC 6455 (5.1)
says a server must close the connection on one (1002, protocol error). And the answer to a
client's close frame is decided here (``close_answer``): aiohttp refuses most codes no peer
may send, but takes 1006 and every code from 5000 up as valid ones.

Keep-alive (``SocketKeepalive``), instead of aiohttp's heartbeat, which pings every period
whatever is being sent and drops a peer whose pong is late, though a ping queued behind
frames the client has not read yet is answered late by a client that is only behind:
1. A ping leaves only when the socket has sent nothing for ``keepalive_s``: while frames
   flow, a reader that is behind is the slow-client limits' business alone.
2. A ping not answered within ``slow_client_s`` is treated as a write that did not drain
   within it: the socket is cut as a slow client (1008). So a peer that is gone (or no
   longer reads) is cut at most ``keepalive_s`` (and a quarter of it) plus ``slow_client_s``
   after the last frame, and one that is merely behind has as long to catch up as any write.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence

from aiohttp import web

from replystream.delivery.formats import json_string
from replystream.delivery.frame_transport import Ending
from replystream.delivery.replay import LogEntry
from replystream.server.socket_room import LAST_WORDS_S, SocketRoom, abort_later

CLOSE_POLICY = 1008  # the client broke a rule of ours (it did not read)
CLOSE_PROTOCOL_ERROR = 1002  # the client broke RFC 6455's
MAX_FRAME_HEAD = 14  # two bytes, a 64-bit length, a 4-byte mask key (RFC 6455 5.2)


def text_frame(payload: bytes) -> bytes:
    """One unmasked, final text frame (RFC 6455 5.2: a server never masks)."""
    size = len(payload)
    if size < 126:
        return bytes((0x81, size)) + payload
    if size < 1 << 16:
        return struct.pack("!BBH", 0x81, 126, size) + payload
    return struct.pack("!BBQ", 0x81, 127, size) + payload


def frame_bytes(size: int) -> int:
    """The bytes of a frame (``text_frame``'s) carrying ``size`` bytes of payload."""
    return size + (2 if size < 126 else 4 if size < 1 << 16 else 10)


def close_frame(code: int, reason: bytes) -> bytes:
    """A close frame with its status code (RFC 6455 5.5.1)."""
    body = struct.pack("!H", code) + reason[:123]
    return bytes((0x88, len(body))) + body


# Codes RFC 6455 (7.4.1) reserves for an endpoint's own report of a closure: never in a
# close frame. 1004 is reserved with no meaning; 1016-2999 belong to later RFCs (none exist).
_NEVER_SENT = frozenset((1004, 1005, 1006, 1015))


def close_answer(code: int | None) -> int:
    """The code of the close frame answering a client's close with ``code`` (None or 0: the
    frame had no code). RFC 6455 7.4: a code a peer must not send (under 1000, one kept for
    reports, unassigned below 3000, or past 4999) is a protocol error (1002); any other close
    is answered with a normal one (1000)."""
    if not code:
        return 1000
    if code < 1000 or code in _NEVER_SENT or 1016 <= code < 3000 or code >= 5000:
        return CLOSE_PROTOCOL_ERROR
    return 1000


PING_FRAME = bytes((0x89, 0))  # a ping without a payload (RFC 6455 5.5.2)


class MaskCheck:
    """Finds the first unmasked frame in the bytes a client sends, frame by frame: each
    frame's head is read, its payload skipped. Pure state: bytes in, a position out."""

    __slots__ = ("_head", "_skip")

    def __init__(self) -> None:
        self._head = b""  # the start of a frame's head, when a read ended inside it
        self._skip = 0  # the current frame's payload bytes still to come

    def feed(self, data: bytes) -> int | None:
        """Where in ``data`` the first unmasked frame starts (0 when it began in an earlier
        read); None while every frame is masked."""
        pos, end = 0, len(data)
        while True:
            step = min(self._skip, end - pos)
            pos, self._skip = pos + step, self._skip - step
            if pos == end:
                return None
            head = self._head + data[pos : pos + MAX_FRAME_HEAD]
            if len(head) >= 2 and not head[1] & 0x80:
                return max(pos - len(self._head), 0)
            flag = head[1] & 0x7F if len(head) >= 2 else 0
            length_size = 2 if flag == 126 else 8 if flag == 127 else 0
            head_size = 2 + length_size + 4
            if len(head) < head_size:  # the read ended inside the head
                self._head = head
                return None
            pos += head_size - len(self._head)
            self._head = b""
            self._skip = int.from_bytes(head[2 : 2 + length_size], "big") if length_size else flag


class MaskedFramesOnly(asyncio.Protocol):
    """The connection's protocol while it is a WebSocket, in front of aiohttp's: every byte
    the client sends passes through to aiohttp until a frame comes unmasked. Then the
    connection is failed (RFC 6455 7.1.7): nothing more reaches aiohttp, a close frame (1002)
    goes out, and the connection closes (dropped if the frame cannot leave soon).

    Installed (``install``) before the upgrade is answered, so it sees every frame: the bytes
    aiohttp already holds, sent after the upgrade request, are checked first. A failure found
    before ``arm`` (the upgrade's answer is sent) waits for it."""

    def __init__(
        self,
        inner: asyncio.Protocol,
        transport: asyncio.Transport,
        on_failure: Callable[[str], None],
    ) -> None:
        self._inner = inner
        self._transport = transport
        self._on_failure = on_failure
        self._check = MaskCheck()
        self._armed = False
        self.failed = False

    @classmethod
    def install(
        cls, request: web.Request, on_failure: Callable[[str], None]
    ) -> MaskedFramesOnly | None:
        """Put the check in front of ``request``'s connection (None: it is gone already)."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        guard = cls(request.protocol, transport, on_failure)
        # What aiohttp read past the upgrade request before this handler ran: the client sent
        # it without waiting for the answer (RFC 6455 says it must wait, but it may not).
        held = getattr(request.protocol, "_message_tail", b"")
        if isinstance(held, bytes) and held and guard._check.feed(held) is not None:
            guard.failed = True
        transport.set_protocol(guard)
        return guard

    def arm(self) -> bool:
        """The upgrade's answer is sent: a failure may be sent now. False if it was failed."""
        self._armed = True
        if self.failed:
            self._fail()
        return not self.failed

    def _fail(self) -> None:
        transport = self._transport
        if not transport.is_closing():
            transport.write(close_frame(CLOSE_PROTOCOL_ERROR, b"unmasked frame"))
            transport.close()
            abort_later(transport, LAST_WORDS_S)
        self._on_failure("the client sent an unmasked frame")

    def data_received(self, data: bytes) -> None:
        if self.failed:
            return
        at = self._check.feed(data)
        if at is None:
            self._inner.data_received(data)
            return
        if at:
            self._inner.data_received(data[:at])  # the frames before it were good
        self.failed = True
        if self._armed:
            self._fail()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class SocketKeepalive:
    """When to ping one WebSocket, and when to give up on a peer that does not answer.

    Pure state but for the ping it writes: ``check`` is called with the loop's clock every
    ``period_s``; every frame written sets ``sent`` (one attribute store, no clock read)."""

    __slots__ = ("_idle_since", "_keepalive_s", "_patience_s", "_ping_at", "_transport", "sent")

    def __init__(
        self,
        transport: asyncio.Transport | None,
        *,
        keepalive_s: float,
        patience_s: float,
        now: float,
    ) -> None:
        self._transport = transport
        self._keepalive_s = keepalive_s
        self._patience_s = patience_s  # how long a ping may wait for its answer
        self._idle_since = now
        self._ping_at: float | None = None
        self.sent = False  # a frame was written since the last check

    @property
    def period_s(self) -> float:
        """How often ``check`` runs: a ping leaves at most a quarter period late."""
        return self._keepalive_s / 4.0

    def next_check_s(self, now: float) -> float:
        """How long until ``check`` must run next: a period, or, while a ping waits for its
        answer, no later than its ``patience_s`` is up (a check a period later would let a
        peer that is gone stay up to a quarter of ``keepalive_s`` past it)."""
        if self._ping_at is None:
            return self.period_s
        # A timer may fire a little early (uvloop's are in milliseconds): never 0, no spin.
        return max(0.001, min(self.period_s, self._ping_at + self._patience_s - now))

    def answered(self) -> None:
        """The peer's pong came."""
        self._ping_at = None

    def check(self, now: float) -> str | None:
        """Ping if the socket has been idle for a whole period; why the socket must be cut,
        if a ping went unanswered too long."""
        if self.sent:
            self.sent = False
            self._idle_since = now
        if self._ping_at is not None:
            if now - self._ping_at >= self._patience_s:
                return f"no answer to a ping for {self._patience_s:g} s"
            return None
        transport = self._transport
        if now - self._idle_since >= self._keepalive_s and transport is not None:
            if not transport.is_closing():
                transport.write(PING_FRAME)
                self._ping_at = self._idle_since = now
        return None


class WebSocketTransport(SocketRoom):
    """One reply's share of a WebSocket (the follower's ``FrameTransport``)."""

    __slots__ = ("_closing", "_cut", "_head", "_keepalive", "reply_id")

    def __init__(
        self,
        request: web.Request,
        *,
        tag: str,
        reply_id: str,
        cut: Callable[[], None],
        closing: Callable[[], bool],
        keepalive: SocketKeepalive,
    ) -> None:
        super().__init__(request.transport, request.protocol)
        self.reply_id = reply_id
        self._keepalive = keepalive  # told of every frame written: the socket is not idle
        # Every message of this reply starts the same way after its type.
        self._head = f',"id":{json_string(tag)},"reply_id":{json_string(reply_id)}'
        self._cut = cut  # the socket is done for: the session's other replies end too
        # The session is closing the socket: its close frame is (or is about to be) written,
        # and no frame may follow it.
        self._closing = closing

    def _message(self, event: str | None, tail: str) -> bytes:
        text = f'{{"type":{json_string(event or "message")}{self._head}{tail}}}'
        return text_frame(text.encode())

    def encode(self, entries: Sequence[LogEntry]) -> bytes:
        if len(entries) == 1:
            entry = entries[0]
            return self._message(entry.event, f',"seq":{entry.seq:d},"data":{entry.data}')
        return b"".join(
            self._message(e.event, f',"seq":{e.seq:d},"data":{e.data}') for e in entries
        )

    def notice(self, event: str, data: str, after: int) -> bytes:
        return self._message(event, f',"data":{data}')

    def tells_gaps(self) -> bool:
        return True  # the native messages have a ``gap`` type

    def keepalive(self, *, first: bool) -> None:
        return None  # the socket is kept alive by its own pings (``SocketKeepalive``)

    async def open(self, *, with_first_events: bool) -> None:
        if self._transport is None or self._transport.is_closing() or self._closing():
            raise ConnectionError("the WebSocket is closed")

    async def write(self, data: bytes, *, last: bool) -> int:
        transport = self._transport
        if transport is None or transport.is_closing() or self._closing():
            raise ConnectionResetError("the WebSocket is closed")
        transport.write(data)
        self._keepalive.sent = True
        if self._protocol.writing_paused:
            await self._protocol._drain_helper()
        return len(data)

    def push(self, entries: Sequence[LogEntry]) -> int | None:
        if not self.has_room() or self._closing():
            return None
        data = self.encode(entries)
        assert self._transport is not None
        self._transport.write(data)
        self._keepalive.sent = True
        return len(data)

    async def end(self) -> None:
        return None  # the reply ended; the socket goes on

    def last_words(self, notice: bytes, ending: Ending) -> int:
        transport = self._transport
        if transport is None or transport.is_closing() or self._closing():
            return 0
        transport.write(notice)
        if ending == "slow_client":
            # The socket itself cannot keep up: it closes, and every reply on it with it.
            # Dropped if the frames cannot leave soon. (At shutdown the session closes it,
            # once every reply has said so.)
            transport.write(close_frame(CLOSE_POLICY, ending.encode()))
            self._cut()
            transport.close()
            abort_later(transport, LAST_WORDS_S)
        return len(notice)

    def finished(self, ending: Ending) -> None:
        return None
