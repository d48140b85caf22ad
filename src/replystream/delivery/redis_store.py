"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix; ``{id}`` is the reply id in braces, a Redis
Cluster hash tag, so all of a reply's keys share one hash slot and one shard):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one event (its type in field ``e``, empty for a
  plain message; its data in ``d``) and the log's size in bytes up to and including it
  (field ``b``: a reader on another replica measures its lag by it); the terminal entry
  holds the ending (field ``end``). Trimmed to about ``max_entries``.
- ``P{id}:meta``: a hash with the owner and the route's context, the producer's heartbeat
  count (``beat``, bumped every second while it generates) and, once the reply has ended, its
  ending and last event's number (``end``, ``last``); ``P{id}:live``: the producer's liveness
  key, set for ``liveness_s`` and refreshed every second while it generates;
  ``P{id}:cancel``: a cancel request from another replica.
Every key lives ``ttl_after_end_s`` after the reply's end (refreshed while it is live).

Eviction (a ``maxmemory`` Redis evicts whole keys, any of the four, in any order): a reader
never takes a missing key for something else. A stream gone behind an ended reply is told as
a gap up to the ``last`` its metadata keeps, then the ending (not ``generator_lost``); a
missing liveness key is confirmed by the heartbeat count before a producer is called lost;
metadata gone behind a surviving stream is reported as evicted (``evicted``). A live producer
writes its reply again from its copy when it finds its metadata gone (its heartbeat count
starts again at 1) or its stream shorter than what Redis acknowledged (the heartbeat asks its
length): until then, a stream made anew by the next append starts late, which readers are
told of as a gap. Only a reply whose every key is gone reads as unknown.

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued in one pipeline per round trip. Replies produced here are also kept in a
local ``MemoryReplayStore``, so their own readers never wait on Redis.

Failover (Redis through Sentinel, a Cluster shard, or one Redis restarted): a write or a read
that fails is retried for ``failover_s`` (the promoted replica is reached through the same
client). Meanwhile producers go on into their local copy. Redis replicates asynchronously, so
the promoted replica may lack writes the old primary acknowledged; the store finds out (a
write failed, or the count of its writes, ``INCR``-ed at the end of every pipeline, came back
short) and repairs every reply it holds from its local copy (``redis_repair``): re-appends
what Redis lost, or rewrites a stream with a hole. What it no longer holds stays a hole,
which readers see as a jump in sequence numbers and are told of (``lost``: a ``gap``).
Past ``failover_s`` a write marks its replies (``failure``), so their producers stop with an
in-band error instead of writing into a hole, and reads raise ``StoreUnavailable``;
``create`` never waits (a new reply is refused at once). This file must not know about HTTP
or event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from replystream.delivery.redis_connect import connect, parse_redis_url
from replystream.delivery.redis_repair import LocalCopy, Repair, StreamState, plan
from replystream.delivery.replay import (
    TTL_AFTER_END_S,
    LogCursor,
    LogEntry,
    LogTail,
    MemoryReplayStore,
    ReadResult,
    ReplayStats,
    ReplyInfo,
    StoreUnavailable,
)

log = logging.getLogger("replystream.redis_store")
T = TypeVar("T")

READ_BATCH = 1000
HEARTBEAT_S = 1.0
# Every command's answer must come within this: a Redis that stops answering (hung, or a
# network that drops packets) is then reported like one that is down, and no reader or
# flush waits on it for ever. A blocking read blocks for at most half of it.
COMMAND_TIMEOUT_S = 5.0
# How long a failed command is retried (a Sentinel failover takes its down-after-milliseconds
# and an election), unless the server says otherwise (``serve --redis-failover-s``).
FAILOVER_S = 10.0
RETRY_FIRST_S = 0.05  # the first retry's pause; each next one doubles, up to RETRY_MAX_S
RETRY_MAX_S = 0.5
# A reader that finds a producer's liveness key gone waits this long for its heartbeat count
# to move before calling it lost: the key may have been evicted (``volatile-ttl`` evicts the
# keys nearest their expiry first) while the producer lives.
BEAT_CONFIRM_S = 2 * HEARTBEAT_S + 0.5
# The metadata's fields a read needs: whether it is there (every reply has an owner, "" with
# auth off), and the ending and last event's number an ended reply leaves in it.
META_READ = ("owner", "end", "last")


