"""Follow one reply's log to one client, whatever the transport: replay, live tail,
keep-alive, slow-client limits, and the end.

A follower starts after the event id it was given (0: from the start), writes every entry the
log has, then waits for more until the reply's terminal entry. While idle it sends
keep-alives. Each write that may wait (the transport says the socket would not take it at
once) runs under a deadline of ``slow_client_s``. A follower is also cut when its unsent
backlog, beyond the entries it is writing at that moment, passes its byte limit
(``lag_limit``): ``slow_client_bytes`` plus the smallest such backlog it has had since it
began sending. So a reader that resumes or joins far behind may replay all the log keeps (it
starts behind by what it asked for, not by falling behind), one that then falls more than
``slow_client_bytes`` further behind is cut, and one that has caught up is held to
``slow_client_bytes`` alone. What it is writing is not counted: one append of the producer (a
Responses reply's closing events repeat its whole text and log probabilities) may be larger
than the limit, and a reader that takes it as fast as the socket allows is not behind. The
backlog comes from its cursor (``LogCursor``, handed out by the reply's store), so the limit
holds for a reply made here or on another replica: the producer's append reaches a follower
of a local reply through ``interrupt``, even while it is blocked on the socket; a follower of
a remote reply asks its cursor while its write waits, which tells it the log's latest write
too (what the producer's store wrote at once). A cut follower leaves a last ``error``
notice if the socket still takes it.

The direct path: a follower that has caught up with a reply made in this process lets the
producer write each new event straight into its transport (``push``), so a live stream costs
no wake-up of the follower's task per event. Any doubt (a busy socket, a gap, the end) hands
the work back to the task, which then writes with backpressure and the limits. While it waits
there, the app's ``KeepaliveClock`` (``keepalive_clock``) wakes it when a keep-alive is due.

Events a reader needs that the log no longer keeps are told as a ``gap`` notice, and the
follower goes on after them; a transport whose dialect has no such event (another API's,
whose client would take the text with a hole for the whole) is ended there instead, with an
``events_lost`` error (``FrameTransport.tells_gaps``).

A reply the store no longer has is told by why it is gone (``LogCursor.gone``): ``deleted``
(a delete, on any replica), ``reply_evicted`` (Redis evicted it), else ``expired``.

Framing belongs to the transport (``frame_transport``: SSE over HTTP/1.1, a WebSocket); what a
reply's producer offers its followers is ``LiveReply``. This file must not know about HTTP,
WebSockets, the engine or which store keeps the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Literal, NamedTuple, Protocol

from replystream.delivery.frame_transport import Ending, FrameTransport
from replystream.delivery.keepalive_clock import KeepaliveClock
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import (
    LogCursor,
    LogEntry,
    StoreUnavailable,
    data_bytes,
    entries_bytes,
)
from replystream.delivery.task_stop import drop_task, end_if_cancelled

log = logging.getLogger("replystream.follower")

LIVENESS_POLL_S = 1.0  # how often a follower of a remote reply checks its producer is alive
EVENTS_LOST = "events_lost"  # the code of a gap in a stream that cannot tell one
REPLY_EVICTED = "reply_evicted"  # the code of a reply Redis evicted while it was read
WRITE_CHUNK = 64 * 1024  # a replay goes out in writes of about this size, each drained
# A follower's byte limit before it first sends entries: its backlog is not known yet (a
# cursor on a reply made elsewhere learns it from its first read), and it has not fallen behind.
NOT_SENDING_YET = sys.maxsize


class Sink(Protocol):
    """A follower on the direct path, as the producer sees it."""

    def push(self, entries: list[LogEntry]) -> None:
        """Events just logged: write them now if the socket takes them, else wake."""
        ...

    def wake(self) -> None:
        """Hand the work back to the follower's task (the reply ended, or it must wait)."""
        ...


class Watcher(Protocol):
    """A follower of a local reply, as the producer sees it."""

    def interrupt(self, appended: list[LogEntry] | None = None) -> None:
        """Called on every append (``appended``: its entries) while the follower may be
        blocked, and at the reply's end and on shutdown (none)."""
        ...


