"""The log writer's failover half: finding out what Redis lost, and writing it again.

Failover: producers go on into their local copy (a ``MemoryReplayStore`` the store keeps of
every reply made here). Redis replicates asynchronously, so the promoted replica may lack
writes the old primary acknowledged; the writer finds out (a call failed, or its call count
was not the one its last call left: each flush's call checks it before it writes, and writes
nothing then, so no new event lands past a hole a reader elsewhere would take for lost;
``unexpected``) and repairs every reply it holds from its local copy before it writes
anything new (``redis_repair`` plans, ``redis_rewrite`` writes, an append only to a stream
still as it was read): re-appends what Redis lost, or rewrites a stream with a hole; or
whose Redis answers with another ``run_id`` than before (restarted, or failed over, with no
call failing meanwhile: ``redis_replaced``). What it no longer holds stays a hole, which
readers are told of as a gap. Past ``failover_s`` of failing, a write marks its live
replies (``failure``); the ended ones are written again whenever Redis answers, while this
process holds them; a ``create`` fails with the next flush that cannot reach Redis. A live
reply the heartbeat finds evicted is repaired the same way (``rewrite``).

This file decides which replies must be written again (marked dirty in ``ReplyTables``) and
when an outage has lasted too long, and writes the repairs; it owns when the outage began,
the store's call counts and the counts of repairs. Queueing and sending the writes is
``redis_log_writer``'s; it reads nothing for a reader.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError

from replystream.delivery.redis_call_counts import CallCounts, Verdict
from replystream.delivery.redis_connect import error_text
from replystream.delivery.redis_keys import ReplyKeys
from replystream.delivery.redis_link import COMMAND_TIMEOUT_S, RedisLink, live_hold_s
from replystream.delivery.redis_repair import LocalCopy, plan
from replystream.delivery.redis_reply_tables import ReplyTables
from replystream.delivery.redis_rewrite import stream_states, write_repair
from replystream.delivery.replay import MemoryReplayStore

log = logging.getLogger("replystream.redis_store")

_STALE = 2  # ``REPAIR_SCRIPT``'s answer for an append to a stream no longer as it was read


class Failover:
    """Finds what Redis lost of the replies produced here, and writes it again from their
    copy here."""

    def __init__(
        self,
        link: RedisLink,
        keys: ReplyKeys,
        local: MemoryReplayStore,
        tables: ReplyTables,
        wake: asyncio.Event,
        *,
        ttl_after_end_s: float,
        liveness_s: float,
        forget: Callable[[str], None],
        stop: Callable[[str], None],
    ) -> None:
        self._link = link
        self._keys = keys
        self.redis = link.redis
        self.local = local
        self._tables = tables
        self._wake = wake  # set: the flusher runs, and repairs before it writes
        self.ttl_after_end_s = ttl_after_end_s
        self.liveness_s = liveness_s
        # A reply found deleted on another replica: forgotten, and its producer stopped.
        self._forget = forget
        self._stop = stop
        self.outage_since: float | None = None  # since when writes fail
        # This store's count of its calls, in Redis (per slot group): short after a failover
        # that lost some.
        self._counts = CallCounts(live_hold_s(ttl_after_end_s, liveness_s))
        self.lost_writes = self.repairs = self.repaired_events = self.holes = 0
        self.evictions = 0

    # Eviction of a live reply, found by the heartbeat.

    def stream_lost(self, reply_id: str, length: int, written: dict[str, int] | None) -> bool:
        """Whether a live reply's stream holds fewer events than Redis acknowledged and keeps
        (it trims to this process's copy's first kept event, never past it)."""
        if written is None or reply_id in self._tables.dirty or self.outage_since is not None:
            return False  # unknown, or a repair is due anyway
        if reply_id in self._tables.failures:
            return False  # stopped writing: its log is not written again
        kept = written.get(reply_id, 0) - self.local.kept_from(reply_id) + 1
        return length < kept

    def rewrite(self, reply_id: str) -> None:
        """A live reply lost keys to eviction: it is written again from this process's copy
        (``redis_repair``), before anything queued after it."""
        self.evictions += 1
        self._tables.dirty.add(reply_id)
        self._wake.set()

    # Finding out what Redis lost.

    def counted(self, group: int, count: int, sent: float) -> None:
        """Redis's count of this store's calls (to one slot group), after one more, sent at
        ``sent``. Replication is ordered, so a count short of ours means Redis lost calls it
        had acknowledged, and with them whatever they wrote: every reply held here is checked
        and repaired."""
        self._judge(self._counts.after(group, count, sent, time.monotonic()))

    def expected(self, group: int, sent: float) -> int:
        """The count of this store's calls (to one slot group) Redis must hold before a call
        sent at ``sent`` writes anything (0: unknown, not checked)."""
        return self._counts.expected(group, sent, COMMAND_TIMEOUT_S)

    def unexpected(self, group: int, count: int, sent: float, reply_ids: Iterable[str]) -> None:
        """A flush's call sent at ``sent`` found Redis's count of this store's calls (to one
        slot group) at ``count``, not the last one seen, and wrote nothing: the replies it
        carried (``reply_ids``) are written from their copy here, with every reply Redis may
        lack, before anything new (it would land past the hole)."""
        self._tables.dirty.update(reply_ids)
        self._judge(self._counts.unexpected(group, count, sent))
        self._wake.set()

    def _judge(self, verdict: Verdict) -> None:
        """Mark what a verdict on the count says Redis may have lost (to be repaired)."""
        if verdict.kind == "evicted":
            # The count itself is gone: a maxmemory Redis evicted it. Writing every evicted
            # log again would only fill Redis again: the replies still being written are
            # checked; readers of the rest are told what was evicted.
            self.evictions += 1
            log.warning("this replica's write count was evicted from Redis (maxmemory)")
            self._tables.dirty.update(self._tables.live)
            self._wake.set()
        elif verdict.kind == "lost":
            self.lost_writes += 1
            log.warning("Redis lost %d acknowledged writes (a failover?)", verdict.calls)
            self._tables.dirty.update(self.local._logs)
            self._wake.set()
        elif verdict.kind == "elsewhere":
            # Two primaries answer (a demoted one still takes writes, until Sentinel makes it
            # a replica): each lacks what the other took; what the old one took will be lost.
            self.lost_writes += 1
            log.warning("Redis answering lacks writes another primary took (a failover under way?)")
            self._tables.dirty.update(self.local._logs)
            self._wake.set()

    def _ttl_left(self, reply_id: str) -> float:
        """How long Redis is to keep a reply written again: ``ttl_after_end_s`` from its end
        (the copy here keeps it a shorter while, from the same end), not from the repair, so
        a restart does not keep a reply past what ``--reply-ttl-s`` promises; a live reply's
        full TTL."""
        expires_at = self.local._logs[reply_id].expires_at
        if expires_at is None:
            return self.ttl_after_end_s
        ended_at = expires_at - self.local.ttl_after_end_s
        return max(1.0, ended_at + self.ttl_after_end_s - time.monotonic())

    def redis_replaced(self) -> None:
        """Another Redis answers than before (a restart, a failover) though no call here
        failed to tell of it: it may hold nothing written before. Every reply held here is
        checked and repaired, the ended ones too (as after a failed write)."""
        log.warning(
            "Redis answering is not the one before (restarted or failed over): checking "
            "every reply held here"
        )
        self._counts.forget()  # a count started again is no eviction
        self._tables.dirty.update(self.local._logs)
        self._wake.set()

    def write_failed(self, exc: Exception, reply_ids: Iterable[str]) -> None:
        """A write failed: it may or may not have landed. Every reply held here is repaired
        once Redis answers; past ``failover_s`` of failing, the live ones fail instead."""
        tables = self._tables
        now = time.monotonic()
        self._link.failed()
        self._counts.forget()  # the failed call's count is unknown
        # So a short count cannot tell what Redis lost meanwhile (a restart without its data,
        # a promoted replica behind its primary): every reply held here is checked, the
        # ended ones too.
        tables.dirty.update(reply_ids)
        tables.dirty.update(self.local._logs)
        if self.outage_since is None:
            self.outage_since = now
            log.warning(
                "reply log write to Redis failed (retrying %gs): %s",
                self._link.failover_s,
                error_text(exc),
            )
        if now - self.outage_since < self._link.failover_s:
            return
        # The live replies fail: their producers stop, rather than generate on for no reader
        # elsewhere. An ended one stays due: its copy here is whole, and is written once Redis
        # answers (the writer retries until then), so a reply that finished during the outage
        # can be read from any replica afterwards, as the ones before it can.
        failing = [reply_id for reply_id in tables.dirty if reply_id in tables.live]
        if failing:
            log.warning(
                "reply log writes to Redis failed for %gs: %s",
                self._link.failover_s,
                error_text(exc),
            )
        for reply_id in failing:
            tables.failures[reply_id] = f"Redis write failed: {error_text(exc)}"
            tables.pending.pop(reply_id, None)
            tables.endings.pop(reply_id, None)
            tables.dirty.discard(reply_id)

    # Writing it again.

    def _local_copy(self, reply_id: str) -> LocalCopy | None:
        log_ = self.local._logs.get(reply_id)
        if log_ is None or reply_id in self._tables.failures:
            return None
        entries = list(log_.entries)
        return LocalCopy(entries, log_.appended - log_.bytes, log_.ending, log_.next_seq)

    async def repair(self) -> str | None:
        """Make Redis hold what this process holds of every dirty reply; why not, if Redis
        cannot be reached yet."""
        tables = self._tables
        copies: dict[str, LocalCopy] = {}
        for reply_id in tables.dirty:
            copy = self._local_copy(reply_id)
            if copy is not None:
                copies[reply_id] = copy
                # Queued events and endings are in the copy: the repair writes them, in order.
                tables.pending.pop(reply_id, None)
                tables.endings.pop(reply_id, None)
        dirty = set(tables.dirty)
        sent = time.monotonic()
        per_slot = self._keys.one_slot_per_call
        groups = sorted({self._keys.group(r) for r in copies} | set(() if per_slot else (0,)))
        try:
            states = await stream_states(self.redis, self._keys.key, list(copies))
            for reply_id in [r for r in copies if states[r].deleted]:
                # Deleted on another replica meanwhile: stopped and forgotten, not written.
                del copies[reply_id]
                live = reply_id in tables.live
                self._forget(reply_id)
                if live:
                    self._stop(reply_id)
            repairs = {r: plan(copies[r], states[r]) for r in copies}
            async with self.redis.pipeline(transaction=False) as pipe:
                for reply_id, repair in repairs.items():
                    logged = write_repair(
                        pipe,
                        self._keys.key,
                        self.local._logs[reply_id].info,
                        repair,
                        states[reply_id],
                        ttl_s=self._ttl_left(reply_id),
                        live_s=self.liveness_s if reply_id in tables.live else None,
                        kept_from=self.local.kept_from(reply_id),
                    )
                    if logged is not None:
                        tables.logged[reply_id] = logged
                    elif reply_id not in tables.live:
                        tables.ended_unsent(reply_id)  # its ending is in this repair
                # Counted last, as a flush's call is: a count that survives vouches for these.
                hold = self._counts.ttl_s
                for group in groups:
                    pipe.incr(self._keys.counter_key(group))
                    pipe.expire(self._keys.counter_key(group), hold)
                results = await pipe.execute()
        except (RedisError, OSError) as exc:
            self.write_failed(exc, ())
            return error_text(exc)
        written = [r for r, repair in repairs.items() if repair.action != "nothing"]
        # An append to a stream found other than it was read (two primaries answering, in a
        # failover) wrote nothing: that reply is planned again, from a new read.
        stale = {r for r, done in zip(written, results, strict=False) if done == _STALE}
        tables.dirty -= dirty - stale
        self.outage_since = None
        self._link.recovered()
        counts = results[len(results) - 2 * len(groups) :: 2]
        for group, count in zip(groups, counts, strict=True):
            self.counted(group, int(count), sent)
        if stale:
            self._wake.set()
        done = [repairs[r] for r in written if r not in stale]
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
