"""The reply log: every event of a reply, numbered, kept so readers can replay and resume.

Generation appends to the log; readers (the connection that started the reply, or any later
one carrying ``Last-Event-ID``) read from it: everything after the id they hold, then the live
tail until the reply's terminal entry. ``ReplayStore`` is the seam; ``MemoryReplayStore``
serves one process, ``replystream.delivery.redis_store.RedisReplayStore`` many replicas.
Both pass the same contract tests (``tests/test_replay_contract.py``).

Rules every store keeps:
1. Entries of a reply have consecutive sequence numbers starting at 1; ``append`` never waits.
2. A reader asking for entries after ``n`` gets them in order; if some are no longer kept it
   is told which (``lost``), never silently skipped.
3. A reply's terminal entry (its ending) is read after every entry; then the reader stops.
4. A reply without an ending whose producer stopped refreshing its liveness is reported as
   ``producer_lost`` once its entries are read, so no reader hangs on a dead replica.
5. A reply is kept while live and for ``ttl_after_end_s`` after its ending; then it is gone
   (``read``, ``info`` and ``tail`` return None), as is a reply id that never existed.
   Why a reply it once had is gone, when that was not its expiry, the store tells (``gone``):
   deleted (for at least ``DELETED_TOLD_S``), or evicted. A cursor of this process's memory
   that was reading an ended reply as it expired reads it on to its end (the TTL bounds
   finding a reply, not a read under way); deleted or discarded, its log is gone for it too.
6. ``tail`` tells the last event's sequence number and whether the reply has ended; once it
   says ended, every event up to that number can be read (so a resume past it is a mistake).
This file must not know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple, Protocol

# How long a finished reply can still be read, unless the server says otherwise (every store's
# default, and ``replystream serve --reply-ttl-s``'s).
TTL_AFTER_END_S = 600.0
# How long a shared store may be unreachable (a Redis Sentinel failover takes its
# down-after-milliseconds and an election) before readers are told and producers stop; its
# failed commands are retried meanwhile, unless the server says otherwise
# (``serve --redis-failover-s``).
FAILOVER_S = 10.0
# What a reply's log keeps at most: its newest entries, this many, and no more than this many
# bytes of them (the byte bound binds only on huge events: an upstream streaming deltas of a
# mebibyte with no token limit asked; a reply of text stays far below it).
MAX_LOG_ENTRIES = 10_000
MAX_LOG_BYTES = 32 << 20
# How long a store still tells a deleted reply as deleted (``gone``), at least: long enough
# for every reader following it to find it gone and say why. The memory store remembers no
# more than ``DELETED_TOLD_MAX`` such ids (the oldest forgotten first): a few hundred kB.
DELETED_TOLD_S = 60.0
DELETED_TOLD_MAX = 10_000
# The memory store frees expired logs and forgets old deletes on a timer, at most this often.
SWEEP_EVERY_S = 1.0


class StoreUnavailable(Exception):
    """The store cannot take or serve replies right now (e.g. Redis is down).

    Every transport tells its client the same thing: ``code`` and ``describe()``."""

    code: ClassVar[str] = "replay_store_unavailable"

    def describe(self) -> str:
        """What a client is told: the reply store failed, not the reply (not reached, or
        refusing writes: a Redis at its ``maxmemory``)."""
        return f"the reply store is unavailable: {self}"


class LogEntry(NamedTuple):
    """One event of a reply, as data: its number, its type (None: a plain message) and its
    data (one JSON text, or a dialect's marker such as ``[DONE]``). Each transport writes it
    in its own framing (an SSE event, a WebSocket message); the log never holds wire bytes.
    A log's size in bytes, by which readers measure their lag, is the size of its data in
    UTF-8 (``data_bytes``), as a transport writes it.

    A NamedTuple (immutable, and cheap to make: one is made per event)."""

    seq: int
    event: str | None
    data: str


def data_bytes(data: str) -> int:
    """The size of an entry's data in UTF-8 bytes, as it goes on the wire. Every dialect
    writes its JSON with non-ASCII escaped, so this is nearly always its length, which
    ``isascii`` tells without reading it (a flag of the string); only other text is encoded."""
    return len(data) if data.isascii() else len(data.encode())


def entries_bytes(entries: Sequence[LogEntry]) -> int:
    """The size of entries' data in UTF-8 bytes (``data_bytes`` of each)."""
    size = 0
    for entry in entries:  # a plain loop, ``data_bytes`` inline: a log's trims run it per event
        data = entry.data
        size += len(data) if data.isascii() else len(data.encode())
    return size


@dataclass(frozen=True, slots=True)
class ReplyInfo:
    """What a store keeps about a reply besides its events."""

    reply_id: str
    owner: str = ""  # a digest of the API key that started it ("" with auth off)
    context: str = ""  # what the reply's route keeps with it (the Responses API: its input)
    # The dialect its events are in, for what a reader decides when its log holds no event
    # to tell it by (the Messages route logs nothing until the first token; a reply nobody
    # may resume drops what its reader was sent): every route's but the native one's; "":
    # told by the first event.
    dialect: str = ""
    # The keep-alive interval its request asked for (``keepalive_s``), which every reader of
    # it keeps, a resume on any replica too: a client asks a short one because something on
    # its way drops an idle connection sooner than the server's default, and its resume
    # crosses the same way. None: none asked; a reader keeps its server's ``--keepalive-s``.
    keepalive_s: float | None = None


@dataclass(frozen=True, slots=True)
class Gone:
    """Why a store no longer has a reply it had, when that was not its expiry: ``deleted``
    (``ReplayStore.delete``, on any replica), or ``evicted`` (a ``maxmemory`` Redis dropped
    part of it); ``detail`` says it in a sentence."""

    reason: Literal["deleted", "evicted"]
    detail: str


DELETED = Gone("deleted", "this reply was deleted")


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The outcome of one read: entries after the asked id, and what is known beyond them."""

    entries: list[LogEntry]
    lost: tuple[int, int] | None = None  # (first, last) sequence numbers no longer kept
    ending: str | None = None  # set once every entry has been read and the reply has ended
    producer_lost: bool = False  # no ending, and its producer stopped refreshing liveness
    last_seq: int | None = None  # with ``ending``: the reply's last event (None: not known)


@dataclass(frozen=True, slots=True)
class LogTail:
    """Where a reply's log stands: its last event's sequence number (0: none yet), and
    whether its ending has been written (then no event will follow)."""

    last_seq: int
    ended: bool


@dataclass(frozen=True, slots=True)
class ReplayStats:
    replies: int
    live: int
    entries: int
    bytes: int
    # Reads of a reader (through a cursor) that found events it needed no longer kept: it is
    # told (a gap). The server's own reads of a log (to find a reply, to answer an object)
    # tell nobody, and count none.
    gaps: int = 0
    # A remote store that lost writes it had acknowledged (a failover): how often that was
    # found, the reply logs repaired from their producer's copy, the events written again,
    # and those the producer no longer held (holes: their readers are told of a gap).
    lost_writes: int = 0
    repairs: int = 0
    repaired_events: int = 0
    holes: int = 0
    # Times a reply's keys were found evicted by a ``maxmemory`` Redis: its log gone behind
    # its ending (told as a gap), its metadata gone behind its log (a 410, or written again
    # by its live producer).
    evictions: int = 0


class Lag(NamedTuple):
    """How far a reader is behind its reply's log, in bytes of data: all of it
    (``behind``), and of that, what the log's latest write added (``latest``: a producer's
    one append, as its store wrote it)."""

    behind: int
    latest: int


class LogCursor(Protocol):
    """One reader's place in one reply's log, handed out by the reply's store.

    What a reader needs from a log, whichever store keeps it: the entries after its place,
    moving its place on as it sends them, and how far behind the log it is in bytes (the
    slow-client limit), for a reply produced on this replica or on another."""

    after: int  # the last event id this reader has sent (or started after)

    async def read(self, wait_s: float) -> ReadResult | None:
        """Entries after ``after`` (waiting up to ``wait_s`` for some); None for an unknown
        or expired reply. Does not move ``after``. Raises ``StoreUnavailable``."""
        ...

    async def gone(self) -> Gone | None:
        """Why the reply is gone, once ``read`` returned None (``ReplayStore.gone``).
        Raises ``StoreUnavailable``."""
        ...

    def sent(self, upto: int, log_bytes: int) -> None:
        """The reader has sent the entries up to ``upto``: ``log_bytes`` of their data."""
        ...

    def lag_bytes(self) -> int:
        """Bytes of entries logged after ``after`` (as far as the last read knew, for a reply
        produced elsewhere)."""
        ...

    async def measure(self) -> Lag:
        """``lag_bytes`` as the store knows it now (a reply produced elsewhere is asked
        about; one produced here is already known), with the part of it the log's latest
        write added. Raises ``StoreUnavailable``."""
        ...

    def close(self) -> None:
        """The reader is done with this place (its stream ended, however it ended): a
        reply produced elsewhere no longer counts it among its readers."""
        ...


@dataclass(frozen=True, slots=True)
class FirstContact:
    """What a shared store's server answered when first asked (``ReplayStore.first_contact``):
    ``refused`` when it will not take this server's commands however long it is waited for (a
    password, a user's rights), else it cannot be reached now; ``why`` says what it said."""

    refused: bool
    why: str


