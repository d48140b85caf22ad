"""The log writes of replies produced here: queued, flushed in batches, repaired after loss.

Writes never wait: ``append`` and ``end`` queue entries for one flusher task, which sends
everything queued, across replies, in one script call per round trip (one per hash slot for
a Cluster: ``redis_writes``); ``create`` joins the next one and waits for it. The call ends
with the ending's marks in the metadata and an ``INCR`` of this store's count of its calls
(per slot for a Cluster), and begins by checking that count: one other than its last call
left (Redis lost calls it had acknowledged, or another primary took them) writes nothing. A
write Redis refuses for one reply (its ids, its key's type) fails that reply alone
(``failure``: its producer stops with an in-band error); a call that fails as a whole (a
lost connection, a demoted primary), or finds another count, is a failover, which
``redis_failover`` handles: before its next write, the flusher has it write again what Redis
lost, so no event is written past a hole.

This file queues and sends the writes; the state of the replies produced here (which are
live, queued, failed, deleted, and the reads from elsewhere the heartbeat found) is
``redis_reply_tables``'s, which both halves change. It reads nothing for a reader.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from replystream.delivery.redis_connect import error_text
from replystream.delivery.redis_failover import Failover
from replystream.delivery.redis_keys import ReplyKeys
from replystream.delivery.redis_link import (
    HEARTBEAT_S,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    RedisLink,
    live_hold_s,
    ttl_whole_s,
)
from replystream.delivery.redis_reply_tables import ReplyTables
from replystream.delivery.redis_rows import text
from replystream.delivery.redis_writes import (
    LOST_REFUSAL,
    WRITE_SCRIPT,
    Waiting,
    WriteBatch,
    flush_batches,
)
from replystream.delivery.replay import LogEntry, MemoryReplayStore, ReplyInfo

log = logging.getLogger("replystream.redis_store")

# Rounds of one flush, at most (a repair, then calls that may find another count and write
# nothing): Redis losing writes again and again, the flusher goes on at its next wake.
_ROUNDS = 3


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
    ) -> None:
        self._keys = keys
        self.redis = link.redis
        self.local = local
        self.ttl_after_end_s = ttl_after_end_s
        self.liveness_s = liveness_s
        # How long a live reply's keys, and a cancel's or a delete's mark, are kept from each
        # refresh: the TTL, never less than the gap between two beats.
        self.hold_s = live_hold_s(ttl_after_end_s, liveness_s)
        self.tables = ReplyTables()
        # Queued for the next flush: new replies, with what their ``create`` waits on (None,
        # or why the write failed).
        self._creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]] = []
        # Every create still waiting, queued or in a call: what a flush that failed as no
        # Redis error does (a bug) must answer, or its requests would wait forever.
        self._waiting: set[asyncio.Future[str | None]] = set()
        self.wake = asyncio.Event()
        # One flush at a time: a reply's entries reach Redis in order, and the call counts
        # come back in order.
        self.flushing = asyncio.Lock()
        # Stops a reply's producer (``on_cancel``): a cancel, or a delete found in Redis.
        self.stop_producer: Callable[[str], None] | None = None
        # Stops a reply's producer as lost (``on_lost``): readers elsewhere were told so.
        self.lost_producer: Callable[[str], None] | None = None
        self._write = self.redis.register_script(WRITE_SCRIPT)
        self.writes = 0  # script calls sent (for benchmarks)
        self.failover = Failover(
            link,
            keys,
            local,
            self.tables,
            self.wake,
            ttl_after_end_s=ttl_after_end_s,
            liveness_s=liveness_s,
            forget=self.forget,
            stop=self.stop,
        )

    # Queueing.

    async def create(self, info: ReplyInfo) -> str | None:
        """Write a new reply's metadata with the next flush; why not, if it failed."""
        written: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._creates.append((info, written))
        # The flusher's next call sends it with everything else queued (a burst of new
        # replies shares one call, and none waits behind the others' writes).
        self.wake.set()
        self._waiting.add(written)
        try:
            failure = await written
        finally:
            self._waiting.discard(written)
        if failure is None:
            await self.local.create(info)
            self.tables.live.add(info.reply_id)
        return failure

    def append(self, reply_id: str, entries: Sequence[LogEntry]) -> None:
        self.local.append(reply_id, entries)
        tables = self.tables
        if reply_id in tables.failures or reply_id in tables.deleted or not entries:
            return
        pending = tables.pending.get(reply_id)
        if pending is None:
            tables.pending[reply_id] = list(entries)
        else:
            pending.extend(entries)
        tables.next_seq[reply_id] = entries[-1].seq + 1
        self.wake.set()

    def end(self, reply_id: str, ending: str) -> None:
        self.local.end(reply_id, ending)
        tables = self.tables
        tables.live.discard(reply_id)
        tables.read_elsewhere.pop(reply_id, None)
        if reply_id in tables.deleted:
            tables.deleted.discard(reply_id)
            return
        # The terminal entry takes the next sequence number.
        seq = tables.next_seq.pop(reply_id, 1)
        if reply_id in tables.failures:
            tables.ended_unsent(reply_id)
            return
        tables.endings[reply_id] = (seq, ending)
        self.wake.set()

    def failure(self, reply_id: str) -> str | None:
        return self.tables.failures.get(reply_id)

    def forget(self, reply_id: str) -> None:
        """Drop everything queued or held here for a deleted reply; a producer still winding
        down may append and end it, to no effect."""
        self.tables.forget(reply_id)
        self.local.discard_deleted(reply_id)

    def prune(self) -> None:
        """Forget the failures of replies that ended and whose copy here is gone (expired,
        or discarded once read): nothing asks about them, and no repair can write them."""
        failures = self.tables.failures
        if not failures:
            return
        for reply_id in [r for r in failures if r not in self.tables.live]:
            if self.local._log(reply_id) is None:  # expired copies go here and now
                del failures[reply_id]
                self.tables.lost.discard(reply_id)

    def stop(self, reply_id: str) -> None:
        """Stop a reply's producer, if this store has been told how."""
        if self.stop_producer is not None:
            self.stop_producer(reply_id)

    def taken_for_lost(self, reply_id: str) -> None:
        """A reader on another replica found this reply's producer lost (this process was
        stalled past its liveness: stopped, frozen) and told its readers so
        (``redis_writes.LOST_SCRIPT``): Redis takes nothing more of it, and its producer
        stops, its readers here told the same."""
        tables = self.tables
        tables.failures[reply_id] = "its producer was found lost on another replica"
        tables.lost.add(reply_id)
        tables.pending.pop(reply_id, None)
        tables.endings.pop(reply_id, None)
        tables.dirty.discard(reply_id)
        if reply_id not in tables.live:
            tables.ended_unsent(reply_id)
        elif self.lost_producer is not None:
            self.lost_producer(reply_id)

    # Flushing.

    async def flush_forever(self) -> None:
        pause = RETRY_FIRST_S
        while True:
            await self.wake.wait()
            self.wake.clear()
            try:
                await self.flush()
            except Exception as exc:
                # Not Redis's failure (those are handled where they happen) but a bug, ours
                # or the client library's: told once per flush, and no create waits forever.
                log.exception("writing reply logs to Redis failed")
                self._creates.clear()
                _settle(list(self._waiting), f"writing to Redis failed ({type(exc).__name__})")
            if self.failover.outage_since is None:
                pause = RETRY_FIRST_S
                continue
            # Redis is unreachable: try again soon, appends or not (ended replies need
            # their repair too), without spinning on every append.
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)
            self.wake.set()

    async def flush(self) -> None:
        """Repair what Redis may have lost, then send everything queued, across replies, in
        one script call (one per hash slot with ``one_slot_per_call``); a call that found
        Redis lacking calls it had acknowledged wrote nothing: repaired, then sent again."""
        async with self.flushing:
            for _ in range(_ROUNDS):
                if not await self._flush_once():
                    return
        self.wake.set()  # lost again and again: the flusher goes on

    async def _flush_once(self) -> bool:
        """One repair if due, then one call per slot group; whether to go again: a call found
        another count (nothing of it written), or more was found to repair."""
        tables = self.tables
        if tables.dirty:
            failure = await self.failover.repair()
            if failure is not None:
                # Redis cannot be reached: a new reply is refused now, not held.
                creates, self._creates = self._creates, []
                _settle([written for _, written in creates], failure)
                return False
            if tables.dirty:
                # Found during the repair (a heartbeat found another Redis answering, which
                # also makes the count unknown): repaired too before anything is written.
                return True
        creates, self._creates = self._creates, []
        pending, tables.pending = tables.pending, {}
        endings, tables.endings = tables.endings, {}
        batches = flush_batches(
            creates,
            pending,
            endings,
            key=self._keys.key,
            per_slot=self._keys.one_slot_per_call,
            kept_from=self.local.kept_from,
            # A third of the TTL: a flush late by up to two thirds of it comes in time.
            refresh_s=max(1.0, self.ttl_after_end_s / 3),
            logged=tables.logged,
            expire_due=tables.expire_due,
        )
        if not batches:
            return False
        # Each call's argument, with the count Redis must hold before it, is made now,
        # with nothing dirty: what is found from here on is found by these calls.
        sent = time.monotonic()
        ttl, liveness = ttl_whole_s(self.ttl_after_end_s), max(1, int(self.liveness_s))
        calls = [
            (
                group,
                batch,
                waiting,
                batch.argument(
                    ttl,
                    self.hold_s,
                    liveness,
                    self._keys.counter_key(group),
                    self.failover.expected(group, sent),
                ),
            )
            for group, (batch, waiting) in batches.items()
        ]
        unwritten = await asyncio.gather(*(self._send(*call, sent) for call in calls))
        if all(waiting is None for waiting in unwritten):
            return False
        # Their creates go first in the next call, after the repair.
        again = {written for waiting in unwritten if waiting for written in waiting}
        self._creates[:0] = [create for create in creates if create[1] in again]
        return True

    async def _send(
        self, group: int, batch: WriteBatch, waiting: Waiting, argument: str, sent: float
    ) -> Waiting | None:
        """One script call; what Redis refused fails its reply; a call that failed as a
        whole is an outage (``Failover.write_failed``), and fails the creates waiting on it.
        A call that found another count (``Failover.unexpected``) wrote nothing: the creates
        waiting on it are returned, to be sent again (None: the call is done with)."""
        try:
            answer = await self._write(keys=batch.keys, args=[argument])
        except (RedisError, OSError) as exc:
            _settle(waiting, error_text(exc))
            self.failover.write_failed(exc, batch.reply_ids)
            return None
        self.writes += 1
        if int(answer[0]) == 0:
            self.failover.unexpected(group, int(answer[1]), sent, batch.reply_ids)
            return waiting
        refused = answer[1:]
        for index, error in zip(refused[::2], refused[1::2], strict=True):
            reason, reply_id = text(error), batch.reply_ids[int(index)]
            if reason == LOST_REFUSAL:
                self.taken_for_lost(reply_id)
                continue
            log.warning("reply log write to Redis refused: %s", reason)
            self.tables.failures[reply_id] = f"Redis write failed: {reason}"
        _settle(waiting, None)
        self.failover.counted(group, int(answer[0]), sent)
        return None

    async def acknowledged(self, live: list[str]) -> dict[str, int] | None:
        """How many events of each live reply Redis has acknowledged: those appended and no
        longer queued, once no call is in flight (None: one still is, after a while)."""
        try:
            async with asyncio.timeout(HEARTBEAT_S / 2), self.flushing:
                next_seq, pending = self.tables.next_seq, self.tables.pending
                return {
                    reply_id: next_seq.get(reply_id, 1) - 1 - len(pending.get(reply_id, ()))
                    for reply_id in live
                }
        except TimeoutError:
            return None


def _settle(waiting: Waiting, failure: str | None) -> None:
    """Answer the creates waiting on a call: None once written, else why not."""
    for written in waiting:
        if not written.done():
            written.set_result(failure)
