"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix; ``{id}`` is the reply id in braces, a Redis
Cluster hash tag, so all of a reply's keys share one hash slot and one shard):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one event (its type in field ``e``, empty for a
  plain message; its data in ``d``) and the log's size in bytes up to and including it
  (field ``b``: a reader on another replica measures its lag by it); the terminal entry
  holds the ending (field ``end``). Trimmed to about ``max_entries``.
- ``P{id}:meta``: a hash with the owner and the route's context; ``P{id}:live``: the
  producer's liveness key, set for ``liveness_s`` and refreshed every second while it
  generates; ``P{id}:cancel``: a cancel request from another replica.
Every key lives ``ttl_after_end_s`` after the reply's end (refreshed while it is live).

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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import RedisError

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
                    mapping={"owner": info.owner, "context": info.context},
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
        if expected is not None and count < expected:
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
            repairs = {r: plan(copies[r], states[r]) for r in copies}
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
                pipe.exists(self._key(reply_id, ":meta"))
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

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            live = list(self._live)
            if not live:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for reply_id in live:
                        pipe.set(
                            self._key(reply_id, ":live"), b"1", ex=max(1, int(self.liveness_s))
                        )
                        pipe.exists(self._key(reply_id, ":cancel"))
                    results = await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("liveness refresh failed: %s", exc)
                continue
            for reply_id, cancelled in zip(live, results[1::2], strict=True):
                if cancelled and self._on_cancel is not None:
                    self._on_cancel(reply_id)

    async def info(self, reply_id: str) -> ReplyInfo | None:
        local = await self._local.info(reply_id)
        if local is not None and reply_id in self._live:
            return local  # produced here and running: Redis has nothing newer
        meta = await self._retrying(lambda: self.redis.hgetall(self._key(reply_id, ":meta")))
        if not meta:
            if local is not None:  # deleted on another replica: this copy goes too
                self._local.discard(reply_id)
            return None
        return ReplyInfo(
            reply_id, owner=_text(meta.get(b"owner")), context=_text(meta.get(b"context"))
        )

    async def tail(self, reply_id: str) -> LogTail | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.tail(reply_id)
        rows, known = await self._retrying(lambda: self._remote_tail(reply_id))
        if not rows:
            return LogTail(0, False) if known else None
        entry_id, fields = rows[0]
        if b"end" in fields:  # the terminal entry takes the number after the last event's
            return LogTail(_seq(entry_id) - 1, True)
        return LogTail(_seq(entry_id), False)

    async def _remote_tail(self, reply_id: str) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self._key(reply_id), max="+", min="-", count=1)
            pipe.exists(self._key(reply_id, ":meta"))
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
            pipe.exists(self._key(reply_id, ":meta"))
            # The newest event entry (the terminal entry, if any, comes after it).
            pipe.xrevrange(key, max="+", min="-", count=2)
            rows, known, newest = await pipe.execute()
        logged = _newest_offset(newest)
        if not known and not rows:
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