class ReplayStore(Protocol):
    name: str
    # Whether other processes (replicas, the workers of ``--workers``) read its replies.
    shared: bool
    # How long after a reader on another replica starts reading its producer may be the last
    # to know (0: every reader is the producer's own): a detach grace waits that much more.
    readers_elsewhere_seen_within_s: float

    async def first_contact(self) -> FirstContact | None:
        """Whether the store takes this server's commands, asked once before serving, on a
        connection of its own (from any event loop); None when it does (a store in this
        process always does). A shared store's server may refuse them for good (a wrong
        password, a user without a command the store sends) or not be reachable yet."""
        ...

    async def create(self, info: ReplyInfo) -> None:
        """Start a reply's log (live). Raises ``StoreUnavailable``."""
        ...

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        """Add entries in order; never waits (a remote store sends them in the background).
        A reply deleted while it is produced takes none (its producer is being stopped)."""
        ...

    def end(self, reply_id: str, ending: str) -> None:
        """Write the terminal entry; the reply is kept for ``ttl_after_end_s`` from now."""
        ...

    def failure(self, reply_id: str) -> str | None:
        """Why appends to this reply are failing, if they are (the producer should stop)."""
        ...

    async def info(self, reply_id: str) -> ReplyInfo | None: ...

    async def gone(self, reply_id: str) -> Gone | None:
        """Why a reply ``info`` or ``read`` does not find is gone, when the store knows it
        existed: deleted (told for at least ``DELETED_TOLD_S`` after the delete, whichever
        replica made it), or evicted (a ``maxmemory`` Redis lost part of it); None when it
        knows nothing of it (unknown, or expired). Raises ``StoreUnavailable``."""
        ...

    async def tail(self, reply_id: str) -> LogTail | None:
        """Where the reply's log stands; None for an unknown or expired reply.

        Raises ``StoreUnavailable``."""
        ...

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        """Entries after ``after``; if there are none yet, wait up to ``wait_s`` for some.

        Returns None for an unknown or expired reply. Raises ``StoreUnavailable``.
        """
        ...

    def cursor(self, reply_id: str, after: int) -> LogCursor:
        """A reader's place in the reply's log, just after event ``after``."""
        ...

    def release(self, reply_id: str, upto: int) -> None:
        """Entries up to ``upto`` will never be read again (a reply nobody may resume): a
        store may drop them now."""
        ...

    def discard(self, reply_id: str) -> None:
        """Forget a reply nobody may resume (it ended and its reader is done)."""
        ...

    async def delete(self, reply_id: str) -> None:
        """Remove a reply and everything kept about it, wherever it is kept, and stop it if
        it is produced (as ``request_cancel``); later reads and ``info`` find nothing, even
        while its producer, stopping, still appends. Raises ``StoreUnavailable``."""
        ...

    async def request_cancel(self, reply_id: str) -> None:
        """Ask the reply's producer, on whichever replica, to stop. Raises
        ``StoreUnavailable``."""
        ...

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        """Call ``stop(reply_id)`` when a cancel is requested (here or on another replica) for
        a reply produced in this process."""
        ...

    def on_lost(self, stop: Callable[[str], None]) -> None:
        """Call ``stop(reply_id)`` when a reply produced in this process was found lost by a
        reader on another replica, and its readers told so (``generator_lost``): this
        process stalled past its liveness (stopped, frozen, cut off) and is back. The reply
        must end as they were told, not go on. A store no other process reads never calls
        it."""
        ...

    def read_elsewhere_at(self, reply_id: str) -> float | None:
        """When (``time.monotonic()``) a reader on another replica was last found following
        a reply produced in this process, within about ``liveness_s`` of its last read; None
        if never. Its producer counts that reader as one of its own: a detached reply goes on
        while it is read anywhere."""
        ...

    def stats(self) -> ReplayStats: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True, eq=False)
