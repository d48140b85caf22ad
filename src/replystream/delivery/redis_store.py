"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one encoded event (field ``f``); the terminal
  entry holds the ending (field ``end``). Trimmed to about ``max_entries``.
- ``P{id}:meta``: a hash with the owner; ``P{id}:live``: the producer's liveness key, set for
  ``liveness_s`` and refreshed every second while it generates; ``P{id}:cancel``: a cancel
  request from another replica.
Every key lives ``ttl_after_end_s`` after the reply's end (refreshed while it is live).

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued in one pipeline per round trip. Replies produced here are also kept in a
local ``MemoryReplayStore``, so their own readers never wait on Redis. A failed write marks
the reply (``failure``), so its producer stops with an in-band error instead of writing into
a hole. Redis going away, or not answering within ``COMMAND_TIMEOUT_S``, makes ``create`` and
``read`` raise ``StoreUnavailable`` (and a write fail); redis-py reconnects by itself once it
is back. This file must not know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from replystream.delivery.replay import (
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
        ttl_after_end_s: float = 600.0,
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
        self._pending: dict[str, list[LogEntry | tuple[int, str]]] = {}
        self._next_seq: dict[str, int] = {}
        self._failures: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.on_cancel_request: Callable[[str], None] | None = None
        self.writes = 0  # pipelines sent (for benchmarks)

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
        ttl = max(1, int(self.ttl_after_end_s))
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(self._key(info.reply_id, ":meta"), mapping={"owner": info.owner})
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
            return
        self._pending.setdefault(reply_id, []).append((seq, ending))
        self._wake.set()

    def failure(self, reply_id: str) -> str | None:
        return self._failures.get(reply_id)

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Send everything queued, in one pipeline."""
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
                            pipe.xadd(
                                key,
                                {"f": item.frame},
                                id=f"0-{item.seq}",
                                maxlen=self.max_entries,
                                approximate=True,
                            )
                            continue
                        seq, ending = item
                        pipe.xadd(key, {"end": ending}, id=f"0-{seq}")
                        for part in ("", ":meta", ":cancel"):
                            pipe.expire(self._key(reply_id, part), ttl)
                        pipe.delete(self._key(reply_id, ":live"))
                    pipe.expire(key, ttl)
                await pipe.execute()
            self.writes += 1
        except (RedisError, OSError) as exc:
            log.warning("reply log write to Redis failed: %s", exc)
            for reply_id in batch:
                self._failures[reply_id] = f"Redis write failed: {exc}"

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
                if cancelled and self.on_cancel_request is not None:
                    self.on_cancel_request(reply_id)

    async def info(self, reply_id: str) -> ReplyInfo | None:
        local = await self._local.info(reply_id)
        if local is not None:
            return local
        try:
            meta = await self.redis.hgetall(self._key(reply_id, ":meta"))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
        if not meta:
            return None
        owner = meta.get(b"owner", b"")
        return ReplyInfo(reply_id, owner=owner.decode() if isinstance(owner, bytes) else owner)

    async def tail(self, reply_id: str) -> LogTail | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.tail(reply_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xrevrange(self._key(reply_id), max="+", min="-", count=1)
                pipe.exists(self._key(reply_id, ":meta"))
                rows, known = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis at {self.url}: {exc}") from exc
        if not rows:
            return LogTail(0, False) if known else None
        entry_id, fields = rows[0]
        if b"end" in fields:  # the terminal entry takes the number after the last event's
            return LogTail(_seq(entry_id) - 1, True)
        return LogTail(_seq(entry_id), False)

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        if await self._local.info(reply_id) is not None:
            return await self._local.read(reply_id, after, wait_s)
        try:
            result = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.lost or result.ending or wait_s <= 0:
                return result
            # Nothing new: block on the stream until an entry lands or the wait runs out.
            block_s = min(wait_s, COMMAND_TIMEOUT_S / 2)
            await self.redis.xread(
                {self._key(reply_id): f"0-{after}"}, count=1, block=max(1, int(block_s * 1000))
            )
            result = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.ending:
                return result
            alive = await self.redis.exists(self._key(reply_id, ":live"))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc
        return ReadResult([], result.lost, None, producer_lost=not alive)

    async def _read_remote(self, reply_id: str, after: int) -> ReadResult | None:
        key = self._key(reply_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(key, min=f"(0-{after}", max="+", count=READ_BATCH)
            pipe.exists(self._key(reply_id, ":meta"))
            rows, known = await pipe.execute()
        if not known and not rows:
            return None
        entries: list[LogEntry] = []
        ending: str | None = None
        for entry_id, fields in rows:
            if b"end" in fields:
                ending = fields[b"end"].decode()
                break
            entries.append(LogEntry(_seq(entry_id), fields[b"f"]))
        lost = None
        first = entries[0].seq if entries else None
        if first is not None and first > after + 1:
            lost = (after + 1, first - 1)
        if len(rows) == READ_BATCH and ending is None:
            return ReadResult(entries, lost, None)  # more to come on the next read
        return ReadResult(entries, lost, ending)

    async def request_cancel(self, reply_id: str) -> None:
        if reply_id in self._live and self.on_cancel_request is not None:
            self.on_cancel_request(reply_id)
            return
        try:
            await self.redis.set(
                self._key(reply_id, ":cancel"), b"1", ex=max(1, int(self.ttl_after_end_s))
            )
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.where}: {exc}") from exc

    async def cancel_requested(self, reply_id: str) -> bool:
        try:
            return bool(await self.redis.exists(self._key(reply_id, ":cancel")))
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
        await self._local.aclose()
        await self.redis.aclose()