class LiveReply(Protocol):
    """What a reply being produced in this process offers the followers of its log."""

    followers: list[Watcher]
    sinks: list[Sink]

    @property
    def live(self) -> bool:
        """Begun and not yet ended."""
        ...

    @property
    def last_seq(self) -> int:
        """The number of the last event logged so far."""
        ...

    def reader_joined(self) -> None: ...

    def reader_left(self, reason: Literal["slow_client", "client_gone"]) -> None: ...

    def consumed(self, upto: int) -> None:
        """A follower has sent everything up to ``upto``."""
        ...

    def reader_fell_behind(self) -> None:
        """A follower is past the slow-client limit (its producer may stop now)."""
        ...


class Readers(Protocol):
    """Every follower of this process, for shutdown."""

    shutting_down: bool

    def add_reader(self, follower: Follower) -> None: ...

    def forget_reader(self, follower: Follower) -> None: ...


class SendRecord(Protocol):
    """Where a reply counts what its followers send."""

    reason: str  # why the reply ended as it did ("" until it has)

    def on_send(self, nbytes: int, events: int) -> None: ...


class ResumePlace(NamedTuple):
    """How a resuming reader named its place: the parameter, and how far its numbers sit
    below the log's ids (a Responses ``starting_after`` counts from 0: 1), so that what is
    said of the place quotes the reader's own number."""

    param: str = "last_event_id"
    below: int = 0


BY_EVENT_ID = ResumePlace()  # ``Last-Event-ID`` or ``last_event_id``: the log's own ids


class _Cut(Exception):
    def __init__(self, ending: Ending, detail: str) -> None:
        super().__init__(detail)
        self.ending = ending