class _Log:
    info: ReplyInfo
    max_entries: int
    max_bytes: int
    entries: list[LogEntry] = field(default_factory=list)
    first_seq: int = 1  # sequence number of entries[0]
    kept_from: int = 1  # the first entry the log's bounds keep (a reader's ``release`` aside)
    next_seq: int = 1
    bytes: int = 0  # bytes of the entries kept (``data_bytes``)
    appended: int = 0  # bytes of every entry ever appended (readers measure their lag by it)
    appended_before: int = 0  # ``appended`` before the latest append
    ending: str | None = None
    expires_at: float | None = None
    # Discarded or deleted (not expired): its readers stop too (``MemoryCursor.read``).
    dropped: bool = False
    # Readers waiting for more: made when the first one waits (thousands of logs are read
    # by a reader on the direct path, which never waits here); a list is lighter than a set.
    waiters: list[asyncio.Future[None]] | None = None

    def append(self, new: Sequence[LogEntry]) -> None:
        self.appended_before = self.appended
        for entry in new:
            if entry.seq != self.next_seq:
                raise ValueError(f"entry {entry.seq} out of order: expected {self.next_seq}")
            self.next_seq += 1
            data = entry.data
            size = len(data) if data.isascii() else len(data.encode())  # data_bytes, inline
            self.bytes += size
            self.appended += size
        self.entries.extend(new)
        excess = len(self.entries) - self.max_entries
        # Trim in steps of a tenth, so a long reply is not re-sliced on every append.
        if excess > self.max_entries // 10:
            self.bytes -= entries_bytes(self.entries[:excess])
            del self.entries[:excess]
            self.first_seq += excess
            self.kept_from = self.first_seq
        if self.bytes > self.max_bytes:
            self._trim_bytes()
        if self.waiters:  # most logs are read on the direct path: nobody waits here
            self.wake()

    def _trim_bytes(self) -> None:
        """Drop the oldest entries until the rest hold at most nine tenths of ``max_bytes``
        (a step, as for the count), always keeping the newest entry, however large."""
        keep = self.max_bytes - self.max_bytes // 10
        drop, size = 0, self.bytes
        last = len(self.entries) - 1
        while drop < last and size > keep:
            size -= data_bytes(self.entries[drop].data)
            drop += 1
        del self.entries[:drop]
        self.bytes = size
        self.first_seq += drop
        self.kept_from = self.first_seq

    def trim(self, upto: int) -> None:
        """Drop entries up to ``upto``."""
        if upto >= self.next_seq - 1:
            # The common case, a reader that has sent everything: nothing to count or slice.
            self.entries.clear()
            self.bytes = 0
            self.first_seq = self.next_seq
            return
        drop = upto + 1 - self.first_seq
        if drop > 0:
            self.bytes -= entries_bytes(self.entries[:drop])
            del self.entries[:drop]
            self.first_seq += drop

    def wake(self) -> None:
        if self.waiters:
            for waiter in self.waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self.waiters.clear()

    def after(self, seq: int) -> ReadResult:
        lost = None
        start = seq + 1
        if start < self.first_seq:
            lost = (start, self.first_seq - 1)
            start = self.first_seq
        # Every entry after ``start`` is returned, so the ending (if any) comes with them.
        last = self.next_seq - 1 if self.ending is not None else None
        return ReadResult(self.entries[start - self.first_seq :], lost, self.ending, last_seq=last)


