"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one event (its type in field ``e``, empty for a
  plain message; its data in ``d``) and the log's size in bytes up to and including it
  (field ``b``: a reader on another replica measures its lag by it); the terminal entry
  holds the ending (field ``end``). Trimmed to about ``max_entries``.
- ``P{id}:meta``: a hash with the owner and the route's context; ``P{id}:live``: the
  producer's liveness key, set for ``liveness_s`` and refreshed every second while it
  generates; ``P{id}:cancel``: a cancel request from another replica.
Every key lives ``ttl_after_end_s`` after the reply's end (refreshed while it is live).

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued, across replies, in one script call per round trip
(``delivery.redis_writes``); ``create`` joins the next one and waits for it. A reader of a
reply produced elsewhere that has read what its stream holds waits on the one blocking
``XREAD`` this process shares (``delivery.redis_follow``). Replies produced here are also
kept in a local ``MemoryReplayStore``, so their own readers never wait on Redis. A failed
write marks the reply (``failure``), so its producer stops with an in-band error instead of
writing into a hole. Redis going away, or not answering within ``COMMAND_TIMEOUT_S``, makes
``create`` and ``read`` raise ``StoreUnavailable`` (and a write fail); redis-py reconnects by
itself once it is back. This file must not know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from replystream.delivery.redis_follow import StreamWatch
from replystream.delivery.redis_writes import HEARTBEAT_SCRIPT, WRITE_SCRIPT, WriteBatch
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

READ_BATCH = 1000
HEARTBEAT_S = 1.0
# Every command's answer must come within this: a Redis that stops answering (hung, or a
# network that drops packets) is then reported like one that is down, and no reader or
# flush waits on it for ever. A blocking read blocks for at most half of it.
COMMAND_TIMEOUT_S = 5.0


class Offsets(NamedTuple):
    """Where a read's entries stand in the log, in bytes of data."""

    before_first: int | None  # the log's size before the first entry read (None: none read)
    logged: int | None  # the log's size so far (None: no event logged yet)


class RemoteCursor:
    """A reader's place in a reply produced on another replica. Its lag is the log's size
    at the last read, less the bytes up to the reader's place, both from the offsets every
    entry carries (``b``)."""

    __slots__ = ("_following", "_logged", "_sent_upto", "_store", "after", "reply_id")

    def __init__(self, store: RedisReplayStore, reply_id: str, after: int) -> None:
        self._store = store
        self.reply_id = reply_id
        self.after = after
        self._sent_upto: int | None = None  # bytes up to ``after``, known from the first read
        self._logged = 0
        # The last read found the reply, not ended: the next waits on the shared XREAD first.
        self._following = False

    async def read(self, wait_s: float) -> ReadResult | None:
        if self._following and wait_s > 0:
            result, offsets = await self._store.follow(self.reply_id, self.after, wait_s)
        else:
            result, offsets = await self._store.read_measured(self.reply_id, self.after, wait_s)
        if offsets.logged is not None:
            self._logged = max(self._logged, offsets.logged)
        if offsets.before_first is not None and (
            self._sent_upto is None or (result and result.lost)
        ):
            self._sent_upto = offsets.before_first  # first read, or entries were lost
        self._following = result is not None and result.ending is None and not result.producer_lost
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


def _result_of(rows: Any, after: int, batch: int) -> tuple[ReadResult, Offsets]:
    """A read's result from the stream entries after ``after`` (at most ``batch`` of them),
    and where they stand in bytes (the log's size: as far as these entries tell)."""
    entries: list[LogEntry] = []
    ending: str | None = None
    before_first: int | None = None
    logged: int | None = None
    for entry_id, fields in rows:
        if b"end" in fields:
            ending = fields[b"end"].decode()
            break
        data = fields[b"d"].decode()
        if b"b" in fields:
            logged = int(fields[b"b"])
            if before_first is None:
                before_first = logged - len(data)
        entries.append(LogEntry(_seq(entry_id), fields[b"e"].decode() or None, data))
    offsets = Offsets(before_first, logged)
    lost = None
    first = entries[0].seq if entries else None
    if first is not None and first > after + 1:
        lost = (after + 1, first - 1)
    if len(rows) == batch and ending is None:
        return ReadResult(entries, lost, None), offsets  # more to come on the next read
    return ReadResult(entries, lost, ending), offsets


