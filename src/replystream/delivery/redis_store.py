"""The reply log in Redis Streams, so any replica can replay and follow any reply.

Layout, per reply (``P`` is the key prefix; ``{id}`` is the reply id in braces, a Redis
Cluster hash tag, so all of a reply's keys share one hash slot and one shard):
- ``P{id}``: a stream; entry ``0-<seq>`` holds one event and the log's size up to it, the
  terminal entry the ending (``delivery.redis_rows``). Trimmed to about ``max_entries``.
- ``P{id}:meta``: a hash with the owner and the route's context, the producer's heartbeat
  count (``beat``, bumped every second while it generates) and, once the reply has ended, its
  ending and last event's number (``end``, ``last``); ``P{id}:live``: the producer's liveness
  key, set for ``liveness_s`` and refreshed every second while it generates;
  ``P{id}:cancel``: a cancel request from another replica; ``P{id}:read``: a reader's mark,
  set for ``liveness_s`` and refreshed every second by each replica with a reader following
  the reply, which its producer's heartbeat finds (a detached reply goes on while read).
Every key lives ``ttl_after_end_s`` after the reply's end (refreshed while it is live). A
delete leaves ``P{id}:meta`` holding only ``deleted`` for as long: readers find nothing, a
repair writes nothing, and the producer, wherever it runs, finds it at its next heartbeat,
stops, and what it wrote meanwhile is deleted.

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued, across replies, in one script call per round trip (one per hash slot for
a Cluster: ``delivery.redis_writes``); ``create`` joins the next one and waits for it. The
call ends with the ending's marks in the metadata and an ``INCR`` of this store's count of
its calls (per slot for a Cluster). A write Redis refuses for one reply (its ids, its key's
type) fails that reply alone (``failure``: its producer stops with an in-band error); a call
that fails as a whole (a lost connection, a demoted primary) is a failover, below. A reader
of a reply produced elsewhere that has read what its stream holds waits on the one blocking
``XREAD`` this process shares (``delivery.redis_follow``). Replies produced here are also
kept in a local ``MemoryReplayStore``, so their own readers never wait on Redis.

Eviction (a ``maxmemory`` Redis evicts whole keys, any of the four, in any order): a reader
never takes a missing key for something else. A stream gone behind an ended reply is told as
a gap up to the ``last`` its metadata keeps, then the ending (not ``generator_lost``); a
missing liveness key is confirmed by the heartbeat count before a producer is called lost;
metadata gone behind a surviving stream is reported as evicted (``evicted``). The liveness
refresh (one call a second) bumps each live reply's heartbeat count and asks its stream's
length: a live producer writes its reply again from its copy when its count starts again at
1 (metadata gone) or its stream is shorter than what Redis acknowledged; until then, a stream
made anew by the next append starts late, which readers are told of as a gap. Only a reply
whose every key is gone reads as unknown.

Failover (Redis through Sentinel, a Cluster shard, or one Redis restarted): a write or a read
that fails is retried for ``failover_s`` (the promoted replica is reached through the same
client). Meanwhile producers go on into their local copy. Redis replicates asynchronously, so
the promoted replica may lack writes the old primary acknowledged; the store finds out (a
call failed, or its call count came back short) and repairs every reply it holds from its
local copy (``redis_repair``): re-appends what Redis lost, or rewrites a stream with a hole.
What it no longer holds stays a hole, which readers see as a jump in sequence numbers and are
told of (``lost``: a ``gap``). Past ``failover_s`` a write marks its replies (``failure``),
and reads raise ``StoreUnavailable``; a ``create`` fails with the next flush that cannot
reach Redis. This file must not know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from redis.crc import key_slot
from redis.exceptions import RedisError

from replystream.delivery.redis_connect import connect, parse_redis_url
from replystream.delivery.redis_follow import RemoteCursor, StreamWatch
from replystream.delivery.redis_repair import LocalCopy, plan
from replystream.delivery.redis_rewrite import stream_states, write_repair
from replystream.delivery.redis_rows import (
    META_READ,
    Meta,
    Offsets,
    newest_offset,
    result_of,
    seq_of,
    text,
)
from replystream.delivery.redis_writes import (
    DELETE_SCRIPT,
    HEARTBEAT_SCRIPT,
    WRITE_SCRIPT,
    Waiting,
    WriteBatch,
    flush_batches,
    slot_tag,
)
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
        # Replies produced here, deleted before their end: what they append is dropped.
        self._deleted: set[str] = set()
        # Queued for the next flush: new replies (with what their ``create`` waits on: None,
        # or why the write failed), entries and endings.
        self._creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]] = []
        self._pending: dict[str, list[LogEntry]] = {}
        self._endings: dict[str, tuple[int, str]] = {}
        self._next_seq: dict[str, int] = {}
        self._failures: dict[str, str] = {}
        self._wake = asyncio.Event()
        # One flush at a time: a reply's entries reach Redis in order, and the call counts
        # come back in order.
        self._flushing = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._on_cancel: Callable[[str], None] | None = None
        # Replies produced elsewhere that a reader here follows: when it last read each one.
        self._reading: dict[str, float] = {}
        # Replies produced here: when the heartbeat last found a reader's mark from elsewhere.
        self._read_elsewhere: dict[str, float] = {}
        self._logged: dict[str, int] = {}  # bytes sent to Redis per live reply: entries' offsets
        # When each live reply's keys must have their TTL refreshed (absent: not yet written).
        self._expire_due: dict[str, float] = {}
        # A Redis Cluster runs a script only on keys of one hash slot: against one, a flush
        # sends one call per slot (a reply's keys share its slot) instead of one for all.
        self.one_slot_per_call = self.target.kind == "cluster"
        self._write = self.redis.register_script(WRITE_SCRIPT)
        self._heartbeat = self.redis.register_script(HEARTBEAT_SCRIPT)
        self._delete = self.redis.register_script(DELETE_SCRIPT)
        self.writes = 0  # script calls sent (for benchmarks)
        self._watch = StreamWatch(self.redis, READ_BATCH, self._slot_of_key)
        self.failover_s = failover_s
        # Failover: replies whose log Redis may have lost part of; since when writes fail;
        # when a command last succeeded after failing (liveness keys may lag until refreshed).
        self._dirty: set[str] = set()
        self._outage_since: float | None = None
        self._recovered_at = -float("inf")
        # This store's count of its calls, in Redis (per slot group): short after a failover
        # that lost some.
        self._writer = f"{self.prefix}writer:{uuid.uuid4().hex}"
        self._writes_seen: dict[int, int] = {}
        self._lost_writes = self._repairs = self._repaired_events = self._holes = 0
        self._gaps = 0
        self._evictions = 0

    def _key(self, reply_id: str, part: str = "") -> str:
        # The braces make the id the key's hash tag: one slot for all of a reply's keys.
        return f"{self.prefix}{{{reply_id}}}{part}"

    def _slot_of_key(self, key: str) -> int:
        """Which call a key goes in: its hash slot with ``one_slot_per_call``, else 0."""
        return key_slot(key.encode()) if self.one_slot_per_call else 0

    def _group(self, reply_id: str) -> int:
        return self._slot_of_key(self._key(reply_id))

    def _counter_key(self, group: int) -> str:
        """The key of this store's count of its calls to ``group``: in that slot, for a
        Cluster (a call touches one slot only)."""
        if not self.one_slot_per_call:
            return self._writer
        return f"{self._writer}:{{{slot_tag(group)}}}"

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
        if reply_id in self._failures or reply_id in self._deleted or not entries:
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
        self._read_elsewhere.pop(reply_id, None)
        if reply_id in self._deleted:
            self._deleted.discard(reply_id)
            return
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
        """Repair what Redis may have lost, then send everything queued, across replies, in
        one script call (one per hash slot with ``one_slot_per_call``)."""
        async with self._flushing:
            if self._dirty:
                failure = await self._repair()
                if failure is not None:
                    # Redis cannot be reached: a new reply is refused now, not held.
                    creates, self._creates = self._creates, []
                    _settle([written for _, written in creates], failure)
                    return
            creates, self._creates = self._creates, []
            pending, self._pending = self._pending, {}
            endings, self._endings = self._endings, {}
            batches = flush_batches(
                creates,
                pending,
                endings,
                key=self._key,
                per_slot=self.one_slot_per_call,
                max_entries=self.max_entries,
                # A third of the TTL: a flush late by up to two thirds of it comes in time.
                refresh_s=max(1.0, self.ttl_after_end_s / 3),
                logged=self._logged,
                expire_due=self._expire_due,
            )
            if batches:
                await asyncio.gather(
                    *(self._send(group, *batch) for group, batch in batches.items())
                )

    async def _send(self, group: int, batch: WriteBatch, waiting: Waiting) -> None:
        """One script call; what Redis refused fails its reply; a call that failed as a
        whole is an outage (``_write_failed``), and fails the creates waiting on it."""
        ttl = max(1, int(self.ttl_after_end_s))
        argument = batch.argument(ttl, max(1, int(self.liveness_s)), self._counter_key(group))
        try:
            answer = await self._write(keys=batch.keys, args=[argument])
        except (RedisError, OSError) as exc:
            _settle(waiting, str(exc))
            self._write_failed(exc, batch.reply_ids)
            return
        self.writes += 1
        refused = answer[1:]
        for index, error in zip(refused[::2], refused[1::2], strict=True):
            reason = text(error)
            log.warning("reply log write to Redis refused: %s", reason)
            self._failures[batch.reply_ids[int(index)]] = f"Redis write failed: {reason}"
        _settle(waiting, None)
        self._counted(group, int(answer[0]))

    # Failover: finding out what Redis lost, and writing it again.

    def _counted(self, group: int, count: int) -> None:
        """Redis's count of this store's calls (to one slot group), after one more.
        Replication is ordered, so a count short of ours means Redis lost calls it had
        acknowledged, and with them whatever they wrote: every reply held here is checked and
        repaired."""
        seen = self._writes_seen.get(group)
        expected = None if seen is None else seen + 1
        self._writes_seen[group] = count
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

    def _write_failed(self, exc: Exception, reply_ids: Iterable[str]) -> None:
        """A write failed: it may or may not have landed. Every reply held here is repaired
        once Redis answers; past ``failover_s`` of failing, the live ones fail instead."""
        now = time.monotonic()
        self._writes_seen.clear()  # the failed call's count is unknown
        self._dirty.update(reply_ids)
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
            self._endings.pop(reply_id, None)
        self._dirty.clear()
        self._outage_since = None

    def _local_copy(self, reply_id: str) -> LocalCopy | None:
        log_ = self._local._logs.get(reply_id)
        if log_ is None or reply_id in self._failures:
            return None
        entries = list(log_.entries)
        return LocalCopy(entries, log_.appended - log_.bytes, log_.ending, log_.next_seq)

    async def _repair(self) -> str | None:
        """Make Redis hold what this process holds of every dirty reply; why not, if Redis
        cannot be reached yet."""
        copies: dict[str, LocalCopy] = {}
        for reply_id in self._dirty:
            copy = self._local_copy(reply_id)
            if copy is not None:
                copies[reply_id] = copy
                # Queued events and endings are in the copy: the repair writes them, in order.
                self._pending.pop(reply_id, None)
                self._endings.pop(reply_id, None)
        dirty = set(self._dirty)
        groups = sorted(
            {self._group(r) for r in copies} | set(() if self.one_slot_per_call else (0,))
        )
        try:
            states = await stream_states(self.redis, self._key, list(copies))
            for reply_id in [r for r in copies if states[r].deleted]:
                # Deleted on another replica meanwhile: stopped and forgotten, not written.
                del copies[reply_id]
                live = reply_id in self._live
                self._forget(reply_id)
                if live and self._on_cancel is not None:
                    self._on_cancel(reply_id)
            repairs = {r: plan(copies[r], states[r], kept=self.max_entries) for r in copies}
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id, repair in repairs.items():
                    logged = write_repair(
                        pipe,
                        self._key,
                        self._local._logs[reply_id].info,
                        repair,
                        ttl_s=self.ttl_after_end_s,
                        live_s=self.liveness_s if reply_id in self._live else None,
                        max_entries=self.max_entries,
                    )
                    if logged is not None:
                        self._logged[reply_id] = logged
                # Counted last, as a flush's call is: a count that survives vouches for these.
                ttl = max(1, int(self.ttl_after_end_s))
                for group in groups:
                    pipe.incr(self._counter_key(group))
                    pipe.expire(self._counter_key(group), ttl)
                results = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._write_failed(exc, ())
            return str(exc)
        self._dirty -= dirty
        self._outage_since = None
        self._recovered_at = time.monotonic()
        counts = results[len(results) - 2 * len(groups) :: 2]
        for group, count in zip(groups, counts, strict=True):
            self._counted(group, int(count))
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
        return None

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

    # The liveness refresh, once a second: liveness keys, cancels, eviction checks.

    async def _acknowledged(self, live: list[str]) -> dict[str, int] | None:
        """How many events of each live reply Redis has acknowledged: those appended and no
        longer queued, once no call is in flight (None: one still is, after a while)."""
        try:
            async with asyncio.timeout(HEARTBEAT_S / 2), self._flushing:
                return {
                    reply_id: self._next_seq.get(reply_id, 1)
                    - 1
                    - len(self._pending.get(reply_id, ()))
                    for reply_id in live
                }
        except TimeoutError:
            return None

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            live = list(self._live)
            if live:
                await self._refresh(live)
            reading = self._still_reading()
            if reading:
                await self._mark_read(reading)

    def _still_reading(self) -> list[str]:
        """Replies produced elsewhere that a reader here has read within ``liveness_s``."""
        since = time.monotonic() - self.liveness_s
        for reply_id in [r for r, at in self._reading.items() if at < since]:
            del self._reading[reply_id]
        return list(self._reading)

    async def _mark_read(self, replies: list[str]) -> None:
        """Leave each reply a reader's mark for its producer's heartbeat to find."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id in replies:
                    pipe.set(self._key(reply_id, ":read"), b"1", ex=max(1, int(self.liveness_s)))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("reader marks not refreshed: %s", exc)

    async def _refresh(self, live: list[str]) -> None:
        """Refresh the liveness of ``live`` replies, pass on the cancels asked for them, and
        find what Redis evicted of them: one script call (one per hash slot with
        ``one_slot_per_call``)."""
        # Taken before the call below is sent: a stream shorter than this then has lost
        # events it had acknowledged (Redis evicted it, perhaps made anew since).
        written = await self._acknowledged(live)
        groups: dict[int, list[str]] = {}
        for reply_id in live:
            groups.setdefault(self._group(reply_id), []).append(reply_id)
        await asyncio.gather(*(self._beat(replies, written) for replies in groups.values()))

    async def _beat(self, replies: list[str], written: dict[str, int] | None) -> None:
        keys: list[str] = []
        for reply_id in replies:
            keys += (
                self._key(reply_id, ":live"),
                self._key(reply_id, ":cancel"),
                self._key(reply_id, ":meta"),
                self._key(reply_id),
                self._key(reply_id, ":read"),
            )
        try:
            answer = await self._heartbeat(keys=keys, args=[max(1, int(self.liveness_s))])
        except (RedisError, OSError) as exc:
            log.warning("liveness refresh failed: %s", exc)
            return
        deleted = []
        for n, reply_id in enumerate(replies):
            cancelled, beat, length, read = answer[4 * n : 4 * n + 4]
            if read:
                self._read_elsewhere[reply_id] = time.monotonic()
            if beat == 0:  # deleted, on another replica: stop, and forget it here too
                deleted.append(reply_id)
                self._forget(reply_id)
            if cancelled and self._on_cancel is not None:
                self._on_cancel(reply_id)
            if beat == 0:
                continue
            if beat == 1:
                # The count started again: the metadata was gone (evicted, or lost in a
                # failover). Write the reply again from this process's copy.
                log.warning("reply %s: its metadata is gone; writing it again", reply_id[:8])
                self._evicted_live(reply_id)
            elif self._stream_lost(reply_id, int(length), written):
                log.warning("reply %s: its log is gone; writing it again", reply_id[:8])
                self._evicted_live(reply_id)
        if deleted:
            # A flush sent before they were forgotten may have landed after the script.
            async with self._flushing:
                for reply_id in deleted:
                    with contextlib.suppress(RedisError, OSError):
                        await self.redis.delete(self._key(reply_id), self._key(reply_id, ":live"))

    def _forget(self, reply_id: str) -> None:
        """Drop everything queued or held here for a deleted reply; a producer still winding
        down may append and end it, to no effect."""
        if reply_id in self._live:
            self._live.discard(reply_id)
            self._deleted.add(reply_id)
        self._pending.pop(reply_id, None)
        self._endings.pop(reply_id, None)
        self._next_seq.pop(reply_id, None)
        self._failures.pop(reply_id, None)
        self._logged.pop(reply_id, None)
        self._expire_due.pop(reply_id, None)
        self._read_elsewhere.pop(reply_id, None)
        self._dirty.discard(reply_id)
        self._local.discard(reply_id)

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

    # Reads.

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
            reply_id, owner=text(meta.get(b"owner")), context=text(meta.get(b"context"))
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
        async def look() -> tuple[Meta, bool]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(self._key(reply_id, ":meta"), META_READ)
                pipe.exists(self._key(reply_id))
                fields, logged = await pipe.execute()
            return Meta.of(fields), bool(logged)

        meta, logged = await self._retrying(look)
        if meta.known or meta.deleted or not logged:
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
        return self._counting(
            await self._retrying(lambda: self._read_waiting(reply_id, after, wait_s))
        )

    async def follow(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        """The next entries of a reply produced elsewhere, for a reader that has read the
        rest: from the one blocking XREAD every follower in this process shares (no command
        of its own); if none came within ``wait_s``, a read of its own tells whether the
        reply is still there and its producer alive."""
        return self._counting(
            await self._retrying(lambda: self._follow_once(reply_id, after, wait_s))
        )

    def _counting(
        self, read: tuple[ReadResult | None, Offsets]
    ) -> tuple[ReadResult | None, Offsets]:
        if read[0] is not None and read[0].lost is not None:
            self._gaps += 1
        return read

    async def _read_waiting(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        result, offsets = await self._read_remote(reply_id, after)
        if result is None or result.entries or result.lost or result.ending or wait_s <= 0:
            return result, offsets
        # Nothing new: wait for an entry on the read every follower here shares.
        return await self._follow_once(reply_id, after, wait_s)

    async def _follow_once(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]:
        key = self._key(reply_id)
        rows = await self._watch.after(key, after, min(wait_s, COMMAND_TIMEOUT_S / 2))
        if rows:
            return result_of(rows, after, READ_BATCH)
        result, offsets = await self._read_remote(reply_id, after)
        if result is None or result.entries or result.lost or result.ending:
            return result, offsets
        alive = self._recovering() or await self.redis.exists(self._key(reply_id, ":live"))
        if not alive:
            # Its liveness key is gone: expired (the producer died), or evicted. A live
            # producer's heartbeat count moves within a second; wait for it (or an event).
            beat = await self.redis.hget(self._key(reply_id, ":meta"), "beat")
            rows = await self._watch.after(key, after, BEAT_CONFIRM_S)
            if rows:
                return result_of(rows, after, READ_BATCH)
            result, offsets = await self._read_remote(reply_id, after)
            if result is None or result.entries or result.lost or result.ending:
                return result, offsets
            now = await self.redis.hget(self._key(reply_id, ":meta"), "beat")
            alive = now is not None and now != beat
        return ReadResult([], result.lost, None, producer_lost=not alive), offsets

    async def reading(self, reply_id: str) -> None:
        """A reader here has just read reply ``reply_id``, produced elsewhere and not ended:
        its mark is left at once the first time (the producer may be counting down its
        detach grace), then refreshed by the heartbeat while the reader goes on reading."""
        first = reply_id not in self._reading
        self._reading[reply_id] = time.monotonic()
        if first:
            self._ensure_tasks()
            await self._mark_read([reply_id])

    def read_elsewhere_at(self, reply_id: str) -> float | None:
        return self._read_elsewhere.get(reply_id)

    async def logged_bytes(self, reply_id: str) -> int | None:
        """The size of a reply's log in Redis so far (None: no event logged yet)."""
        newest = await self._retrying(
            lambda: self.redis.xrevrange(self._key(reply_id), max="+", min="-", count=2)
        )
        return newest_offset(newest)

    async def _read_remote(self, reply_id: str, after: int) -> tuple[ReadResult | None, Offsets]:
        key = self._key(reply_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(key, min=f"(0-{after}", max="+", count=READ_BATCH)
            pipe.hmget(self._key(reply_id, ":meta"), META_READ)
            # The newest event entry (the terminal entry, if any, comes after it).
            pipe.xrevrange(key, max="+", min="-", count=2)
            rows, fields, newest = await pipe.execute()
        logged = newest_offset(newest)
        meta = Meta.of(fields)
        if meta.deleted:
            return None, Offsets(None, None)
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
        result, offsets = result_of(rows, after, READ_BATCH)
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
        if reply_id in self._live and self._on_cancel is not None:
            self._on_cancel(reply_id)  # elsewhere, its producer hears at its next heartbeat
        self._forget(reply_id)
        keys = [self._key(reply_id, part) for part in ("", ":meta", ":live", ":cancel")]
        try:
            await self._delete(keys=keys, args=[max(1, int(self.ttl_after_end_s))])
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
        await self._watch.aclose()
        await self._local.aclose()
        await self.redis.aclose()


def _settle(waiting: Waiting, failure: str | None) -> None:
    """Answer the creates waiting on a call: None once written, else why not."""
    for written in waiting:
        if not written.done():
            written.set_result(failure)