class Offsets(NamedTuple):
    """Where a read's entries stand in the log, in bytes of data."""

    before_first: int | None  # the log's size before the first entry read (None: none read)
    logged: int | None  # the log's size so far (None: no event logged yet)


class RemoteCursor:
    """A reader's place in a reply produced on another replica. Its lag is the log's size
    at the last read, less the bytes up to the reader's place, both from the offsets every
    entry carries (``b``)."""

    __slots__ = ("_logged", "_sent_upto", "_store", "after", "reply_id")

    def __init__(self, store: RedisReplayStore, reply_id: str, after: int) -> None:
        self._store = store
        self.reply_id = reply_id
        self.after = after
        self._sent_upto: int | None = None  # bytes up to ``after``, known from the first read
        self._logged = 0

    async def read(self, wait_s: float) -> ReadResult | None:
        result, offsets = await self._store.read_measured(self.reply_id, self.after, wait_s)
        if offsets.logged is not None:
            self._logged = offsets.logged
        if offsets.before_first is not None and (
            self._sent_upto is None or (result and result.lost)
        ):
            self._sent_upto = offsets.before_first  # first read, or entries were lost
        return result

    def sent(self, upto: int, log_bytes: int) -> None:
        self.after = upto
        if self._sent_upto is not None:
            self._sent_upto += log_bytes

    def lag_bytes(self) -> int:
        return 0 if self._sent_upto is None else max(0, self._logged - self._sent_upto)

    async def measure(self) -> int:
        logged = await self._store.logged_bytes(self.reply_id)
        if logged is not None:
            self._logged = logged
        return self.lag_bytes()


def _newest_offset(newest: Any) -> int | None:
    """The log's size from its newest entries (newest first; the terminal one has none)."""
    return next((int(fields[b"b"]) for _, fields in newest or () if b"b" in fields), None)


def _text(value: bytes | str | None) -> str:
    """A hash field's value as text ("" when absent)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1])


class Meta(NamedTuple):
    """What a read learns from a reply's metadata (``META_READ``)."""

    known: bool  # the metadata is there (it may be evicted while the stream survives)
    ending: str | None  # the reply has ended so
    last: int  # its last event's number (when ended)

    @classmethod
    def of(cls, fields: Sequence[bytes | None]) -> Meta:
        owner, end, last = fields
        ending = None if end is None else end.decode()
        return cls(owner is not None, ending, int(last) if last is not None else 0)


def ended_fields(ending: str, ending_seq: int) -> Mapping[FieldT, EncodableT]:
    """What an ended reply leaves in its metadata, so a reader can tell a stream evicted
    after the end from a producer lost before it."""
    return {"end": ending, "last": ending_seq - 1}


