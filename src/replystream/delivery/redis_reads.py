"""Reads of replies produced on other replicas, from Redis.

A reader of a reply made elsewhere reads its stream in batches (``READ_BATCH`` entries),
with the reply's metadata and newest entry in the same round trip, so it knows the log's
size and whether the reply ended. One that has read everything waits on the one blocking
``XREAD`` this process shares (``redis_follow.StreamWatch``); when nothing came, it checks
that the producer lives: its liveness key, or, that key gone (expired, or evicted), its
heartbeat count moving within ``BEAT_CONFIRM_S``; a producer so found lost is settled lost
in Redis (``redis_writes.LOST_SCRIPT``, unless it moved meanwhile), so the next read of its
reply on any replica (a response's object asked for again, a resume) is told at once, and
the producer, should it come back (a process paused and let go on), writes nothing more into
it. A missing key is never taken
for something else: a stream gone behind an ended reply is a gap up to the ``last`` its
metadata keeps, then the ending; metadata gone behind a surviving stream is reported as
evicted; only a reply whose every key is gone (and no producer writing it again) reads as
unknown, and to a reader that was following it only once its producer has had
``BEAT_CONFIRM_S`` to write it again (every key of a live reply evicted at once, its
liveness key among them). Every read is retried through a failover
(``RedisLink.retrying``). This file reads; it writes only that mark.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from replystream.delivery.redis_follow import StreamWatch
from replystream.delivery.redis_keys import ReplyKeys
from replystream.delivery.redis_link import (
    BEAT_CONFIRM_S,
    COMMAND_TIMEOUT_S,
    HEARTBEAT_S,
    RedisLink,
)
from replystream.delivery.redis_rows import (
    META_READ,
    Meta,
    Newest,
    Offsets,
    newest_write,
    result_of,
    seconds_of,
    seq_of,
    text,
)
from replystream.delivery.redis_writes import LOST_SCRIPT
from replystream.delivery.replay import DELETED, Gone, LogTail, ReadResult, ReplyInfo

READ_BATCH = 1000


class Found(NamedTuple):
    """What Redis keeps about a reply besides its events: its info (None: not there), and
    whether it was deleted (a delete leaves a mark; an eviction or a lost write does not)."""

    info: ReplyInfo | None
    deleted: bool


class RemoteReads:
    """What a store reads of replies in Redis; counts the gaps and evictions it finds."""

    def __init__(self, link: RedisLink, keys: ReplyKeys) -> None:
        self._link = link
        self._keys = keys
        self.redis = link.redis
        self.watch = StreamWatch(self.redis, READ_BATCH, keys.slot_of_key)
        self.gaps = 0  # readers' reads that told of lost entries
        self.evictions = 0  # keys found evicted
        self._settle = self.redis.register_script(LOST_SCRIPT)

    async def info(self, reply_id: str) -> Found:
        """What Redis keeps of a reply (its owner, context, dialect and keep-alive), or why
        not."""
        meta = await self._link.retrying(lambda: self._meta_of(reply_id))
        if b"owner" not in meta:
            return Found(None, b"deleted" in meta)
        info = ReplyInfo(
            reply_id,
            owner=text(meta.get(b"owner")),
            context=text(meta.get(b"context")),
            dialect=text(meta.get(b"dialect")),
            keepalive_s=seconds_of(meta.get(b"keepalive")),
        )
        return Found(info, False)

    async def deleted(self, reply_id: str) -> bool:
        """Whether a reply was deleted (its mark is there). Asked once, not retried: Redis
        out of reach, a reply produced here is still read from this process's copy."""
        if self._link.recovering():
            return False
        try:
            found = await self.redis.hexists(self._keys.key(reply_id, ":meta"), "deleted")
        except (RedisError, OSError):
            return False
        return bool(found)

    async def _meta_of(self, reply_id: str) -> dict[bytes | str, bytes | str]:
        """A reply's metadata; when it is gone but its producer may live (its heartbeat or
        its repair writes it again within a second or two), after waiting for it."""
        key = self._keys.key(reply_id, ":meta")
        meta: dict[bytes | str, bytes | str] = await self.redis.hgetall(key)
        deadline = time.monotonic() + BEAT_CONFIRM_S
        while (
            b"owner" not in meta
            and time.monotonic() < deadline
            and await self._producer_may_write(reply_id)
        ):
            await asyncio.sleep(HEARTBEAT_S / 4)
            meta = await self.redis.hgetall(key)
        return meta

    async def gone(self, reply_id: str) -> Gone | None:
        """Why a reply can no longer be read: deleted (its mark is there), or its metadata
        evicted from under it."""

        async def look() -> tuple[Meta, bool]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(self._keys.key(reply_id, ":meta"), META_READ)
                pipe.exists(self._keys.key(reply_id))
                fields, logged = await pipe.execute()
            return Meta.of(fields), bool(logged)

        meta, logged = await self._link.retrying(look)
        if meta.deleted:
            return DELETED
        if meta.known or not logged:
            return None
        self.evictions += 1
        return Gone(
            "evicted",
            "this reply's metadata is gone from Redis while its events remain (evicted under "
            "maxmemory, or lost in a failover): it can no longer be read or resumed",
        )

    async def tail(self, reply_id: str) -> LogTail | None:
        """The last event's number of a reply in Redis, and whether it has ended."""
        rows, fields = await self._link.retrying(lambda: self._remote_tail(reply_id))
        meta = Meta.of(fields)
        if meta.deleted:
            return None
        if not rows:
            if meta.ending is not None:  # ended, and its stream evicted since
                return LogTail(meta.last, True)
            return LogTail(0, False) if meta.known else None
        entry_id, fields = rows[0]
        if b"end" in fields:  # the terminal entry takes the number after the last event's
            return LogTail(seq_of(entry_id) - 1, True)
        return LogTail(seq_of(entry_id), False)

    async def _remote_tail(self, reply_id: str) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self._keys.key(reply_id), max="+", min="-", count=1)
            pipe.hmget(self._keys.key(reply_id, ":meta"), META_READ)
            return await pipe.execute()

    async def read_measured(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """A reader's read of a reply produced elsewhere, with where its entries stand in
        bytes (lost entries it finds are told to it: a gap counted)."""
        return self._counting(await self.look(reply_id, after, wait_s))

    async def look(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """The same read for the server's own use (finding a reply, its dialect, its object):
        it tells no reader of what is lost, so counts no gap."""
        return await self._link.retrying(lambda: self._read_waiting(reply_id, after, wait_s))

    async def follow(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """The next entries of a reply produced elsewhere, for a reader that has read the
        rest: from the one blocking XREAD every follower in this process shares (no command
        of its own); if none came within ``wait_s``, a read of its own tells whether the
        reply is still there and its producer alive."""
        return self._counting(
            await self._link.retrying(lambda: self._follow_once(reply_id, after, wait_s))
        )

    def _counting(
        self, read: tuple[ReadResult | None, Offsets]
    ) -> tuple[ReadResult | None, Offsets]:
        if read[0] is not None and read[0].lost is not None:
            self.gaps += 1
        return read

    async def _read_waiting(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        result, offsets = await self._read_remote(reply_id, after)
        if (
            result is None
            or result.entries
            or result.lost
            or result.ending
            or result.producer_lost
            or wait_s <= 0
        ):
            return result, offsets
        # Nothing new: wait for an entry on the read every follower here shares.
        return await self._follow_once(reply_id, after, wait_s)

    async def _follow_once(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        key = self._keys.key(reply_id)
        rows = await self.watch.after(key, after, min(wait_s, COMMAND_TIMEOUT_S / 2))
        if rows:
            return result_of(rows, after, READ_BATCH)
        result, offsets = await self._read_remote(reply_id, after)
        if result is None:
            return await self._written_again(reply_id, after)
        if result.entries or result.lost or result.ending or result.producer_lost:
            return result, offsets
        alive = self._link.recovering() or await self.redis.exists(
            self._keys.key(reply_id, ":live")
        )
        if not alive:
            # Its liveness key is gone: expired (the producer died), or evicted. A live
            # producer's heartbeat count moves within a second; wait for it (or an event).
            beat = await self.redis.hget(self._keys.key(reply_id, ":meta"), "beat")
            rows = await self.watch.after(key, after, BEAT_CONFIRM_S)
            if rows:
                return result_of(rows, after, READ_BATCH)
            result, offsets = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.lost or result.ending:
                return result, offsets
            if result.producer_lost:  # settled by another reader meanwhile
                return result, offsets
            now = await self.redis.hget(self._keys.key(reply_id, ":meta"), "beat")
            # Still, while Redis refuses this process's writes too: its producer's beats
            # fail as ours do, and it may well live (waited for through the failover
            # window, then told as Redis unavailable).
            alive = (now is not None and now != beat) or self._link.refusing_writes()
            if not alive:
                # Settled in Redis, for every replica, unless the producer moved since.
                alive = not await self._settle_lost(reply_id, now, after)
        return ReadResult([], result.lost, None, producer_lost=not alive), offsets

    async def _settle_lost(self, reply_id: str, beat: bytes | str | None, after: int) -> bool:
        """Mark a reply's producer lost in Redis (``LOST_SCRIPT``), its count found standing
        at ``beat`` and nothing logged past ``after``; False if it moved meanwhile (it is
        back: the reader reads on)."""
        keys = [self._keys.key(reply_id, part) for part in (":meta", ":live", "")]
        settled = await self._settle(keys=keys, args=[text(beat), after])
        return bool(settled)

    async def _written_again(self, reply_id: str, after: int) -> tuple[ReadResult | None, Offsets]:
        """A reply found gone under a reader that was following it, not ended, read again
        once its producer has had ``BEAT_CONFIRM_S`` to write it again. Every key of it gone
        (its liveness key among them, so nothing says a producer writes it) is an eviction
        under a live producer, which writes it all again at its next beat, more likely than
        an expiry: a live reply's keys are held past its producer's beats, and a dead
        producer's readers are told so long before its keys lapse. A delete's mark says so
        at once."""
        deadline = time.monotonic() + BEAT_CONFIRM_S
        key = self._keys.key(reply_id)
        while not await self.redis.hexists(self._keys.key(reply_id, ":meta"), "deleted"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Woken by the stream made again; its metadata may come back on its own.
            await self.watch.after(key, after, min(left, HEARTBEAT_S / 4))
            result, offsets = await self._read_remote(reply_id, after)
            if result is not None:
                return result, offsets
        return None, Offsets(None, None)

    async def newest_write(self, reply_id: str) -> Newest:
        """The size of a reply's log in Redis so far, and what its latest write added."""
        newest = await self._link.retrying(
            lambda: self.redis.xrevrange(self._keys.key(reply_id), max="+", min="-", count=2)
        )
        return newest_write(newest)

    async def _read_remote(self, reply_id: str, after: int) -> tuple[ReadResult | None, Offsets]:
        key = self._keys.key(reply_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(key, min=f"(0-{after}", max="+", count=READ_BATCH)
            pipe.hmget(self._keys.key(reply_id, ":meta"), META_READ)
            # The newest event entry (the terminal entry, if any, comes after it).
            pipe.xrevrange(key, max="+", min="-", count=2)
            rows, fields, newest = await pipe.execute()
        logged = newest_write(newest).logged
        meta = Meta.of(fields)
        if meta.deleted:
            return None, Offsets(None, None)
        if not rows and meta.ending is not None:
            # Ended, but nothing after ``after`` is left, not even the terminal entry: the
            # stream was evicted, or the reader's place is past the end (a live reply
            # followed from there, which ended before it; its stream is all there). What
            # the reader lacks is told; then the reply's end.
            if not newest:
                self.evictions += 1
            lost = (after + 1, meta.last) if after < meta.last else None
            return ReadResult([], lost, meta.ending, last_seq=meta.last), Offsets(None, logged)
        if not meta.known and not rows and not newest:
            # Every key gone: expired, deleted, or evicted (unless its producer lives: it
            # writes them again, and this reader waits).
            if not await self._producer_may_write(reply_id):
                return None, Offsets(None, logged)
        result, offsets = result_of(rows, after, READ_BATCH)
        if meta.lost and not rows:
            # Its producer was found lost (by a reader here or elsewhere): everything it
            # logged before is read, then that, at once and for good.
            result = ReadResult([], result.lost, None, producer_lost=True)
        return result, Offsets(offsets.before_first, logged)

    async def _producer_may_write(self, reply_id: str) -> bool:
        """Whether a reply whose keys are gone may still be written again by its producer:
        its liveness key is there, or Redis came back too recently to tell (a restart
        without its data, or a promoted replica behind its primary, lost every key of a live
        reply; its producer writes them again once it reaches Redis)."""
        if self._link.recovering():
            return True
        if await self.redis.exists(self._keys.key(reply_id, ":live")):
            return True
        # Gone, unless Redis restarted (or failed over) since this process last asked, too
        # quickly for any of its commands to fail: then its producer is writing it again.
        return await self._link.servers_changed()

    async def aclose(self) -> None:
        await self.watch.aclose()
