"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix; ``{id}`` is the reply id in braces, a Redis
Cluster hash tag, so all of a reply's keys share one hash slot and one shard: ``redis_keys``):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one event and the log's size up to it, the
  terminal entry the ending (``delivery.redis_rows``). Trimmed to where the producer's copy
  of the reply starts (a log's bounds: ``replay.MAX_LOG_ENTRIES``, ``MAX_LOG_BYTES``).
- ``P{id}:meta``: a hash with the owner and the route's context, the producer's heartbeat
  count (``beat``, bumped every second while it generates), once the reply has ended, its
  ending and last event's number (``end``, ``last``), and ``lost`` once a reader found its
  producer lost (the reply takes nothing more); ``P{id}:live``: the producer's liveness
  key, set for ``liveness_s`` and refreshed every second while it generates;
  ``P{id}:cancel``: a cancel request from another replica (its id published on the channel
  ``Pcancels`` too); ``P{id}:read``: a reader's mark, set for ``liveness_s`` and refreshed
  every second by each replica with a reader following the reply, which its producer's
  heartbeat finds (a detached reply goes on while read).
Every key lives ``ttl_after_end_s`` after the reply's end; while the reply is live, each write
and heartbeat keeps them, and a cancel mark lives, for ``redis_link.live_hold_s`` (the TTL, but
never less than a producer's beats may be apart, so nothing lapses between two). A
delete leaves ``P{id}:meta`` holding only ``deleted`` for as long: readers find nothing, a
repair writes nothing, and the producer, wherever it runs, finds it at its next heartbeat,
stops, and what it wrote meanwhile is deleted.

``RedisReplayStore`` is the ``ReplayStore`` seam over four parts that share one client
(``redis_link``: retries through a failover) and one naming (``redis_keys``):
- ``redis_log_writer.LogWriter``: the writes of replies produced here (queued, flushed in
  batches by one task), repaired from the local copy after a failover or an eviction
  (``redis_failover.Failover``); both halves change one set of per-reply tables
  (``redis_reply_tables.ReplyTables``);
- ``redis_heartbeat.Heartbeat``: once a second, liveness, cancels, deletes and evictions of
  replies produced here, and the reader marks of replies read here; a cancel asked elsewhere
  is also heard at once on a channel (``redis_cancels.CancelChannel``), the key its fallback;
- ``redis_reads.RemoteReads``: reads and follows of replies produced elsewhere;
- a ``MemoryReplayStore`` of the replies produced here, so their own readers never wait on
  Redis.

Eviction (a ``maxmemory`` Redis evicts whole keys, any of the four, in any order): a reader
never takes a missing key for something else (``redis_reads``); a missing liveness key is
confirmed by the heartbeat count before a producer is called lost; a live producer writes its
reply again from its copy when its count starts again at 1 (metadata gone) or its stream is
shorter than what Redis acknowledged; until then, a stream made anew by the next append
starts late, which readers are told of as a gap. Only a reply whose every key is gone reads
as unknown.

Failover (Redis through Sentinel, a Cluster shard, or one Redis restarted): a write or a read
that fails is retried for ``failover_s``; producers go on into their local copy, and what
the promoted replica lacks is written again (``redis_failover``). Past ``failover_s`` a
write marks its replies (``failure``), and reads raise ``StoreUnavailable``; a ``create``
fails with the next flush that cannot reach Redis. This file must not know about HTTP or
event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from replystream.delivery.redis_cancels import CancelChannel
from replystream.delivery.redis_connect import first_contact
from replystream.delivery.redis_follow import RemoteCursor
from replystream.delivery.redis_heartbeat import Heartbeat
from replystream.delivery.redis_keys import DELETED_PARTS, ReplyKeys
from replystream.delivery.redis_link import COMMAND_TIMEOUT_S, HEARTBEAT_S, RedisLink
from replystream.delivery.redis_log_writer import LogWriter
from replystream.delivery.redis_reads import RemoteReads
from replystream.delivery.redis_rows import Newest, Offsets
from replystream.delivery.redis_writes import DELETE_SCRIPT
from replystream.delivery.replay import (
    FAILOVER_S,
    MAX_LOG_BYTES,
    MAX_LOG_ENTRIES,
    TTL_AFTER_END_S,
    FirstContact,
    Gone,
    LogCursor,
    LogEntry,
    LogTail,
    MemoryReplayStore,
    ReadResult,
    ReplayStats,
    ReplyInfo,
)
from replystream.delivery.task_stop import stop_task


class RedisReplayStore:
    """A ``ReplayStore`` shared by every replica that points at the same Redis."""

    name = "redis"
    shared = True
    # A reader's mark is left at once; its producer reads marks at its beats (and a beat
    # takes its own time): seen within a beat and a half.
    readers_elsewhere_seen_within_s = 1.5 * HEARTBEAT_S

    def __init__(
        self,
        url: str,
        *,
        ttl_after_end_s: float = TTL_AFTER_END_S,
        liveness_s: float = 3.0,
        max_entries: int = MAX_LOG_ENTRIES,
        max_bytes: int = MAX_LOG_BYTES,
        prefix: str = "replystream:reply:",
        connect_timeout_s: float = 2.0,
        failover_s: float = FAILOVER_S,
    ) -> None:
        self.url = url
        self._connect_timeout_s = connect_timeout_s
        self._link = RedisLink(
            url, connect_timeout_s=connect_timeout_s, failover_s=failover_s, liveness_s=liveness_s
        )
        self.redis = self._link.redis
        self.ttl_after_end_s = ttl_after_end_s
        self.keys = ReplyKeys(prefix, one_slot_per_call=self._link.target.kind == "cluster")
        self._local = MemoryReplayStore(
            ttl_after_end_s=min(ttl_after_end_s, 30.0),
            max_entries=max_entries,
            max_bytes=max_bytes,
        )
        self.writer = LogWriter(
            self._link,
            self.keys,
            self._local,
            ttl_after_end_s=ttl_after_end_s,
            liveness_s=liveness_s,
        )
        self._link.on_replaced = self.writer.failover.redis_replaced
        self._heartbeat = Heartbeat(self._link, self.keys, self.writer)
        self.cancels = CancelChannel(self._link, f"{prefix}cancels", self._cancel_heard)
        self.reads = RemoteReads(self._link, self.keys)
        self._delete = self.redis.register_script(DELETE_SCRIPT)
        self._tasks: list[asyncio.Task[None]] = []

    async def first_contact(self) -> FirstContact | None:
        """Whether Redis takes this store's commands, asked once on a client of its own (so
        from any event loop, before serving): see ``redis_connect.first_contact``."""
        return await first_contact(
            self._link.target,
            self.keys.key("first-contact"),
            connect_timeout_s=self._connect_timeout_s,
            command_timeout_s=COMMAND_TIMEOUT_S,
        )

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self.writer.flush_forever(), name="redis-store-flusher"),
                loop.create_task(self._heartbeat.beat_forever(), name="redis-store-heartbeat"),
                loop.create_task(self.cancels.listen_forever(), name="redis-store-cancels"),
            ]

    # Writes, of replies produced here.

    async def create(self, info: ReplyInfo) -> None:
        self._ensure_tasks()
        failure = await self.writer.create(info)
        if failure is not None:
            raise self._link.unavailable(failure)

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        self.writer.append(reply_id, entries)

    def end(self, reply_id: str, ending: str) -> None:
        self.writer.end(reply_id, ending)

    def failure(self, reply_id: str) -> str | None:
        return self.writer.failure(reply_id)

    async def flush(self) -> None:
        """Send everything queued now (what the flusher task does on its own)."""
        await self.writer.flush()

    # Reads: a reply produced here from this process's copy, any other from Redis.

    async def info(self, reply_id: str) -> ReplyInfo | None:
        local = await self._local.info(reply_id)
        if local is not None and reply_id in self.writer.tables.live:
            # Produced here and running: Redis has nothing newer, but for a delete made on
            # another replica, which this producer hears of only at its next heartbeat.
            return None if await self.reads.deleted(reply_id) else local
        found = await self.reads.info(reply_id)
        if found.info is None and local is not None:
            if found.deleted:  # deleted on another replica: this copy goes too
                self._local.discard_deleted(reply_id)
                return None
            # Redis lost it (restarted without its data, or evicted it): this copy is whole.
            return local
        return found.info

    async def gone(self, reply_id: str) -> Gone | None:
        # A delete made or heard of here is known at once (its mark may not be in Redis yet).
        local = await self._local.gone(reply_id)
        return local if local is not None else await self.reads.gone(reply_id)

    async def _copy_serves(self, reply_id: str) -> bool:
        """Whether this process's copy answers a new read of a reply: it is there, and the
        reply was not found lost elsewhere while this process stalled (its copy may hold
        what it made before it heard, which Redis refused: a new reader here is told what
        readers everywhere are)."""
        return (
            reply_id not in self.writer.tables.lost and await self._local.info(reply_id) is not None
        )

    async def tail(self, reply_id: str) -> LogTail | None:
        if await self._copy_serves(reply_id):
            return await self._local.tail(reply_id)
        return await self.reads.tail(reply_id)

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        if await self._copy_serves(reply_id):
            return await self._local.read(reply_id, after, wait_s)
        result, _ = await self.reads.look(reply_id, after, wait_s)
        return result

    # What a ``RemoteCursor`` asks (``redis_follow.FollowedStore``).

    async def read_measured(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        return await self.reads.read_measured(reply_id, after, wait_s)

    async def follow(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        return await self.reads.follow(reply_id, after, wait_s)

    async def newest_write(self, reply_id: str) -> Newest:
        return await self.reads.newest_write(reply_id)

    async def reading(self, reply_id: str, joined: bool = False) -> None:
        """A reader here has just read reply ``reply_id``, produced elsewhere and not ended
        (``joined``: its first such read): its producer is told (``Heartbeat.reading``)."""
        self._ensure_tasks()
        await self._heartbeat.reading(reply_id, joined)

    def left(self, reply_id: str) -> None:
        """A reader here that joined reply ``reply_id`` is done: its producer is told at the
        next beat (``Heartbeat.left``)."""
        self._heartbeat.left(reply_id)

    def read_elsewhere_at(self, reply_id: str) -> float | None:
        return self.writer.tables.read_elsewhere.get(reply_id)

    def cursor(self, reply_id: str, after: int) -> LogCursor:
        if reply_id in self._local._logs and reply_id not in self.writer.tables.lost:
            return self._local.cursor(reply_id, after)  # produced here: read locally
        return RemoteCursor(self, reply_id, after)

    # Cancels, deletes, and forgetting.

    async def request_cancel(self, reply_id: str) -> None:
        if reply_id in self.writer.tables.live and self.writer.stop_producer is not None:
            self.writer.stop(reply_id)
            return
        try:
            # Kept until its producer's next beats have surely read it, however short the TTL.
            await self.redis.set(
                self.keys.key(reply_id, ":cancel"),
                b"1",
                ex=self.writer.hold_s,
            )
        except (RedisError, OSError) as exc:
            raise self._link.unavailable(exc) from exc
        await self.cancels.publish(reply_id)  # heard at once where it is produced

    def _cancel_heard(self, reply_id: str) -> None:
        """A cancel published by a replica (``CancelChannel``): stopped if produced here."""
        if reply_id in self.writer.tables.live:
            self.writer.stop(reply_id)

    def on_cancel(self, stop: Callable[[str], None]) -> None:
        self.writer.stop_producer = stop

    def on_lost(self, stop: Callable[[str], None]) -> None:
        self.writer.lost_producer = stop

    def release(self, reply_id: str, upto: int) -> None:
        # Only this process's copy: Redis keeps a reply for whoever resumes it, until its TTL.
        self._local.release(reply_id, upto)

    def discard(self, reply_id: str) -> None:
        self._local.discard(reply_id)

    async def delete(self, reply_id: str) -> None:
        if reply_id in self.writer.tables.live:
            self.writer.stop(reply_id)  # elsewhere, its producer hears at its next heartbeat
        self.writer.forget(reply_id)
        keys = [self.keys.key(reply_id, part) for part in DELETED_PARTS]
        # The mark must outlive the gap between two of the producer's heartbeats, as a cancel
        # mark does: found expired, a deleted reply looks evicted, and is written again.
        try:
            await self._delete(keys=keys, args=[self.writer.hold_s])
        except (RedisError, OSError) as exc:
            raise self._link.unavailable(exc) from exc

    def stats(self) -> ReplayStats:
        local = self._local.stats()
        failover = self.writer.failover
        return dataclasses.replace(
            local,
            gaps=local.gaps + self.reads.gaps,
            lost_writes=failover.lost_writes,
            repairs=failover.repairs,
            repaired_events=failover.repaired_events,
            holes=failover.holes,
            evictions=failover.evictions + self.reads.evictions,
        )

    async def aclose(self) -> None:
        """Send what is queued (bounded), stop the background tasks, close connections."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.writer.flush()
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        await self.reads.aclose()
        await self._local.aclose()
        await self.redis.aclose()