class MemoryReplayStore:
    """Reply logs in this process's memory (the default for a single server).

    A reply's producer lives in the same process, so it is live until it writes its ending;
    nothing can lose it without losing the store too.
    """

    name = "memory"
    shared = False  # this process's memory
    readers_elsewhere_seen_within_s = 0.0

    def __init__(
        self,
        *,
        ttl_after_end_s: float = TTL_AFTER_END_S,
        max_entries: int = MAX_LOG_ENTRIES,
        max_bytes: int = MAX_LOG_BYTES,
    ) -> None:
        if ttl_after_end_s < 0 or max_entries < 1 or max_bytes < 1:
            raise ValueError("need ttl_after_end_s >= 0, max_entries >= 1 and max_bytes >= 1")
        self.ttl_after_end_s = ttl_after_end_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._logs: dict[str, _Log] = {}
        # Replies deleted lately, and when (oldest first), so a reader finding one gone is
        # told why (``gone``); bounded in time and in number.
        self._deleted: dict[str, float] = {}
        # The ended replies kept, and when each expires, in the order they ended (each is
        # kept as long): what expired is found without looking at every log.
        self._ending: dict[str, float] = {}
        # Frees what expired (logs, deletes told) whether or not anything is asked of the
        # store: a server gone quiet would otherwise keep its last busy hour's replies.
        self._sweeper: asyncio.TimerHandle | None = None
        self._gaps = 0
        self._on_cancel: Callable[[str], None] = _no_producer

    async def first_contact(self) -> FirstContact | None:
        return None  # in this process: nothing to ask

    async def create(self, info: ReplyInfo) -> None:
        if info.reply_id in self._logs:
            raise ValueError(f"reply {info.reply_id} exists")
        self._deleted.pop(info.reply_id, None)
        self._logs[info.reply_id] = _Log(info, self.max_entries, self.max_bytes)

    def _log(self, reply_id: str) -> _Log | None:
        log = self._logs.get(reply_id)
        if log is not None and log.expires_at is not None and time.monotonic() >= log.expires_at:
            del self._logs[reply_id]
            self._ending.pop(reply_id, None)
            return None
        return log

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        log = self._logs.get(reply_id)
        if log is None:
            return  # deleted while its producer winds down
        if log.ending is not None:
            raise KeyError(f"reply {reply_id} has ended")
        log.append(entries)

    def end(self, reply_id: str, ending: str) -> None:
        log = self._logs.get(reply_id)
        if log is None or log.ending is not None:
            return
        log.ending = ending
        log.expires_at = time.monotonic() + self.ttl_after_end_s
        self._ending[reply_id] = log.expires_at
        self._sweep_later()
        log.wake()

    def failure(self, reply_id: str) -> str | None:
        return None

    async def info(self, reply_id: str) -> ReplyInfo | None:
        log = self._log(reply_id)
        return None if log is None else log.info

    async def gone(self, reply_id: str) -> Gone | None:
        # Nothing is evicted from this process's memory: logs expire, or are deleted.
        self._forget_old_deletes()
        return DELETED if reply_id in self._deleted else None

    async def tail(self, reply_id: str) -> LogTail | None:
        log = self._log(reply_id)
        return None if log is None else LogTail(log.next_seq - 1, log.ending is not None)

    def kept_from(self, reply_id: str) -> int:
        """The first entry of a reply the log's bounds keep (1: all so far, or no such reply);
        a shared store keeps the same, whatever readers released here."""
        log = self._logs.get(reply_id)
        return 1 if log is None else log.kept_from

    def release(self, reply_id: str, upto: int) -> None:
        """Entries up to ``upto`` will never be read again (a reply nobody may resume)."""
        log = self._logs.get(reply_id)
        if log is not None:
            log.trim(upto)

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        log = self._log(reply_id)
        if log is None:
            return None
        result = log.after(after)
        if result.entries or result.lost or result.ending is not None or wait_s <= 0:
            return result
        waiter = asyncio.get_running_loop().create_future()
        if log.waiters is None:
            log.waiters = []
        log.waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await waiter
        finally:
            if waiter in log.waiters:  # wake() empties the list
                log.waiters.remove(waiter)
        return log.after(after)

    async def request_cancel(self, reply_id: str) -> None:
        log = self._log(reply_id)
        if log is not None and log.ending is None:
            self._on_cancel(reply_id)

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        self._on_cancel = stop

    def on_lost(self, stop: Callable[[str], None]) -> None:
        pass  # no reader elsewhere: nobody but this process can call its producer lost

    def read_elsewhere_at(self, reply_id: str) -> float | None:
        return None  # one process: every reader of a reply is its producer's own

    def cursor(self, reply_id: str, after: int) -> MemoryCursor:
        return MemoryCursor(self, reply_id, after)

    async def delete(self, reply_id: str) -> None:
        await self.request_cancel(reply_id)
        self.discard_deleted(reply_id)

    def discard_deleted(self, reply_id: str) -> None:
        """Forget a reply that was deleted (here, or heard of from another replica),
        remembering for ``DELETED_TOLD_S`` that it was: its readers, woken, are told why."""
        self._deleted.pop(reply_id, None)  # deleted again: its time is now's
        self._deleted[reply_id] = time.monotonic()
        self._forget_old_deletes()
        self._sweep_later()
        self.discard(reply_id)

    def _forget_old_deletes(self) -> None:
        deleted = self._deleted
        if not deleted:
            return
        old = time.monotonic() - DELETED_TOLD_S
        while deleted:
            reply_id, at = next(iter(deleted.items()))
            if at > old and len(deleted) <= DELETED_TOLD_MAX:
                break
            del deleted[reply_id]

    def discard(self, reply_id: str) -> None:
        """Forget a reply at once (one nobody may resume)."""
        log = self._logs.pop(reply_id, None)
        if log is not None:
            self._ending.pop(reply_id, None)
            log.dropped = True
            log.wake()

    def _sweep_later(self) -> None:
        """Arm the sweep for the first thing due to go (a log's expiry, a delete no longer
        told), no sooner than ``SWEEP_EVERY_S`` from now: one timer for them all, and at most
        one sweep that often however many replies end."""
        if self._sweeper is not None:
            return
        due = [next(iter(self._ending.values()))] if self._ending else []
        if self._deleted:
            due.append(next(iter(self._deleted.values())) + DELETED_TOLD_S)
        if not due:
            return
        wait = max(min(due) - time.monotonic(), SWEEP_EVERY_S)
        self._sweeper = asyncio.get_running_loop().call_later(wait, self._swept)

    def _swept(self) -> None:
        self._sweeper = None
        self._drop_expired()
        self._forget_old_deletes()
        self._sweep_later()

    def _drop_expired(self) -> None:
        # Expired replies go when touched, on the sweep, and on every ``stats`` (a quiet
        # server's metrics must not count logs that have expired).
        now, expired = time.monotonic(), []
        for reply_id, at in self._ending.items():
            if at > now:
                break
            expired.append(reply_id)
        for reply_id in expired:
            del self._ending[reply_id]
            self._logs.pop(reply_id, None)

    def stats(self) -> ReplayStats:
        self._drop_expired()
        logs = self._logs.values()
        return ReplayStats(
            replies=len(self._logs),
            live=sum(1 for log in logs if log.ending is None),
            entries=sum(len(log.entries) for log in logs),
            bytes=sum(log.bytes for log in logs),
            gaps=self._gaps,
        )

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for log in self._logs.values():
            log.dropped = True
            log.wake()
        self._logs.clear()
        self._deleted.clear()
        self._ending.clear()