class Follower:
    """One client following one reply's log, through one transport."""

    # Thousands are open at once: slots, no instance dict.
    __slots__ = (
        "_broken",
        "_deadline",
        "_in_hand",
        "_latest",
        "_place",
        "_started_after",
        "_woken",
        "clock",
        "cursor",
        "ending",
        "lag_limit",
        "last_write",
        "log_end",
        "overflow",
        "policy",
        "readers",
        "record",
        "reply",
        "reply_id",
        "transport",
    )

    def __init__(
        self,
        *,
        reply_id: str,
        cursor: LogCursor,
        transport: FrameTransport,
        policy: DeliveryPolicy,
        readers: Readers,
        clock: KeepaliveClock,
        reply: LiveReply | None,
        record: SendRecord,
        place: ResumePlace = BY_EVENT_ID,
    ) -> None:
        self.reply_id = reply_id
        self.cursor = cursor  # this follower's place in the log, from the reply's store
        self._started_after = cursor.after  # the reader's resume point (0: from the start)
        self._place = place  # how the reader named it
        self.transport = transport
        self.policy = policy
        self.readers = readers
        self.clock = clock  # wakes this follower for a keep-alive while it waits directly
        self.reply = reply  # the producer, when it runs in this process
        self.record = record  # where to count what is sent (the producer's record)
        self.last_write = 0.0
        # Cut past this many bytes of backlog: ``slow_client_bytes`` plus the backlog before
        # its first write of entries, lowered before each write to ``slow_client_bytes`` past
        # the backlog then (``_allow``), and ``slow_client_bytes`` alone once it has caught up
        # (``_go_direct``). One attribute, so the producer's checks (``push``, ``interrupt``)
        # cost what a fixed limit would.
        self.lag_limit = NOT_SENDING_YET
        # Not counted as the backlog the limit is for: the bytes of entries in hand, read from
        # the log and not yet sent, and of the producer's latest append, when it came while
        # this follower was writing (it has had no chance to take them yet); for a reply made
        # elsewhere, the log's latest write, as its cursor tells it while it writes.
        self._in_hand = 0
        self._latest = 0
        self.overflow = False
        self._woken: asyncio.Future[None] | None = None  # while direct: done when there is work
        self._deadline: asyncio.Timeout | None = None
        self._broken: Exception | None = None  # a failure on the direct path, for the task
        # How it ended, once it has (for its request's access-log line), and, when it sent the
        # reply's end, the log's terminal entry (``ReplayStore.end``: the reply's outcome).
        self.ending: Ending | None = None
        self.log_end: str | None = None

    def interrupt(self, appended: list[LogEntry] | None = None) -> None:
        """Called on every append (``appended``: its entries) while this follower may be
        blocked, and at the reply's end and on shutdown (none)."""
        deadline = self._deadline
        if deadline is None or deadline.expired():
            return
        if not self.readers.shutting_down:
            if appended:
                self._latest = entries_bytes(appended)
            if self._unsent() <= self.lag_limit:
                return
            self.overflow = True
        deadline.reschedule(asyncio.get_running_loop().time())

    def _unsent(self) -> int:
        """The backlog the byte limit judges: the log after this follower's place, less what
        it has in hand and the producer's latest append (``_in_hand``, ``_latest``)."""
        return self.cursor.lag_bytes() - self._in_hand - self._latest

    def _behind(self) -> _Cut:
        return _Cut("slow_client", f"more than {self.lag_limit} bytes behind")

    async def _send(self, data: bytes, events: int, *, last: bool = False) -> None:
        if self.overflow:
            raise self._behind()
        if self.transport.takes_at_once(len(data)):
            sent = await self.transport.write(data, last=last)  # cannot wait: no deadline
        else:
            try:
                sent = await self._write_within_deadline(data, last)
            except _Cut:
                # Cut while its socket drained: the bytes were handed to it and leave before
                # the cut's notice, so the reader reads them. Counted as sent, as they are.
                self.record.on_send(len(data), events)
                raise
        self.last_write = time.monotonic()
        self.record.on_send(sent, events)

    async def _write_within_deadline(self, data: bytes, last: bool) -> int:
        try:
            async with asyncio.timeout(self.policy.slow_client_s) as deadline:
                self._deadline = deadline
                if self.reply is None:
                    return await self._write_measuring_lag(data, last)
                return await self.transport.write(data, last=last)
        except TimeoutError:
            if self.readers.shutting_down:
                raise _Cut("shutdown", "the server is shutting down") from None
            if self.overflow:
                raise self._behind() from None
            raise _Cut(
                "slow_client", f"socket did not drain for {self.policy.slow_client_s:g} s"
            ) from None
        finally:
            self._deadline = None

    async def _write_measuring_lag(self, data: bytes, last: bool) -> int:
        """A write of a follower whose reply is made elsewhere (or has ended): no append will
        interrupt it, so while it waits it asks its cursor how far behind it is, and is cut
        past the byte limit as a follower of a local reply would be, its latest append being
        the log's latest write."""
        write = asyncio.ensure_future(self.transport.write(data, last=last))
        try:
            while not write.done():
                await asyncio.wait((write,), timeout=LIVENESS_POLL_S)
                if write.done():
                    break
                lag = await self.cursor.measure()
                # As far as it is not in hand (a read may have taken it).
                self._latest = min(lag.latest, max(0, lag.behind - self._in_hand))
                if self._unsent() > self.lag_limit:
                    self.overflow = True
                    raise self._behind()
            return write.result()
        finally:
            drop_task(write)

    def _notice(
        self, message: str, code: str, *, param: str | None = None, after: int | None = None
    ) -> bytes:
        """An error the reader decides; ``param``: the request's parameter at fault (the
        reply itself did not fail); ``after``: the last event it follows (the reader's)."""
        error = {"message": message, "code": code}
        if param is not None:
            error["param"] = param
        data = json.dumps({"error": error})
        return self.transport.notice("error", data, self.cursor.after if after is None else after)

    async def run(self) -> None:
        """Open the transport, then follow the log to its end (or until cut).

        One frame for the whole stream: thousands of followers are in it at once."""
        self.readers.add_reader(self)
        reply = self.reply
        if reply is not None:
            reply.followers.append(self)
            reply.reader_joined()
        ending: Ending = "client_gone"
        try:
            await self.transport.open(
                with_first_events=reply is not None and reply.last_seq > self.cursor.after
            )
            keepalive = self.policy.keepalive_s
            self.last_write = time.monotonic()
            while True:
                # A reader of a reply made elsewhere awaits Redis commands, in which the one
                # cancel of its client's disconnect can be lost: it would follow on until
                # its next write (a keep-alive, the next event, or the end).
                end_if_cancelled()
                if self.readers.shutting_down and reply is None:
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
                    if self._broken is not None:
                        raise self._broken
                    wait = 0.0  # whatever woke us, look at the log now
                found = await self._catch_up(max(0.0, wait))
                if found is not None:
                    ending = found
                    break
            await self.transport.end()
        except _Cut as cut:
            ending = cut.ending
            if cut.ending == "slow_client":
                self.record.reason = str(cut)
            log.info("follower of %s cut: %s", self.reply_id[:8], cut)
            self._say_last(self._notice(str(cut), cut.ending), cut.ending)
        except ConnectionError:
            ending = "client_gone"
        except Exception as exc:  # a bug of ours (or a store failing in a way it should not)
            ending = "failed"
            log.error("follower of %s failed", self.reply_id[:8], exc_info=exc)
            self._say_last(self._notice("internal error", "internal_error"), ending)
        finally:
            self.cursor.close()
            self.readers.forget_reader(self)
            if reply is not None:
                reply.followers.remove(self)
                reply.reader_left("slow_client" if ending == "slow_client" else "client_gone")
            self.ending = ending
            self.transport.finished(ending)

    def _say_last(self, notice: bytes, ending: Ending) -> None:
        """The notice that ends a cut stream, queued and counted as sent, as any event is."""
        said = self.transport.last_words(notice, ending)
        if said:
            self.record.on_send(said, 1)

    async def _catch_up(self, wait_s: float) -> Ending | None:
        """Send what the log has after the cursor (waiting up to ``wait_s`` for something),
        or a keep-alive if nothing came and one is due; how the follower ended, if it did.

        Its own frame, so what it read is not held while the follower waits for more."""
        try:
            result = await self.cursor.read(wait_s)
            gone = await self.cursor.gone() if result is None else None
        except StoreUnavailable as exc:
            log.warning("follower of %s: %s", self.reply_id[:8], exc)
            await self._send(self._notice(exc.describe(), exc.code), 1, last=True)
            return "store_unavailable"
        if result is None:
            if gone is None:  # the store knows nothing of it any more: it expired
                notice = self._notice("the reply expired while being read", "expired")
                ending: Ending = "expired"
            elif gone.reason == "deleted":
                notice = self._notice("the reply was deleted while being read", "deleted")
                ending = "deleted"
            else:
                notice = self._notice(gone.detail, REPLY_EVICTED)
                ending = "evicted"
            await self._send(notice, 1, last=True)
            return ending
        if result.lost is not None:
            first, last = result.lost
            if not self.transport.tells_gaps():
                message = (
                    f"events {first} to {last} of this reply are no longer kept, so the rest "
                    "of it would have a hole: the stream ends here"
                )
                # INFO, as a slow client's cut: any reader may ask for events no longer
                # kept, as often as it likes; that is no fault of the server's.
                log.info("follower of %s: %s", self.reply_id[:8], message)
                await self._send(self._notice(message, EVENTS_LOST), 1, last=True)
                return "events_lost"
            gap = f'{{"lost_from": {first:d}, "lost_to": {last:d}}}'
            await self._send(self.transport.notice("gap", gap, self.cursor.after), 1)
            # Told once: the reader's place moves past what can never be sent, or a log with
            # nothing kept after the gap yet would answer the next read with it again, at once.
            self.cursor.sent(last, 0)
        await self._send_entries(result.entries, last=result.ending is not None)
        if result.ending is not None:
            self.log_end = result.ending
            last_seq = result.last_seq
            if last_seq is not None and self.cursor.after == self._started_after > last_seq:
                # It ended before the reader's place (a place past the end of a reply made
                # elsewhere, followed while it was live): said, not an empty body, in the
                # reader's own numbers (as the 400 a resume here would have had). A reader
                # placed at its last event had it all: its stream just ends, and a resume
                # from there is the 409 that says the reply ended.
                param, below = self._place
                message = (
                    f"{param} {self._started_after - below} is past this reply's last event "
                    f"({last_seq - below})"
                )
                notice = self._notice(message, "invalid_value", param=param, after=last_seq)
                await self._send(notice, 1, last=True)
            return "ended"
        if result.producer_lost:
            message = "the replica generating this reply is gone"
            await self._send(self._notice(message, "generator_lost"), 1, last=True)
            return "producer_lost"
        keepalive = self.policy.keepalive_s
        idle_for = time.monotonic() - self.last_write
        if not result.entries and keepalive is not None and idle_for >= keepalive:
            frame = self.transport.keepalive(first=self.cursor.after == 0)
            if frame is not None:
                await self._send(frame, 0)
            else:
                self.last_write = time.monotonic()
        return None

    async def _send_entries(self, entries: list[LogEntry], *, last: bool = False) -> None:
        """Write log entries in writes of about WRITE_CHUNK bytes, each waiting to drain; a
        follower further behind than its byte limit is cut instead. ``last``: these end the
        reply, and the end of the stream goes with them."""
        if not entries:
            return
        start = 0
        size = 0
        self._in_hand = entries_bytes(entries)
        # The latest append, as far as it is not in hand now: a read takes it (a read of a
        # log kept elsewhere may stop short of it, taking a batch at a time).
        self._latest = min(self._latest, max(0, self.cursor.lag_bytes() - self._in_hand))
        try:
            for index, entry in enumerate(entries):
                size += data_bytes(entry.data)
                if size >= WRITE_CHUNK or index == len(entries) - 1:
                    behind = self._unsent()
                    if self.overflow or behind > self.lag_limit:
                        raise self._behind()
                    self._allow(behind)  # at its first write: the backlog it starts with
                    # Several events in one write: fewer syscalls for a replay.
                    batch = entries[start : index + 1]
                    final = last and index == len(entries) - 1
                    await self._send(self.transport.encode(batch), len(batch), last=final)
                    self.cursor.sent(entry.seq, size)
                    self._in_hand -= size  # the backlog beyond it is as it was, or more
                    start, size = index + 1, 0
        finally:
            self._in_hand = 0
        if self.reply is not None:
            self.reply.consumed(self.cursor.after)

    def _allow(self, lag: int) -> None:
        """Lower the byte limit to ``slow_client_bytes`` past a backlog of ``lag``, if that is
        less: the limit is ``slow_client_bytes`` past the smallest backlog this follower has
        had. A reader that starts behind (a resume, a late join) may send the backlog it asked
        for, an allowance that shrinks as it catches up; only falling more than
        ``slow_client_bytes`` further behind cuts it."""
        allowed = lag + self.policy.slow_client_bytes
        if allowed < self.lag_limit:
            self.lag_limit = allowed

    # The direct path.

    def _can_go_direct(self) -> bool:
        reply = self.reply
        return (
            reply is not None
            and reply.live
            and reply.last_seq == self.cursor.after
            and self.transport.has_room()
        )

    def _go_direct(self) -> asyncio.Future[None]:
        """Become the reply's sink; the future is done when this follower's task has work
        again: the producer needs it (a busy socket, the end) or a keep-alive is due.
        Awaiting one future, not a loop in a coroutine: thousands of followers wait here."""
        assert self.reply is not None
        self.reply.sinks.append(self)
        # Caught up: whatever backlog it started with is sent, so the plain limit holds.
        self.lag_limit = self.policy.slow_client_bytes
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
        cursor = self.cursor
        sent = None
        if entries[0].seq == cursor.after + 1:
            try:
                sent = self.transport.push(entries)
            except Exception as exc:  # a bug of ours: it ends this follower, not the producer
                self._broken = exc
                self.wake()
                return
        if sent is None:
            # The socket is not keeping up. Past the slow-client limit this follower is done
            # for; say so now, so the producer stops in this tick rather than after it. These
            # entries are in hand, as a read's are: what was behind before them counts.
            if not self.overflow and cursor.lag_bytes() - entries_bytes(entries) > self.lag_limit:
                self.overflow = True
                if self.reply is not None:
                    self.reply.reader_fell_behind()
            self.wake()
            return
        if len(entries) == 1:  # the common case, spelt out: ``data_bytes`` without a call
            data = entries[0].data
            size = len(data) if data.isascii() else len(data.encode())
        else:
            size = entries_bytes(entries)
        cursor.sent(entries[-1].seq, size)
        self.last_write = time.monotonic()
        self.record.on_send(sent, len(entries))
        if self.reply is not None:
            self.reply.consumed(cursor.after)

    def wake(self) -> None:
        """Hand the work back to the follower's task (the reply ended, or it must wait)."""
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)
