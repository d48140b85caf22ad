"""The log writes of replies produced here: queued, flushed in batches, repaired after loss.

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued, across replies, in one script call per round trip (one per hash slot for
a Cluster: ``redis_writes``); ``create`` joins the next one and waits for it. The call ends
with the ending's marks in the metadata and an ``INCR`` of this store's count of its calls
(per slot for a Cluster). A write Redis refuses for one reply (its ids, its key's type) fails
that reply alone (``failure``: its producer stops with an in-band error); a call that fails as
a whole (a lost connection, a demoted primary) is a failover.

Failover: producers go on into their local copy (a ``MemoryReplayStore`` the store keeps of
every reply made here). Redis replicates asynchronously, so the promoted replica may lack
writes the old primary acknowledged; the writer finds out (a call failed, or its call count
came back short) and repairs every reply it holds from its local copy (``redis_repair``
plans, ``redis_rewrite`` writes): re-appends what Redis lost, or rewrites a stream with a
hole. What it no longer holds stays a hole, which readers are told of as a gap. Past
``failover_s`` of failing, a write marks its replies (``failure``); a ``create`` fails with
the next flush that cannot reach Redis. A live reply the heartbeat finds evicted is repaired
the same way (``rewrite``).

This file owns the state of replies produced here (which are live, queued, failed, deleted,
and the reads from elsewhere the heartbeat found); it reads nothing for a reader.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from redis.exceptions import RedisError

from replystream.delivery.redis_call_counts import CallCounts
from replystream.delivery.redis_keys import ReplyKeys
from replystream.delivery.redis_link import HEARTBEAT_S, RETRY_FIRST_S, RETRY_MAX_S, RedisLink
from replystream.delivery.redis_repair import LocalCopy, plan
from replystream.delivery.redis_rewrite import stream_states, write_repair
from replystream.delivery.redis_rows import text
from replystream.delivery.redis_writes import (
    WRITE_SCRIPT,
    Waiting,
    WriteBatch,
    flush_batches,
)
from replystream.delivery.replay import LogEntry, MemoryReplayStore, ReplyInfo

log = logging.getLogger("replystream.redis_store")


class LogWriter:
    """Gets the logs of replies produced here into Redis, and again after Redis lost them."""

    def __init__(
        self,
        link: RedisLink,
        keys: ReplyKeys,
        local: MemoryReplayStore,
        *,
        ttl_after_end_s: float,
        liveness_s: float,
        max_entries: int,
    ) -> None:
        self._link = link
        self._keys = keys
        self.redis = link.redis
        self.local = local
        self.ttl_after_end_s = ttl_after_end_s
        self.liveness_s = liveness_s
        self.max_entries = max_entries
        self.live: set[str] = set()  # replies produced here and not ended
        # Replies produced here, deleted before their end: what they append is dropped.
        self._deleted: set[str] = set()
        # Queued for the next flush: new replies (with what their ``create`` waits on: None,
        # or why the write failed), entries and endings.
        self._creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]] = []
        self._pending: dict[str, list[LogEntry]] = {}
        self._endings: dict[str, tuple[int, str]] = {}
        self._next_seq: dict[str, int] = {}
        # Replies whose writes failed: their producers stop, and Redis gets no more of them
        # (a repair too would fail, or write what Redis refused). Kept until the reply has
        # ended and its copy here is gone (``prune``).
        self._failures: dict[str, str] = {}
        self.wake = asyncio.Event()
        # One flush at a time: a reply's entries reach Redis in order, and the call counts
        # come back in order.
        self.flushing = asyncio.Lock()
        # Stops a reply's producer (``on_cancel``): a cancel, or a delete found in Redis.
        self.stop_producer: Callable[[str], None] | None = None
        # Replies produced here: when the heartbeat last found a reader's mark from elsewhere.
        self.read_elsewhere: dict[str, float] = {}
        self._logged: dict[str, int] = {}  # bytes sent to Redis per live reply: entries' offsets
        # When each live reply's keys must have their TTL refreshed (absent: not yet written).
        self._expire_due: dict[str, float] = {}
        self._write = self.redis.register_script(WRITE_SCRIPT)
        self.writes = 0  # script calls sent (for benchmarks)
        # Failover: replies whose log Redis may have lost part of; since when writes fail.
        self._dirty: set[str] = set()
        self._outage_since: float | None = None
        # This store's count of its calls, in Redis (per slot group): short after a failover
        # that lost some.
        self._counts = CallCounts(max(1, int(ttl_after_end_s)))
        self.lost_writes = self.repairs = self.repaired_events = self.holes = 0
        self.evictions = 0

    # Queueing.

    async def create(self, info: ReplyInfo) -> str | None:
        """Write a new reply's metadata with the next flush; why not, if it failed."""
        written: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._creates.append((info, written))
        # The flusher's next call sends it with everything else queued (a burst of new
        # replies shares one call, and none waits behind the others' writes).
        self.wake.set()
        failure = await written
        if failure is None:
            await self.local.create(info)
            self.live.add(info.reply_id)
        return failure

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        self.local.append(reply_id, entries)
        if reply_id in self._failures or reply_id in self._deleted or not entries:
            return
        pending = self._pending.get(reply_id)
        if pending is None:
            self._pending[reply_id] = list(entries)
        else:
            pending.extend(entries)
        self._next_seq[reply_id] = entries[-1].seq + 1
        self.wake.set()

    def end(self, reply_id: str, ending: str) -> None:
        self.local.end(reply_id, ending)
        self.live.discard(reply_id)
        self.read_elsewhere.pop(reply_id, None)
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
        self.wake.set()

    def failure(self, reply_id: str) -> str | None:
        return self._failures.get(reply_id)

    def forget(self, reply_id: str) -> None:
        """Drop everything queued or held here for a deleted reply; a producer still winding
        down may append and end it, to no effect."""
        if reply_id in self.live:
            self.live.discard(reply_id)
            self._deleted.add(reply_id)
        self._pending.pop(reply_id, None)
        self._endings.pop(reply_id, None)
        self._next_seq.pop(reply_id, None)
        self._failures.pop(reply_id, None)
        self._logged.pop(reply_id, None)
        self._expire_due.pop(reply_id, None)
        self.read_elsewhere.pop(reply_id, None)
        self._dirty.discard(reply_id)
        self.local.discard(reply_id)

    def prune(self) -> None:
        """Forget the failures of replies that ended and whose copy here is gone (expired,
        or discarded once read): nothing asks about them, and no repair can write them."""
        if not self._failures:
            return
        for reply_id in [r for r in self._failures if r not in self.live]:
            if self.local._log(reply_id) is None:  # expired copies go here and now
                del self._failures[reply_id]

    def stop(self, reply_id: str) -> None:
        """Stop a reply's producer, if this store has been told how."""
        if self.stop_producer is not None:
            self.stop_producer(reply_id)

    # Flushing.

    async def flush_forever(self) -> None:
        pause = RETRY_FIRST_S
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.flush()
            if self._outage_since is None:
                pause = RETRY_FIRST_S
                continue
            # Redis is unreachable: try again soon, appends or not (ended replies need
            # their repair too), without spinning on every append.
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
            self.wake.set()

    async def flush(self) -> None:
        """Repair what Redis may have lost, then send everything queued, across replies, in
        one script call (one per hash slot with ``one_slot_per_call``)."""
        async with self.flushing:
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
                key=self._keys.key,
                per_slot=self._keys.one_slot_per_call,
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
        argument = batch.argument(ttl, max(1, int(self.liveness_s)), self._keys.counter_key(group))
        sent = time.monotonic()
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
        self._counted(group, int(answer[0]), sent)

    async def acknowledged(self, live: list[str]) -> dict[str, int] | None:
        """How many events of each live reply Redis has acknowledged: those appended and no
        longer queued, once no call is in flight (None: one still is, after a while)."""
        try:
            async with asyncio.timeout(HEARTBEAT_S / 2), self.flushing:
                return {
                    reply_id: self._next_seq.get(reply_id, 1)
                    - 1
                    - len(self._pending.get(reply_id, ()))
                    for reply_id in live
                }
        except TimeoutError:
            return None

    # Eviction of a live reply, found by the heartbeat.

    def stream_lost(self, reply_id: str, length: int, written: dict[str, int] | None) -> bool:
        """Whether a live reply's stream holds fewer events than Redis acknowledged and keeps
        (it trims to about ``max_entries``, never below)."""
        if written is None or reply_id in self._dirty or self._outage_since is not None:
            return False  # unknown, or a repair is due anyway
        if reply_id in self._failures:
            return False  # stopped writing: its log is not written again
        return length < min(written.get(reply_id, 0), self.max_entries)

    def rewrite(self, reply_id: str) -> None:
        """A live reply lost keys to eviction: it is written again from this process's copy
        (``redis_repair``), before anything queued after it."""
        self.evictions += 1
        self._dirty.add(reply_id)
        self.wake.set()

    # Failover: finding out what Redis lost, and writing it again.

    def _counted(self, group: int, count: int, sent: float) -> None:
        """Redis's count of this store's calls (to one slot group), after one more, sent at
        ``sent``. Replication is ordered, so a count short of ours means Redis lost calls it
        had acknowledged, and with them whatever they wrote: every reply held here is checked
        and repaired."""
        verdict = self._counts.after(group, count, sent, time.monotonic())
        if verdict.kind == "evicted":
            # The count itself is gone: a maxmemory Redis evicted it. Writing every evicted
            # log again would only fill Redis again: the replies still being written are
            # checked; readers of the rest are told what was evicted.
            self.evictions += 1
            log.warning("this replica's write count was evicted from Redis (maxmemory)")
            self._dirty.update(self.live)
            self.wake.set()
        elif verdict.kind == "lost":
            self.lost_writes += 1
            log.warning("Redis lost %d acknowledged writes (a failover?)", verdict.calls)
            self._dirty.update(self.local._logs)
            self.wake.set()

    def _write_failed(self, exc: Exception, reply_ids: Iterable[str]) -> None:
        """A write failed: it may or may not have landed. Every reply held here is repaired
        once Redis answers; past ``failover_s`` of failing, the live ones fail instead."""
        now = time.monotonic()
        self._link.failed()
        self._counts.forget()  # the failed call's count is unknown
        # So a short count cannot tell what Redis lost meanwhile (a restart without its data,
        # a promoted replica behind its primary): every reply held here is checked, the
        # ended ones too.
        self._dirty.update(reply_ids)
        self._dirty.update(self.local._logs)
        if self._outage_since is None:
            self._outage_since = now
            log.warning(
                "reply log write to Redis failed (retrying %gs): %s", self._link.failover_s, exc
            )
        if now - self._outage_since < self._link.failover_s:
            return
        log.warning("reply log writes to Redis failed for %gs: %s", self._link.failover_s, exc)
        for reply_id in self._dirty:
            if reply_id in self.live:
                self._failures[reply_id] = f"Redis write failed: {exc}"
            else:  # ended: nothing more is sent of it, its ending if still queued neither
                self._ended_unsent(reply_id)
            self._pending.pop(reply_id, None)
            self._endings.pop(reply_id, None)
        self._dirty.clear()
        self._outage_since = None

    def _ended_unsent(self, reply_id: str) -> None:
        """An ended reply whose ending no flush will send (a repair wrote it, or writes
        failed for too long): the offsets and TTL kept for its next write go."""
        self._logged.pop(reply_id, None)
        self._expire_due.pop(reply_id, None)

    def _local_copy(self, reply_id: str) -> LocalCopy | None:
        log_ = self.local._logs.get(reply_id)
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
        sent = time.monotonic()
        per_slot = self._keys.one_slot_per_call
        groups = sorted({self._keys.group(r) for r in copies} | set(() if per_slot else (0,)))
        try:
            states = await stream_states(self.redis, self._keys.key, list(copies))
            for reply_id in [r for r in copies if states[r].deleted]:
                # Deleted on another replica meanwhile: stopped and forgotten, not written.
                del copies[reply_id]
                live = reply_id in self.live
                self.forget(reply_id)
                if live:
                    self.stop(reply_id)
            repairs = {r: plan(copies[r], states[r], kept=self.max_entries) for r in copies}
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id, repair in repairs.items():
                    logged = write_repair(
                        pipe,
                        self._keys.key,
                        self.local._logs[reply_id].info,
                        repair,
                        ttl_s=self.ttl_after_end_s,
                        live_s=self.liveness_s if reply_id in self.live else None,
                        max_entries=self.max_entries,
                    )
                    if logged is not None:
                        self._logged[reply_id] = logged
                    elif reply_id not in self.live:
                        self._ended_unsent(reply_id)  # its ending is in this repair
                # Counted last, as a flush's call is: a count that survives vouches for these.
                ttl = max(1, int(self.ttl_after_end_s))
                for group in groups:
                    pipe.incr(self._keys.counter_key(group))
                    pipe.expire(self._keys.counter_key(group), ttl)
                results = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._write_failed(exc, ())
            return str(exc)
        self._dirty -= dirty
        self._outage_since = None
        self._link.recovered()
        counts = results[len(results) - 2 * len(groups) :: 2]
        for group, count in zip(groups, counts, strict=True):
            self._counted(group, int(count), sent)
        done = [r for r in repairs.values() if r.action != "nothing"]
        if done:
            self.repairs += len(done)
            self.repaired_events += sum(len(r.entries) for r in done)
            self.holes += sum(r.missing for r in done)
            log.warning(
                "repaired %d reply logs: %d events Redis lacked (lost in a failover, or held "
                "back while it was unreachable), %d written, %d no longer held (a gap)",
                len(done),
                sum(r.lost for r in done),
                sum(len(r.entries) for r in done),
                sum(r.missing for r in done),
            )
        return None


def _settle(waiting: Waiting, failure: str | None) -> None:
    """Answer the creates waiting on a call: None once written, else why not."""
    for written in waiting:
        if not written.done():
            written.set_result(failure)
