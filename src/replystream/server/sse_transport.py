"""Server-sent events over one HTTP/1.1 response: the frame transport of every streamed route.

This file is the only place that knows an event stream's bytes on the wire (``event:``,
``id:``, ``data:``, keep-alive comments), HTTP/1.1 chunk framing, and the parts of aiohttp's
response it must reach into: headers held back to leave with the first events, a write that
goes straight into the socket (the follower's direct path), a write that waits whenever the
socket's buffer is past its high-water mark (aiohttp's own waits only every 64 KiB), and a
last event queued without waiting when the socket does not drain. No route that streams
takes ``HEAD`` (each answers it with 405: ``app``): a stream always has a body. It must not
know about replies or how the log is kept.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from aiohttp import HttpVersion11, hdrs, web

from replystream.delivery.follower import Follower
from replystream.delivery.formats import KEEPALIVE, Notices
from replystream.delivery.frame_transport import Ending
from replystream.delivery.replay import LogEntry
from replystream.server.front_door import SentLater
from replystream.server.socket_room import LAST_WORDS_S, SocketRoom, abort_later
from replystream.sse import encode_data

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Asks nginx (and proxies that honour it) not to hold this response in a buffer.
    "X-Accel-Buffering": "no",
}


def sse_event(entry: LogEntry, numbered: bool) -> bytes:
    """The bytes of one log entry as an SSE event (``id:`` its number, when ``numbered``)."""
    event, data = entry.event, entry.data
    if numbered and "\n" not in data and "\r" not in data:
        # The common one-line event, written directly (what encode_data would write): a
        # named one, or a plain message (every OpenAI chunk), whose type is not written.
        if event and event != "message":
            return f"event: {event}\nid: {entry.seq}\ndata: {data}\n\n".encode()
        return f"id: {entry.seq}\ndata: {data}\n\n".encode()
    return encode_data(data, type=event, id=str(entry.seq) if numbered else None)


class EventStream(SentLater):
    """The response of a streamed reply. aiohttp calls ``prepare`` after the handler returned;
    that runs the follower, which opens this response and then writes every event to the end.
    """

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__(headers=headers)
        self.follower: Follower | None = None

    def prepare(self, request: web.BaseRequest) -> Coroutine[Any, Any, None]:
        follower, self.follower = self.follower, None  # no cycle with it once it runs
        if follower is None:
            raise RuntimeError("an event stream is sent once, by its follower")
        return follower.run()

    async def send_headers(self, request: web.BaseRequest) -> None:
        if request.version < HttpVersion11:
            # HTTP/1.0 has no chunks: the body ends where the connection does, whatever
            # keep-alive the client asked for (aiohttp's header says so, but it would keep
            # the connection open, and the client could not tell where the stream ended).
            self.force_close()
        await super().prepare(request)


class SSETransport(SocketRoom):
    """One HTTP/1.1 response carrying a reply's events (the follower's ``FrameTransport``)."""

    __slots__ = (
        "_body_ended",
        "_chunked",
        "_keepalive",
        "_notices",
        "_numbered",
        "request",
        "response",
    )

    def __init__(
        self,
        request: web.Request,
        response: EventStream,
        *,
        numbered: bool = True,
        keepalive: bytes = KEEPALIVE,
        notices: Notices | None = None,
    ) -> None:
        # No socket to write to until the headers left (None: no body may be written).
        super().__init__(None, request.protocol)
        self.request = request
        self.response = response
        self._numbered = numbered
        self._keepalive = keepalive  # the idle frame (dialects may need another spelling)
        self._notices = notices  # the dialect's spelling of the follower's notices
        self._chunked = False
        self._body_ended = False  # the body's last chunk is written: nothing may follow it

    def encode(self, entries: Sequence[LogEntry]) -> bytes:
        if self._notices is not None:
            self._notices.sent(entries)  # encoded only to be written at once
        numbered = self._numbered
        if len(entries) == 1:
            return sse_event(entries[0], numbered)
        return b"".join(sse_event(entry, numbered) for entry in entries)

    def notice(self, event: str, data: str, after: int) -> bytes:
        if self._notices is None:
            return encode_data(data, type=event)
        specs = self._notices(event, data, after)
        return b"".join(encode_data(spec_data, type=kind) for kind, spec_data in specs)

    def tells_gaps(self) -> bool:
        # The native and lab streams (no notices of a dialect) have a ``gap`` event.
        return self._notices is None or self._notices.tells_gaps

    def keepalive(self, *, first: bool) -> bytes:
        # A dialect's keep-alive event (Anthropic's ``ping``) never comes before the stream's
        # first event (``message_start``, which waits for the engine's count of the prompt):
        # a comment, which every SSE reader skips, keeps the stream open until then.
        return KEEPALIVE if first else self._keepalive

    async def open(self, *, with_first_events: bool) -> None:
        """Headers leave now, before the first token exists: alone, or, when events are
        ready, in one write with them (aiohttp holds the headers until the first body
        write; the follower's first catch-up makes it at once)."""
        response = self.response
        if with_first_events:
            response._send_headers_immediately = False
        await response.send_headers(self.request)
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"
        # Cached: the request's property costs per event.
        SocketRoom.__init__(self, self.request.transport, self.request.protocol)

    async def write(self, data: bytes, *, last: bool) -> int:
        if last:  # the end of the body leaves in the same write
            self._body_ended = True
            await self.response.write_eof(data)
        else:
            await self.response.write(data)
            # aiohttp's write waits for the socket only once 64 KiB were written since its
            # last wait: until then a client that stopped reading had the writes pile up
            # in the buffer past its high-water mark, uncounted by the byte limit, and
            # none waited, so the time limit never began to run.
            if self._protocol.writing_paused:
                await self.request.writer.drain()
        return len(data)

    def push(self, entries: Sequence[LogEntry]) -> int | None:
        transport = self._transport
        if (
            transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() >= self._high_water
        ):
            return None
        data = self.encode(entries)
        size = len(data)  # the body's bytes, as ``write`` counts them: not the chunk framing
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (size, data)
        transport.write(data)
        return size

    async def end(self) -> None:
        if not self._body_ended:
            self._body_ended = True
            await self.response.write_eof()

    def last_words(self, notice: bytes, ending: Ending) -> int:
        """Queue a final event without waiting, then close; abort if it cannot leave soon.

        Used when the socket is not draining, so the response's own (awaiting) writer cannot
        be used: the event goes to the socket directly, framed as the last HTTP chunk."""
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return 0
        said = 0
        if self.response.prepared:
            # Headers held back to leave with the first events must go first.
            self.request.writer.send_headers()
            # When the reply's end is queued already (it just could not leave), nothing
            # follows it.
            if not self._body_ended:
                self._body_ended = True
                said = len(notice)  # the body's bytes, as ``write`` counts them
                if self._chunked:
                    notice = b"%x\r\n%s\r\n0\r\n\r\n" % (len(notice), notice)
                transport.write(notice)
        transport.close()  # no headers yet: nothing can be said in-band
        # A client that never reads would keep the socket (and its buffer) forever.
        abort_later(transport, LAST_WORDS_S)
        return said

    def finished(self, ending: Ending) -> None:
        sent = self.response.sent
        if sent is not None:
            sent("client_gone" if ending == "client_gone" else 200)