class RedisReplayStore:
    """A ``ReplayStore`` shared by every replica that points at the same Redis."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_after_end_s: float = TTL_AFTER_END_S,
        liveness_s: float = 3.0,
        max_entries: int = 10_000,
        prefix: str = "replystream:reply:",
        connect_timeout_s: float = 2.0,
        failover_s: float = FAILOVER_S,
    ) -> None:
        self.url = url
        self.target = parse_redis_url(url)
        self.where = f"Redis at {self.target.shown}"  # errors reach clients: no credentials
        self.ttl_after_end_s = ttl_after_end_s
        self.liveness_s = liveness_s
        self.max_entries = max_entries
        self.prefix = prefix
        self.redis = connect(
            self.target, connect_timeout_s=connect_timeout_s, command_timeout_s=COMMAND_TIMEOUT_S
        )
        self._local = MemoryReplayStore(
            ttl_after_end_s=min(ttl_after_end_s, 30.0), max_entries=max_entries
        )
        self._live: set[str] = set()  # replies produced here and not ended
        self._pending: dict[str, list[LogEntry | tuple[int, str]]] = {}
        self._next_seq: dict[str, int] = {}
        self._failures: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_cancel: Callable[[str], None] | None = None
        self._logged: dict[str, int] = {}  # bytes sent to Redis per live reply: entries' offsets
        self.writes = 0  # pipelines sent (for benchmarks)
        self.failover_s = failover_s
        # Failover: replies whose log Redis may have lost part of; since when writes fail;
        # when a command last succeeded after failing (liveness keys may lag until refreshed).
        self._dirty: set[str] = set()
        self._outage_since: float | None = None
        self._recovered_at = -float("inf")
        self._flushing = asyncio.Lock()  # one pipeline at a time: their write counts in order
        # This store's count of its pipelines, in Redis: short after a failover that lost some.
        self._writes_key = f"{self.prefix}writer:{uuid.uuid4().hex}"
        self._writes_seen: int | None = None
        self._lost_writes = self._repairs = self._repaired_events = self._holes = 0
        self._gaps = 0
        self._evictions = 0

    def _key(self, reply_id: str, part: str = "") -> str:
        # The braces make the id the key's hash tag: one slot for all of a reply's keys.
        return f"{self.prefix}{{{reply_id}}}{part}"

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._flush_forever(), name="redis-store-flusher"),
                loop.create_task(self._heartbeat_forever(), name="redis-store-heartbeat"),
            ]

    async def create(self, info: ReplyInfo) -> None:
        self._ensure_tasks()
        ttl = max(1, int(self.ttl_after_end_s))
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(
                    self._key(info.reply_id, ":meta"),
                    mapping={"owner": info.owner, "context": info.context, "beat": 1},
                )
                pipe.expire(self._key(info.reply_id, ":meta"), ttl)
                pipe.set(self._key(info.reply_id, ":live"), b"1", ex=max(1, int(self.liveness_s)))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
        await self._local.create(info)
        self._live.add(info.reply_id)

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        self._local.append(reply_id, entries)
        if reply_id in self._failures:
            return
        self._pending.setdefault(reply_id, []).extend(entries)
        if entries:
            self._next_seq[reply_id] = entries[-1].seq + 1
        self._wake.set()

    def end(self, reply_id: str, ending: str) -> None:
        self._local.end(reply_id, ending)
        self._live.discard(reply_id)
        # The terminal entry takes the next sequence number.
        seq = self._next_seq.pop(reply_id, 1)
        if reply_id in self._failures:
            self._logged.pop(reply_id, None)
            return
        self._pending.setdefault(reply_id, []).append((seq, ending))
        self._wake.set()

    def failure(self, reply_id: str) -> str | None:
        return self._failures.get(reply_id)

    async def _flush_forever(self) -> None:
        pause = RETRY_FIRST_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
            if self._outage_since is None:
                pause = RETRY_FIRST_S
                continue
            # Redis is unreachable: try again soon, appends or not (ended replies need
            # their repair too), without spinning on every append.
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
            self._wake.set()

    async def flush(self) -> None:
        """Repair what Redis may have lost, then send everything queued, in one pipeline."""
        async with self._flushing:
            if self._dirty and not await self._repair():
                return
            await self._flush_queued()

    async def _flush_queued(self) -> None:
        batch, self._pending = self._pending, {}
        if not batch:
            return
        ttl = max(1, int(self.ttl_after_end_s))
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id, items in batch.items():
                    key = self._key(reply_id)
                    for item in items:
                        if isinstance(item, LogEntry):
                            # Each entry carries the log's size up to and including it, so a
                            # reader on any replica can tell how far behind it is.
                            logged = self._logged.get(reply_id, 0) + len(item.data)
                            self._logged[reply_id] = logged
                            pipe.xadd(
                                key,
                                {"e": item.event or "", "d": item.data, "b": logged},
                                id=f"0-{item.seq}",
                                maxlen=self.max_entries,
                                approximate=True,
                            )
                            continue
                        seq, ending = item
                        self._logged.pop(reply_id, None)
                        pipe.xadd(key, {"end": ending}, id=f"0-{seq}")
                        pipe.hset(self._key(reply_id, ":meta"), mapping=ended_fields(ending, seq))
                        for part in ("", ":meta", ":cancel"):
                            pipe.expire(self._key(reply_id, part), ttl)
                        pipe.delete(self._key(reply_id, ":live"))
                    pipe.expire(key, ttl)
                self._count_write(pipe)
                results = await pipe.execute()
            self.writes += 1
            self._counted(results[-2])
        except (RedisError, OSError) as exc:
            self._write_failed(exc, batch)

    # Failover: finding out what Redis lost, and writing it again.

    def _count_write(self, pipe: Any) -> None:
        """End a pipeline with this store's write count (see ``_counted``)."""
        pipe.incr(self._writes_key)
        pipe.expire(self._writes_key, max(1, int(self.ttl_after_end_s)))

    def _counted(self, count: int) -> None:
        """Redis's count of this store's pipelines, after one more. Replication is ordered,
        so a count short of ours means Redis lost pipelines it had acknowledged, and with
        them whatever they wrote: every reply held here is checked and repaired."""
        expected = None if self._writes_seen is None else self._writes_seen + 1
        self._writes_seen = count
        if expected is not None and count == 1 < expected:
            # The count itself is gone, not short: a maxmemory Redis evicted it (a failover
            # loses the whole key only if all of it was in its window: a store's first writes).
            # Writing every evicted log again would only fill Redis again: the replies still
            # being written are checked; readers of the rest are told what was evicted.
            self._evictions += 1
            log.warning("this replica's write count was evicted from Redis (maxmemory)")
            self._dirty.update(self._live)
            self._wake.set()
        elif expected is not None and count < expected:
            self._lost_writes += 1
            log.warning("Redis lost %d acknowledged writes (a failover?)", expected - count)
            self._dirty.update(self._local._logs)
            self._wake.set()

    def _write_failed(self, exc: Exception, batch: dict[str, Any]) -> None:
        """A write failed: it may or may not have landed. Every reply held here is repaired
        once Redis answers; past ``failover_s`` of failing, the live ones fail instead."""
        now = time.monotonic()
        self._writes_seen = None  # the failed pipeline's count is unknown
        self._dirty.update(batch)
        self._dirty.update(self._live)
        if self._outage_since is None:
            self._outage_since = now
            log.warning("reply log write to Redis failed (retrying %gs): %s", self.failover_s, exc)
        if now - self._outage_since < self.failover_s:
            return
        log.warning("reply log writes to Redis failed for %gs: %s", self.failover_s, exc)
        for reply_id in self._dirty:
            if reply_id in self._live:
                self._failures[reply_id] = f"Redis write failed: {exc}"
            self._pending.pop(reply_id, None)
        self._dirty.clear()
        self._outage_since = None

    def _local_copy(self, reply_id: str) -> LocalCopy | None:
        log_ = self._local._logs.get(reply_id)
        if log_ is None or reply_id in self._failures:
            return None
        entries = list(log_.entries)
        return LocalCopy(entries, log_.appended - log_.bytes, log_.ending, log_.next_seq)

    async def _repair(self) -> bool:
        """Make Redis hold what this process holds of every dirty reply; False if Redis
        cannot be reached yet."""
        copies: dict[str, LocalCopy] = {}
        for reply_id in self._dirty:
            copy = self._local_copy(reply_id)
            if copy is not None:
                copies[reply_id] = copy
                # Queued events are in the copy: the repair writes them, in order.
                self._pending.pop(reply_id, None)
        dirty = set(self._dirty)
        try:
            states = await self._stream_states(list(copies))
            repairs = {r: plan(copies[r], states[r], kept=self.max_entries) for r in copies}
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id, repair in repairs.items():
                    self._queue_repair(pipe, reply_id, repair)
                self._count_write(pipe)
                results = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._write_failed(exc, {})
            return False
        self._dirty -= dirty
        self._outage_since = None
        self._recovered_at = time.monotonic()
        self._counted(results[-2])
        done = [r for r in repairs.values() if r.action != "nothing"]
        if done:
            self._repairs += len(done)
            self._repaired_events += sum(len(r.entries) for r in done)
            self._holes += sum(r.missing for r in done)
            log.warning(
                "repaired %d reply logs: %d events Redis lacked (lost in a failover, or held "
                "back while it was unreachable), %d written, %d no longer held (a gap)",
                len(done),
                sum(r.lost for r in done),
                sum(len(r.entries) for r in done),
                sum(r.missing for r in done),
            )
        return True

    async def _stream_states(self, reply_ids: list[str]) -> dict[str, StreamState]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for reply_id in reply_ids:
                key = self._key(reply_id)
                pipe.xrange(key, min="-", max="+", count=1)
                pipe.xrevrange(key, max="+", min="-", count=1)
                pipe.xlen(key)
                # A heartbeat may have made the hash again with only its count: known means
                # the owner is there.
                pipe.hexists(self._key(reply_id, ":meta"), "owner")
            results = await pipe.execute()
        states = {}
        for n, reply_id in enumerate(reply_ids):
            first, last, length, known = results[4 * n : 4 * n + 4]
            states[reply_id] = StreamState(
                _seq(first[0][0]) if first else 0,
                _seq(last[0][0]) if last else 0,
                int(length),
                bool(known),
            )
        return states

    def _queue_repair(self, pipe: Any, reply_id: str, repair: Repair) -> None:
        if repair.action == "nothing":
            return
        ttl = max(1, int(self.ttl_after_end_s))
        key = self._key(reply_id)
        if repair.action == "rewrite":
            # Readers meanwhile find an empty stream and wait, or events after a hole: told.
            pipe.delete(key)
            info = self._local._logs[reply_id].info
            pipe.hset(
                self._key(reply_id, ":meta"), mapping={"owner": info.owner, "context": info.context}
            )
        for entry, offset in zip(repair.entries, repair.offsets, strict=True):
            pipe.xadd(
                key,
                {"e": entry.event or "", "d": entry.data, "b": offset},
                id=f"0-{entry.seq}",
                maxlen=self.max_entries,
                approximate=True,
            )
        if repair.ending is not None:
            pipe.xadd(key, {"end": repair.ending}, id=f"0-{repair.ending_seq}")
            pipe.hset(
                self._key(reply_id, ":meta"), mapping=ended_fields(repair.ending, repair.ending_seq)
            )
        elif reply_id in self._live:
            pipe.set(self._key(reply_id, ":live"), b"1", ex=max(1, int(self.liveness_s)))
            if repair.offsets:
                self._logged[reply_id] = repair.offsets[-1]
        for part in ("", ":meta"):
            pipe.expire(self._key(reply_id, part), ttl)

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, retried for ``failover_s`` while Redis cannot be reached (a
        failover: the client finds the promoted replica); then ``StoreUnavailable``."""
        deadline: float | None = None
        pause = RETRY_FIRST_S
        while True:
            try:
                result = await attempt()
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.failover_s
                if now >= deadline:
                    raise StoreUnavailable(f"{self.where}: {exc}") from exc
                await asyncio.sleep(min(pause, deadline - now))
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            if deadline is not None:
                self._recovered_at = time.monotonic()
            return result

    def _recovering(self) -> bool:
        """Whether Redis came back too recently for producers' liveness keys to be trusted
        (they are refreshed every second, and a promoted replica may hold stale ones)."""
        return time.monotonic() - self._recovered_at < self.liveness_s + 2 * HEARTBEAT_S

    async def _acknowledged(self, live: list[str]) -> dict[str, int] | None:
        """How many events of each live reply Redis has acknowledged: those appended and no
        longer queued, once no pipeline is in flight (None: one still is, after a while)."""
        try:
            async with asyncio.timeout(HEARTBEAT_S / 2), self._flushing:
                counts = {}
                for reply_id in live:
                    queued = self._pending.get(reply_id, ())
                    waiting = sum(1 for item in queued if isinstance(item, LogEntry))
                    counts[reply_id] = self._next_seq.get(reply_id, 1) - 1 - waiting
                return counts
        except TimeoutError:
            return None

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            live = list(self._live)
            if not live:
                continue
            # Taken before the pipeline below is sent: a stream shorter than this then has
            # lost events it had acknowledged (Redis evicted it, perhaps made anew since).
            written = await self._acknowledged(live)
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for reply_id in live:
                        pipe.set(
                            self._key(reply_id, ":live"), b"1", ex=max(1, int(self.liveness_s))
                        )
                        pipe.exists(self._key(reply_id, ":cancel"))
                        # Readers that find the liveness key gone watch this count move.
                        pipe.hincrby(self._key(reply_id, ":meta"), "beat", 1)
                        pipe.xlen(self._key(reply_id))
                    results = await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("liveness refresh failed: %s", exc)
                continue
            for n, reply_id in enumerate(live):
                cancelled, beat, length = results[4 * n + 1 : 4 * n + 4]
                if cancelled and self._on_cancel is not None:
                    self._on_cancel(reply_id)
                if beat == 1:
                    # The count started again: the metadata was gone (evicted, or lost in a
                    # failover). Write the reply again from this process's copy.
                    log.warning("reply %s: its metadata is gone; writing it again", reply_id[:8])
                    self._evicted_live(reply_id)
                elif self._stream_lost(reply_id, length, written):
                    log.warning("reply %s: its log is gone; writing it again", reply_id[:8])
                    self._evicted_live(reply_id)

    def _stream_lost(self, reply_id: str, length: int, written: dict[str, int] | None) -> bool:
        """Whether a live reply's stream holds fewer events than Redis acknowledged and keeps
        (it trims to about ``max_entries``, never below)."""
        if written is None or reply_id in self._dirty or self._outage_since is not None:
            return False  # unknown, or a repair is due anyway
        if reply_id in self._failures:
            return False  # stopped writing: its log is not written again
        return length < min(written.get(reply_id, 0), self.max_entries)

    def _evicted_live(self, reply_id: str) -> None:
        """A live reply lost keys to eviction: it is written again from this process's copy
        (``redis_repair``), before anything queued after it."""
        self._evictions += 1
        self._dirty.add(reply_id)
        self._wake.set()

    async def info(self, reply_id: str) -> ReplyInfo | None:
        local = await self._local.info(reply_id)
        if local is not None and reply_id in self._live:
            return local  # produced here and running: Redis has nothing newer
        meta = await self._retrying(lambda: self._meta_of(reply_id))
        if b"owner" not in meta:
            if local is not None:  # deleted on another replica: this copy goes too
                self._local.discard(reply_id)
            return None
        return ReplyInfo(
            reply_id, owner=_text(meta.get(b"owner")), context=_text(meta.get(b"context"))
        )

    async def _meta_of(self, reply_id: str) -> dict[bytes | str, bytes | str]:
        """A reply's metadata; when it is gone but its producer lives (its heartbeat writes
        it again within a second or two), after waiting for it."""
        key = self._key(reply_id, ":meta")
        meta: dict[bytes | str, bytes | str] = await self.redis.hgetall(key)
        deadline = time.monotonic() + BEAT_CONFIRM_S
        while (
            b"owner" not in meta
            and time.monotonic() < deadline
            and await self.redis.exists(self._key(reply_id, ":live"))
        ):
            await asyncio.sleep(HEARTBEAT_S / 4)
            meta = await self.redis.hgetall(key)
        return meta

    async def evicted(self, reply_id: str) -> str | None:
        async def look() -> tuple[bool, bool]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hexists(self._key(reply_id, ":meta"), "owner")
                pipe.exists(self._key(reply_id))
                known, logged = await pipe.execute()
            return bool(known), bool(logged)

        known, logged = await self._retrying(look)
        if known or not logged:
            return None
        self._evictions += 1
        return (
            "this reply's metadata is gone from Redis while its events remain (evicted under "
            "maxmemory, or lost in a failover): it can no longer be read or resumed"
        )

    async def tail(self, reply_id: str) -> LogTail | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.tail(reply_id)
        rows, fields = await self._retrying(lambda: self._remote_tail(reply_id))
        meta = Meta.of(fields)
        if not rows:
            if meta.ending is not None:  # ended, and its stream evicted since
                return LogTail(meta.last, True)
            return LogTail(0, False) if meta.known else None
        entry_id, fields = rows[0]
        if b"end" in fields:  # the terminal entry takes the number after the last event's
            return LogTail(_seq(entry_id) - 1, True)
        return LogTail(_seq(entry_id), False)

    async def _remote_tail(self, reply_id: str) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self._key(reply_id), max="+", min="-", count=1)
            pipe.hmget(self._key(reply_id, ":meta"), META_READ)
            return await pipe.execute()

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.read(reply_id, after, wait_s)
        result, _ = await self.read_measured(reply_id, after, wait_s)
        return result

    async def read_measured(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """A read of a reply produced elsewhere, with where its entries stand in bytes."""
        result, offsets = await self._retrying(lambda: self._read_waiting(reply_id, after, wait_s))
        if result is not None and result.lost is not None:
            self._gaps += 1
        return result, offsets

    async def _read_waiting(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        result, offsets = await self._read_remote(reply_id, after)
        if result is None or result.entries or result.lost or result.ending or wait_s <= 0:
            return result, offsets
        # Nothing new: block on the stream until an entry lands or the wait runs out.
        block_s = min(wait_s, COMMAND_TIMEOUT_S / 2)
        await self.redis.xread(
            {self._key(reply_id): f"0-{after}"}, count=1, block=max(1, int(block_s * 1000))
        )
        result, offsets = await self._read_remote(reply_id, after)
        if result is None or result.entries or result.ending:
            return result, offsets
        alive = self._recovering() or await self.redis.exists(self._key(reply_id, ":live"))
        if not alive:
            # Its liveness key is gone: expired (the producer died), or evicted. A live
            # producer's heartbeat count moves within a second; wait for it (or an event).
            beat = await self.redis.hget(self._key(reply_id, ":meta"), "beat")
            await self.redis.xread(
                {self._key(reply_id): f"0-{after}"}, count=1, block=int(BEAT_CONFIRM_S * 1000)
            )
            result, offsets = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.ending:
                return result, offsets
            now = await self.redis.hget(self._key(reply_id, ":meta"), "beat")
            alive = now is not None and now != beat
        return ReadResult([], result.lost, None, producer_lost=not alive), offsets

    async def logged_bytes(self, reply_id: str) -> int | None:
        """The size of a reply's log in Redis so far (None: no event logged yet)."""
        newest = await self._retrying(
            lambda: self.redis.xrevrange(self._key(reply_id), max="+", min="-", count=2)
        )
        return _newest_offset(newest)

    async def _read_remote(self, reply_id: str, after: int) -> tuple[ReadResult | None, Offsets]:
        key = self._key(reply_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(key, min=f"(0-{after}", max="+", count=READ_BATCH)
            pipe.hmget(self._key(reply_id, ":meta"), META_READ)
            # The newest event entry (the terminal entry, if any, comes after it).
            pipe.xrevrange(key, max="+", min="-", count=2)
            rows, fields, newest = await pipe.execute()
        logged = _newest_offset(newest)
        meta = Meta.of(fields)
        if not rows and meta.ending is not None:
            # Ended, but nothing after ``after`` is left, not even the terminal entry: the
            # stream was evicted. What the reader lacks is told; then the reply's end.
            self._evictions += 1
            lost = (after + 1, meta.last) if after < meta.last else None
            return ReadResult([], lost, meta.ending), Offsets(None, logged)
        if not meta.known and not rows and not newest:
            # Every key gone: expired, deleted, or evicted (unless its producer lives: it
            # writes them again, and this reader waits).
            if not await self.redis.exists(self._key(reply_id, ":live")):
                return None, Offsets(None, logged)
        entries: list[LogEntry] = []
        ending: str | None = None
        before_first: int | None = None
        hole = False
        expected: int | None = None
        for entry_id, fields in rows:
            seq = _seq(entry_id)
            if expected is not None and seq != expected:
                # A hole (Redis lost events its producer could not write again): stop before
                # it, so the next read, after the last event before it, is told what is lost.
                hole = True
                break
            expected = seq + 1
            if b"end" in fields:
                ending = fields[b"end"].decode()
                break
            data = fields[b"d"].decode()
            if before_first is None and b"b" in fields:
                before_first = int(fields[b"b"]) - len(data)
            entries.append(LogEntry(seq, fields[b"e"].decode() or None, data))
        offsets = Offsets(before_first, logged)
        lost = None
        first = _seq(rows[0][0]) if rows else None
        if first is not None and first > after + 1:
            lost = (after + 1, first - 1)
        if hole or (len(rows) == READ_BATCH and ending is None):
            return ReadResult(entries, lost, None), offsets  # more to come on the next read
        return ReadResult(entries, lost, ending), offsets

    async def request_cancel(self, reply_id: str) -> None:
        if reply_id in self._live and self._on_cancel is not None:
            self._on_cancel(reply_id)
            return
        try:
            await self.redis.set(
                self._key(reply_id, ":cancel"), b"1", ex=max(1, int(self.ttl_after_end_s))
            )
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        self._on_cancel = stop

    def cursor(self, reply_id: str, after: int) -> LogCursor:
        if reply_id in self._local._logs:  # produced here: read (and measured) locally
            return self._local.cursor(reply_id, after)
        return RemoteCursor(self, reply_id, after)

    def release(self, reply_id: str, upto: int) -> None:
        # Only this process's copy: Redis keeps a reply for whoever resumes it, until its TTL.
        self._local.release(reply_id, upto)

    def discard(self, reply_id: str) -> None:
        self._local.discard(reply_id)

    async def delete(self, reply_id: str) -> None:
        self._local.discard(reply_id)
        keys = [self._key(reply_id, part) for part in ("", ":meta", ":live", ":cancel")]
        try:
            await self.redis.delete(*keys)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc

    def stats(self) -> ReplayStats:
        return dataclasses.replace(
            self._local.stats(),
            gaps=self._local.stats().gaps + self._gaps,
            lost_writes=self._lost_writes,
            repairs=self._repairs,
            repaired_events=self._repaired_events,
            holes=self._holes,
            evictions=self._evictions,
        )

    async def aclose(self) -> None:
        """Send what is queued (bounded), stop the background tasks, close connections."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self._local.aclose()
        await self.redis.aclose()