def _no_producer(reply_id: str) -> None:
    """Until the server says how to stop its producers, a cancel has nobody to reach."""


class MemoryCursor:
    """A reader's place in a log of this process: its lag is exact, counted against every
    byte the log was ever given."""

    __slots__ = ("_log", "_sent_bytes", "_store", "after", "reply_id")

    def __init__(self, store: MemoryReplayStore, reply_id: str, after: int) -> None:
        self._store = store
        self.reply_id = reply_id
        self.after = after
        log = store._logs.get(reply_id)
        self._log = log
        # Bytes up to ``after``: everything appended but what is kept after it.
        self._sent_bytes = 0
        if log is not None:
            start = max(0, after + 1 - log.first_seq)
            self._sent_bytes = log.appended - entries_bytes(log.entries[start:])

    async def read(self, wait_s: float) -> ReadResult | None:
        result = await self._store.read(self.reply_id, self.after, wait_s)
        log = self._log
        if result is None and log is not None and log.ending is not None and not log.dropped:
            # Expired under this reader: the TTL bounds how long an ended reply can be found
            # (resumed, retrieved), not a read under way, whose client would lose the end of
            # a reply it is being sent (one slow to take it, within the slow-client limits).
            result = log.after(self.after)
        if result is not None and result.lost is not None:
            self._store._gaps += 1  # a reader's read: it is told of them
        return result

    async def gone(self) -> Gone | None:
        return await self._store.gone(self.reply_id)

    def sent(self, upto: int, log_bytes: int) -> None:
        self.after = upto
        self._sent_bytes += log_bytes

    def lag_bytes(self) -> int:
        log = self._log
        return 0 if log is None else log.appended - self._sent_bytes

    async def measure(self) -> Lag:
        log = self._log
        lag = self.lag_bytes()
        return Lag(lag, 0 if log is None else min(lag, log.appended - log.appended_before))

    def close(self) -> None:
        """Nothing to tell: the reply's producer here counts its own readers."""
