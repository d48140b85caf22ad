"""Write a reply log to one HTTP response: replay, follow live, keep alive, cut slow readers.

A reader starts after the event id it was given (0: from the start), writes every entry the
log has, then waits for more until the reply's terminal entry. While idle it sends keep-alive
comments. Each write waits for the socket to drain, at most ``slow_client_s``; a reader whose
unsent backlog passes ``slow_client_bytes`` is cut (its cursor, from the reply's store, says
how far behind it is, for a reply made here or on another replica; the producer's append
reaches a reader of a local reply through ``interrupt``, even while it is blocked on the
socket). A cut reader gets a last ``error`` event if the socket still takes it. This file
must not know about the engine or which store keeps the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from replystream.delivery.formats import KEEPALIVE, error_frame
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogCursor, LogEntry, StoreUnavailable
from replystream.server.front_door import SentLater
from replystream.server.metrics import ReplyRecord
from replystream.server.replies import Reply, ReplyManager
from replystream.sse import encode_data

log = logging.getLogger("replystream.reader")

LAST_WORDS_S = 5.0  # how long a cut stream's final event may take to leave
LIVENESS_POLL_S = 1.0  # how often a reader of a remote reply checks its producer is alive
WRITE_CHUNK = 64 * 1024  # a replay goes out in writes of about this size, each drained
WRITE_OVERHEAD = 8 * 1024  # room for what a write may add: the headers, chunk framing
MAX_SWEEP_S = 1.0  # the keep-alive clock looks at waiting readers at least this often

ReaderEnding = Literal[
    "ended",
    "client_gone",
    "slow_client",
    "shutdown",
    "producer_lost",
    "expired",
    "store_unavailable",
    "failed",
]

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Asks nginx (and proxies that honour it) not to hold this response in a buffer.
    "X-Accel-Buffering": "no",
}


class _Cut(Exception):
    def __init__(self, ending: ReaderEnding, detail: str) -> None:
        super().__init__(detail)
        self.ending = ending


class KeepaliveClock:
    """One timer for the keep-alives of every reader waiting on the direct path.

    A sweep every quarter of the shortest keep-alive period among them (at most every
    second) wakes each one idle for a whole period, so a keep-alive leaves at most a quarter
    period (or a second) late. Thousands of readers cost one wake-up a second, not a timer
    each (a handle, its context and a bound method: 240 bytes a stream)."""

    def __init__(self) -> None:
        self._waiting: set[LogReader] = set()
        self._period_s = MAX_SWEEP_S
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, reader: LogReader, keepalive_s: float) -> None:
        self._waiting.add(reader)
        period = min(MAX_SWEEP_S, keepalive_s / 4.0)
        if self._timer is None or period < self._period_s:
            self._arm(period)

    def forget(self, reader: LogReader) -> None:
        self._waiting.discard(reader)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, period_s: float) -> None:
        self.close()
        self._period_s = period_s
        self._timer = asyncio.get_running_loop().call_later(period_s, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        if not self._waiting:
            return  # armed again by the next reader to wait
        now = time.monotonic()
        shortest = MAX_SWEEP_S * 4.0
        for reader in list(self._waiting):  # a woken reader leaves the set when it runs
            reader.wake_if_idle(now)
            if reader.policy.keepalive_s is not None:
                shortest = min(shortest, reader.policy.keepalive_s)
        self._arm(min(MAX_SWEEP_S, shortest / 4.0))


class EventStream(SentLater):
    """The response of a streamed reply. aiohttp calls ``prepare`` after the handler returned;
    that runs the reader, which sends the headers and then every event to the end."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__(headers=headers)
        self.reader: LogReader | None = None

    def prepare(self, request: web.BaseRequest) -> Coroutine[Any, Any, None]:
        reader, self.reader = self.reader, None  # no cycle with the reader once it runs
        if reader is None:
            raise RuntimeError("an event stream is sent once, by its reader")
        return reader.run()

    async def send_headers(self, request: web.BaseRequest) -> None:
        await super().prepare(request)