def _text(value: bytes | str | None) -> str:
    """A hash field's value as text ("" when absent)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1])


def shown_url(url: str) -> str:
    """``url`` as errors may show it: without a user name or password."""
    parts = urlsplit(url)
    if parts.hostname is None:
        return f"{parts.scheme}://{parts.path}"  # a unix socket
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


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
    ) -> None:
        self.url = url
        self.where = f"Redis at {shown_url(url)}"  # errors reach clients: no credentials
        self.ttl_after_end_s = ttl_after_end_s
        self.liveness_s = liveness_s
        self.max_entries = max_entries
        self.prefix = prefix
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=COMMAND_TIMEOUT_S
        )
        self._local = MemoryReplayStore(
            ttl_after_end_s=min(ttl_after_end_s, 30.0), max_entries=max_entries
        )
        self._live: set[str] = set()  # replies produced here and not ended
        # Queued for the next flush: new replies (with what their ``create`` waits on: None,
        # or why the write failed), entries and endings.
        self._creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]] = []
        self._pending: dict[str, list[LogEntry]] = {}
        self._endings: dict[str, tuple[int, str]] = {}
        self._next_seq: dict[str, int] = {}
        self._failures: dict[str, str] = {}
        self._wake = asyncio.Event()
        # One flush at a time, so a reply's entries reach Redis in order.
        self._flushing = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_cancel: Callable[[str], None] | None = None
        self._logged: dict[str, int] = {}  # bytes sent to Redis per live reply: entries' offsets
        # When each live reply's keys must have their TTL refreshed (absent: not yet written).
        self._expire_due: dict[str, float] = {}
        # A Redis Cluster runs a script only on keys of one hash slot: whoever connects to
        # one sets this, and a flush then sends one call per slot (a reply's keys must share
        # its slot) instead of one for everything.
        self.one_slot_per_call = False
        self._write = self.redis.register_script(WRITE_SCRIPT)
        self._heartbeat = self.redis.register_script(HEARTBEAT_SCRIPT)
        self.writes = 0  # script calls sent (for benchmarks)
        self._watch = StreamWatch(self.redis, READ_BATCH)

    def _key(self, reply_id: str, part: str = "") -> str:
        return f"{self.prefix}{reply_id}{part}"

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._flush_forever(), name="redis-store-flusher"),
                loop.create_task(self._heartbeat_forever(), name="redis-store-heartbeat"),
            ]

    async def create(self, info: ReplyInfo) -> None:
        self._ensure_tasks()
        written: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._creates.append((info, written))
        # The flusher's next call sends it with everything else queued (a burst of new
        # replies shares one call, and none waits behind the others' writes).
        self._wake.set()
        failure = await written
        if failure is not None:
            raise StoreUnavailable(f"{self.where}: {failure}")
        await self._local.create(info)
        self._live.add(info.reply_id)

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        self._local.append(reply_id, entries)
        if reply_id in self._failures or not entries:
            return
        pending = self._pending.get(reply_id)
        if pending is None:
            self._pending[reply_id] = list(entries)
        else:
            pending.extend(entries)
        self._next_seq[reply_id] = entries[-1].seq + 1
        self._wake.set()

    def end(self, reply_id: str, ending: str) -> None:
        self._local.end(reply_id, ending)
        self._live.discard(reply_id)
        # The terminal entry takes the next sequence number.
        seq = self._next_seq.pop(reply_id, 1)
        if reply_id in self._failures:
            self._logged.pop(reply_id, None)
            self._expire_due.pop(reply_id, None)
            return
        self._endings[reply_id] = (seq, ending)
        self._wake.set()

    def failure(self, reply_id: str) -> str | None:
        return self._failures.get(reply_id)

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Send everything queued, across replies, in one script call (one per hash slot
        with ``one_slot_per_call``)."""
        async with self._flushing:
            creates, self._creates = self._creates, []
            pending, self._pending = self._pending, {}
            endings, self._endings = self._endings, {}
            batches = self._batches(creates, pending, endings)
            if batches:
                await asyncio.gather(*(self._send(batch, waiting) for batch, waiting in batches))

    async def _send(self, batch: WriteBatch, waiting: list[asyncio.Future[str | None]]) -> None:
        """One script call; what Redis refused fails its reply, a call that failed all of
        them (and the creates waiting on it)."""
        ttl = max(1, int(self.ttl_after_end_s))
        try:
            failed = await self._write(
                keys=batch.keys, args=[batch.argument(ttl, max(1, int(self.liveness_s)))]
            )
        except (RedisError, OSError) as exc:
            log.warning("reply log write to Redis failed: %s", exc)
            for reply_id in batch.reply_ids:
                self._failures[reply_id] = f"Redis write failed: {exc}"
            for written in waiting:
                if not written.done():
                    written.set_result(str(exc))
            return
        self.writes += 1
        for index, error in zip(failed[::2], failed[1::2], strict=True):
            reason = _text(error)
            log.warning("reply log write to Redis failed: %s", reason)
            self._failures[batch.reply_ids[int(index)]] = f"Redis write failed: {reason}"
        for written in waiting:
            if not written.done():
                written.set_result(None)

    def _batches(
        self,
        creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]],
        pending: dict[str, list[LogEntry]],
        endings: dict[str, tuple[int, str]],
    ) -> list[tuple[WriteBatch, list[asyncio.Future[str | None]]]]:
        """What one flush writes (new replies, then each reply's entries and ending), in
        one batch, or one per hash slot; each with the creates waiting on it."""
        groups: dict[int, tuple[WriteBatch, list[asyncio.Future[str | None]]]] = {}
        per_slot = self.one_slot_per_call

        def batch_for(stream: str) -> tuple[WriteBatch, list[asyncio.Future[str | None]]]:
            slot = key_slot(stream.encode()) if per_slot else 0
            group = groups.get(slot)
            if group is None:
                group = groups[slot] = (WriteBatch(), [])
            return group

        key = self._key
        for info, written in creates:
            batch, waiting = batch_for(key(info.reply_id))
            batch.create(
                key(info.reply_id, ":meta"), key(info.reply_id, ":live"), info.owner, info.context
            )
            waiting.append(written)
        now = time.monotonic()
        # A third of the TTL: a flush late by up to two thirds of it still comes in time.
        refresh_s = max(1.0, self.ttl_after_end_s / 3)
        for reply_id in (pending.keys() | endings.keys()) if endings else pending.keys():
            entries = pending.get(reply_id, ())
            ending = endings.get(reply_id)
            stream = key(reply_id)
            batch = batch_for(stream)[0]
            last = entries[-1].seq if entries else 0
            trim = self.max_entries if last > self.max_entries else 0
            if ending is not None:
                # Every key lives ``ttl_after_end_s`` from the reply's end.
                expire: tuple[str, ...] = (stream, key(reply_id, ":meta"), key(reply_id, ":cancel"))
                self._expire_due.pop(reply_id, None)
                logged = self._logged.pop(reply_id, 0)
                batch.reply(
                    reply_id,
                    stream,
                    entries,
                    logged,
                    trim=trim,
                    expire=expire,
                    ending=ending,
                    live_key=key(reply_id, ":live"),
                )
                continue
            due = self._expire_due.get(reply_id)
            if due is None:  # the stream's first write makes it: from now on it expires
                expire = (stream,)
                self._expire_due[reply_id] = now + refresh_s
            elif now >= due:  # a reply that lives long keeps its keys
                expire = (stream, key(reply_id, ":meta"))
                self._expire_due[reply_id] = now + refresh_s
            else:
                expire = ()
            self._logged[reply_id] = batch.reply(
                reply_id, stream, entries, self._logged.get(reply_id, 0), trim=trim, expire=expire
            )
        return list(groups.values())

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            live = list(self._live)
            if live:
                await self._refresh(live)

    async def _refresh(self, live: list[str]) -> None:
        """Refresh the liveness of ``live`` replies and pass on the cancels asked for them:
        one script call (one per hash slot with ``one_slot_per_call``)."""
        groups: dict[int, list[str]] = {}
        for reply_id in live:
            slot = key_slot(self._key(reply_id).encode()) if self.one_slot_per_call else 0
            groups.setdefault(slot, []).append(reply_id)
        liveness = max(1, int(self.liveness_s))
        for replies in groups.values():
            keys: list[str] = []
            for reply_id in replies:
                keys += (self._key(reply_id, ":live"), self._key(reply_id, ":cancel"))
            try:
                cancelled = await self._heartbeat(keys=keys, args=[liveness])
            except (RedisError, OSError) as exc:
                log.warning("liveness refresh failed: %s", exc)
                continue
            for reply_id, requested in zip(replies, cancelled, strict=True):
                if requested and self._on_cancel is not None:
                    self._on_cancel(reply_id)

    async def info(self, reply_id: str) -> ReplyInfo | None:
        local = await self._local.info(reply_id)
        if local is not None and reply_id in self._live:
            return local  # produced here and running: Redis has nothing newer
        try:
            meta = await self.redis.hgetall(self._key(reply_id, ":meta"))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
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
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xrevrange(self._key(reply_id), max="+", min="-", count=1)
                pipe.exists(self._key(reply_id, ":meta"))
                rows, known = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
        if not rows:
            return LogTail(0, False) if known else None
        entry_id, fields = rows[0]
        if b"end" in fields:  # the terminal entry takes the number after the last event's
            return LogTail(_seq(entry_id) - 1, True)
        return LogTail(_seq(entry_id), False)

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.read(reply_id, after, wait_s)
        result, _ = await self.read_measured(reply_id, after, wait_s)
        return result

    async def read_measured(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """A read of a reply produced elsewhere, with where its entries stand in bytes."""
        try:
            result, offsets = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.lost or result.ending or wait_s <= 0:
                return result, offsets
            # Nothing new: wait for an entry on the read every follower here shares.
            return await self.follow(reply_id, after, wait_s)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc

    async def follow(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """The next entries of a reply produced elsewhere, for a reader that has read the
        rest: from the one blocking XREAD every follower in this process shares (no command
        of its own); if none came within ``wait_s``, a read of its own tells whether the
        reply is still there and its producer alive."""
        try:
            rows = await self._watch.after(
                self._key(reply_id), after, min(wait_s, COMMAND_TIMEOUT_S / 2)
            )
            if rows:
                return _result_of(rows, after, READ_BATCH)
            result, offsets = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.ending:
                return result, offsets
            alive = await self.redis.exists(self._key(reply_id, ":live"))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
        return ReadResult([], result.lost, None, producer_lost=not alive), offsets

    async def logged_bytes(self, reply_id: str) -> int | None:
        """The size of a reply's log in Redis so far (None: no event logged yet)."""
        try:
            newest = await self.redis.xrevrange(self._key(reply_id), max="+", min="-", count=2)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
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
        result, offsets = _result_of(rows, after, READ_BATCH)
        return result, Offsets(offsets.before_first, logged)

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
        return self._local.stats()

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
        await self._watch.aclose()
        await self._local.aclose()
        await self.redis.aclose()