@dataclass(eq=False, slots=True)
class LogReader:
    """One connection following one reply's log."""

    request: web.Request
    response: EventStream
    reply_id: str
    cursor: LogCursor  # this reader's place in the log, from the reply's store
    policy: DeliveryPolicy
    manager: ReplyManager
    clock: KeepaliveClock  # wakes this reader for a keep-alive while it waits directly
    reply: Reply | None  # the producer, when it runs in this process
    record: ReplyRecord | None  # where to count what is sent (the producer's record)
    last_write: float = 0.0
    _woken: asyncio.Future[None] | None = None  # while direct: done when the task has work
    keepalive: bytes = KEEPALIVE  # the idle frame (dialects may need another spelling)
    overflow: bool = False
    _chunked: bool = False
    _high_water: int = 0  # the transport's write high-water mark: above it, writes wait
    _transport: asyncio.Transport | None = None  # cached: the request property costs per event
    _deadline: asyncio.Timeout | None = None
    _body_ended: bool = False  # the body's last chunk is written: nothing may follow it

    def interrupt(self) -> None:
        """Called on every append while this reader may be blocked, and on shutdown."""
        deadline = self._deadline
        if deadline is None or deadline.expired():
            return
        if not self.manager.shutting_down:
            if self.cursor.lag_bytes() <= self.policy.slow_client_bytes:
                return
            self.overflow = True
        deadline.reschedule(asyncio.get_running_loop().time())

    def _takes_at_once(self, size: int) -> bool:
        """Whether the socket's buffer takes ``size`` more bytes without pausing the writer,
        so a write of them cannot wait (aiohttp's writes wait only on a paused protocol)."""
        transport = self._transport
        return (
            transport is not None
            and not self.request.protocol.writing_paused
            and transport.get_write_buffer_size() + size + WRITE_OVERHEAD <= self._high_water
        )

    async def _write(self, frame: bytes, last: bool) -> None:
        if last:  # the end of the body leaves in the same write
            self._body_ended = True
            await self.response.write_eof(frame)
        else:
            await self.response.write(frame)

    async def _send(self, frame: bytes, events: int, *, last: bool = False) -> None:
        if self.overflow:
            raise _Cut("slow_client", f"more than {self.policy.slow_client_bytes} bytes behind")
        if self._takes_at_once(len(frame)):
            await self._write(frame, last)  # cannot wait: no deadline to arm
        else:
            await self._write_within_deadline(frame, last)
        self.last_write = time.monotonic()
        if self.record is not None:
            self.record.on_send(len(frame), events)

    async def _write_within_deadline(self, frame: bytes, last: bool) -> None:
        try:
            async with asyncio.timeout(self.policy.slow_client_s) as deadline:
                self._deadline = deadline
                if self.reply is None:
                    await self._write_measuring_lag(frame, last)
                else:
                    await self._write(frame, last)
        except TimeoutError:
            if self.manager.shutting_down:
                raise _Cut("shutdown", "the server is shutting down") from None
            if self.overflow:
                raise _Cut(
                    "slow_client", f"more than {self.policy.slow_client_bytes} bytes behind"
                ) from None
            raise _Cut(
                "slow_client", f"socket did not drain for {self.policy.slow_client_s:g} s"
            ) from None
        finally:
            self._deadline = None

    async def _write_measuring_lag(self, frame: bytes, last: bool) -> None:
        """A write of a reader whose reply is made elsewhere (or has ended): no append will
        interrupt it, so while it waits it asks the store how far behind it is, and is cut
        past the byte limit as a reader of a local reply would be."""
        write = asyncio.ensure_future(self._write(frame, last))
        try:
            while not write.done():
                await asyncio.wait((write,), timeout=LIVENESS_POLL_S)
                if not write.done() and (
                    await self.cursor.measure() > self.policy.slow_client_bytes
                ):
                    self.overflow = True
                    raise _Cut(
                        "slow_client", f"more than {self.policy.slow_client_bytes} bytes behind"
                    )
            write.result()
        finally:
            if not write.done():
                write.cancel()

    def _last_words(self, message: str, code: str) -> None:
        """Queue a final event without waiting, then close; abort if it cannot leave soon.

        Used when the socket is not draining, so the response's own (awaiting) writer cannot
        be used: the frame goes to the transport directly, framed as the last HTTP chunk.
        """
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return
        # Headers held back to leave with the first events must go first.
        self.request.writer.send_headers()
        # When the reply's end is queued already (it just could not leave), nothing follows.
        if not self._body_ended:
            frame = error_frame(message, code)
            if self.response.headers.get("Transfer-Encoding") == "chunked":
                frame = b"%x\r\n%s\r\n0\r\n\r\n" % (len(frame), frame)
            transport.write(frame)
        transport.close()
        # A reader that never reads would keep the socket (and its buffer) forever.
        asyncio.get_running_loop().call_later(LAST_WORDS_S, transport.abort)

    async def run(self) -> None:
        """Send the headers, then follow the log to its end (or until cut).

        One frame for the whole stream: thousands of readers are in it at once."""
        self.manager.readers.add(self)
        if self.reply is not None:
            self.reply.followers.append(self)
            self.reply.reader_joined()
        ending: ReaderEnding = "client_gone"
        try:
            await self._send_headers()
            keepalive = self.policy.keepalive_s
            self.last_write = time.monotonic()
            while True:
                if self.manager.shutting_down and self.reply is None:
                    raise _Cut("shutdown", "the server is shutting down")
                idle_for = time.monotonic() - self.last_write
                wait = (
                    LIVENESS_POLL_S
                    if keepalive is None
                    else min(LIVENESS_POLL_S, keepalive - idle_for)
                )
                if self._can_go_direct():
                    try:
                        await self._go_direct()
                    finally:
                        self._leave_direct()
                    wait = 0.0  # whatever woke us, look at the log now
                found = await self._catch_up(max(0.0, wait))
                if found is not None:
                    ending = found
                    break
            await self.response.write_eof()
        except _Cut as cut:
            ending = cut.ending
            if cut.ending == "slow_client" and self.record is not None:
                self.record.reason = str(cut)
            log.info("reader of %s cut: %s", self.reply_id[:8], cut)
            self._last_words(str(cut), cut.ending)
        except ConnectionError:
            ending = "client_gone"
        except Exception as exc:  # a bug of ours (or a store failing in a way it should not)
            ending = "failed"
            log.error("reader of %s failed", self.reply_id[:8], exc_info=exc)
            if self.response.prepared:
                self._last_words("internal error", "internal_error")
            elif self.request.transport is not None:
                self.request.transport.close()  # no headers yet: nothing can be said in-band
        finally:
            self.manager.forget_reader(self)
            if self.reply is not None:
                self.reply.followers.remove(self)
                self.reply.reader_left("slow_client" if ending == "slow_client" else "client_gone")
            if self.response.sent is not None:
                self.response.sent("client_gone" if ending == "client_gone" else 200)

    async def _send_headers(self) -> None:
        """Headers leave now, before the first token exists: alone, or, when the reply's
        opening events are already in this process's log, in one write with them (aiohttp
        holds the headers until the first body write; the first catch-up makes it now)."""
        reply = self.reply
        if reply is not None and reply.pipeline.next_seq - 1 > self.cursor.after:
            self.response._send_headers_immediately = False
        await self.response.send_headers(self.request)
        self._chunked = self.response.headers.get("Transfer-Encoding") == "chunked"
        self._transport = self.request.transport
        if self._transport is not None:
            self._high_water = self._transport.get_write_buffer_limits()[1]

    async def _catch_up(self, wait_s: float) -> ReaderEnding | None:
        """Send what the log has after ``after`` (waiting up to ``wait_s`` for something), or a
        keep-alive if nothing came and one is due; how the reader ended, if it did.

        Its own frame, so what it read is not held while the reader waits for more."""
        try:
            result = await self.cursor.read(wait_s)
        except StoreUnavailable as exc:
            log.warning("reader of %s: %s", self.reply_id[:8], exc)
            await self._send(error_frame(exc.describe(), exc.code), 1)
            return "store_unavailable"
        if result is None:
            await self._send(error_frame("the reply expired while being read", "expired"), 1)
            return "expired"
        if result.lost is not None:
            first, last = result.lost
            gap = json.dumps({"lost_from": first, "lost_to": last})
            await self._send(encode_data(gap, type="gap"), 1)
        await self._send_entries(result.entries, last=result.ending is not None)
        if result.ending is not None:
            return "ended"
        if result.producer_lost:
            message = "the replica generating this reply is gone"
            await self._send(error_frame(message, "generator_lost"), 1)
            return "producer_lost"
        keepalive = self.policy.keepalive_s
        idle_for = time.monotonic() - self.last_write
        if not result.entries and keepalive is not None and idle_for >= keepalive:
            await self._send(self.keepalive, 0)
        return None

    async def _send_entries(self, entries: list[LogEntry], *, last: bool = False) -> None:
        """Write log entries in writes of at most WRITE_CHUNK bytes, each waiting to drain;
        a reader further behind than the slow-client limit is cut instead. ``last``: these
        end the reply, and the end of the body goes with them."""
        if not entries:
            return
        if self.overflow or self.cursor.lag_bytes() > self.policy.slow_client_bytes:
            raise _Cut("slow_client", f"more than {self.policy.slow_client_bytes} bytes behind")
        batch: list[bytes] = []
        size = 0
        for index, entry in enumerate(entries):
            batch.append(entry.frame)
            size += len(entry.frame)
            if size >= WRITE_CHUNK or index == len(entries) - 1:
                # Several events in one write: fewer syscalls for a replay.
                final = last and index == len(entries) - 1
                await self._send(b"".join(batch), len(batch), last=final)
                self.cursor.sent(entry.seq, size)
                batch, size = [], 0
        if self.reply is not None:
            self.reply.consumed(self.cursor.after)

    # The direct path: a reader that has caught up with a reply produced in this process lets
    # the producer write each new event straight into the socket, so a live stream costs no
    # wake-up of this task per event. Any doubt (a paused socket, a gap, the end) hands the
    # work back to the task, which then writes with backpressure and the slow-client limits.

    def _can_go_direct(self) -> bool:
        reply = self.reply
        transport = self.request.transport
        return (
            reply is not None
            and reply.live
            and reply.pipeline.next_seq - 1 == self.cursor.after
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() < self._high_water
        )

    def _go_direct(self) -> asyncio.Future[None]:
        """Become the reply's sink; the future is done when this task has work again: the
        producer needs it (a paused socket, the end) or a keep-alive is due. Awaiting one
        future, not a loop in a coroutine: thousands of readers wait here."""
        assert self.reply is not None
        self.reply.sinks.append(self)
        self._woken = asyncio.get_running_loop().create_future()
        if self.policy.keepalive_s is not None:
            self.clock.watch(self, self.policy.keepalive_s)
        return self._woken

    def _leave_direct(self) -> None:
        assert self.reply is not None
        self.reply.sinks.remove(self)
        self._woken = None
        self.clock.forget(self)

    def wake_if_idle(self, now: float) -> None:
        """Hand the work back to the task if nothing was written for a keep-alive period."""
        keepalive = self.policy.keepalive_s
        if keepalive is not None and now - self.last_write >= keepalive:
            self.wake()

    def push(self, entries: list[LogEntry]) -> None:
        """Called by the producer with events just logged; writes them now if it safely can."""
        transport = self._transport
        cursor = self.cursor
        if (
            entries[0].seq != cursor.after + 1
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() >= self._high_water
        ):
            # The socket is not keeping up. Past the slow-client limit this reader is done
            # for; say so now, so the producer stops in this tick rather than after it.
            if not self.overflow and cursor.lag_bytes() > self.policy.slow_client_bytes:
                self.overflow = True
                if self.reply is not None:
                    self.reply.reader_fell_behind()
            self.wake()
            return
        payload = entries[0].frame if len(entries) == 1 else b"".join(e.frame for e in entries)
        data = b"%x\r\n%s\r\n" % (len(payload), payload) if self._chunked else payload
        transport.write(data)
        cursor.sent(entries[-1].seq, len(payload))
        self.last_write = time.monotonic()
        if self.record is not None:
            self.record.on_send(len(data), len(entries))
        if self.reply is not None:
            self.reply.consumed(cursor.after)

    def wake(self) -> None:
        """Hand the work back to the reader's task (the reply ended, or it must wait)."""
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)
