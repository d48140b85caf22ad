"""The store's heartbeat, once a second: liveness, cancels, deletes, evictions, reader marks.

For the replies produced here, one script call (one per hash slot for a Cluster:
``HEARTBEAT_SCRIPT``) refreshes each one's liveness key and its keys' TTL (a reply may make
no event for longer than the TTL and still live), bumps its heartbeat count, passes on
a cancel asked on another replica, finds a delete made on another replica (the producer stops
and what it wrote meanwhile is deleted) or the reply found lost there (this process stalled
past its liveness: its producer stops, as its readers elsewhere were told), tells whether a
reader elsewhere follows it (its reader mark: a detached reply goes on while read), and asks
its stream's length. A count
started again at 1 (the metadata was gone) or a stream shorter than what Redis acknowledged
means Redis evicted part of the reply: the writer writes it again from its copy
(``Failover.rewrite``). For the replies produced elsewhere that a reader here follows, it
refreshes their reader marks. Beside the beats, one at a time, it asks whether another Redis
answers than at the last time (``RedisLink.servers_changed``: a restart or failover no failed
call told of), and if so has every reply held here written again. A beat waits for each of
its calls at most ``BEAT_CALL_S``, so that a node that does not answer holds back neither the
replies on the others nor the next beat. A failed beat is tried again a second later; an
outage is logged once as it begins and once as it ends (``OutageLog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from replystream.delivery.redis_connect import error_text
from replystream.delivery.redis_keys import ReplyKeys
from replystream.delivery.redis_link import HEARTBEAT_S, RedisLink
from replystream.delivery.redis_log_writer import LogWriter
from replystream.delivery.redis_writes import HEARTBEAT_SCRIPT
from replystream.outage_log import OutageLog

log = logging.getLogger("replystream.redis_store")

# The most a beat waits for each of its calls to Redis. A node that does not answer (dark, or
# hung) would hold each beat for the command timeout: the liveness of every reply, on the
# shards that answer too, then lapsed, and readers on other replicas called live producers
# lost. Cut short there, a beat comes at least every HEARTBEAT_S + 1 s (this, and the writer's
# own bound on ``acknowledged``), within a reader's BEAT_CONFIRM_S; the call cut short counts
# as failed, as Redis unreachable does. Asking which Redis answers (``servers_changed``, and
# through Sentinel which one is the primary) is not cut short but runs beside the beats, one
# at a time: Sentinels that do not answer are given up on one by one, the next one asked.
BEAT_CALL_S = HEARTBEAT_S / 2


class Heartbeat:
    """The once-a-second refresh of every reply this process produces or reads from afar."""

    def __init__(self, link: RedisLink, keys: ReplyKeys, writer: LogWriter) -> None:
        self._keys = keys
        self._writer = writer
        self._link = link
        self.redis = link.redis
        self.liveness_s = link.liveness_s
        self._heartbeat = self.redis.register_script(HEARTBEAT_SCRIPT)
        # Replies produced elsewhere that a reader here follows: when it last read each one,
        # how many readers here follow it, and those whose last reader here has just left
        # (their marks are taken away at the next beat, so their producers' detach grace
        # runs from about when the reader left, not a mark's lifetime later).
        self._reading: dict[str, float] = {}
        self._readers: dict[str, int] = {}
        self._left: set[str] = set()
        # While Redis is down these fail every second: told once as they begin, once as
        # they end.
        self._refresh_outage = OutageLog(log, "liveness refresh", error_text)
        self._marks_outage = OutageLog(log, "reader marks' refresh", error_text)

    async def beat_forever(self) -> None:
        async with asyncio.TaskGroup() as group:
            checking: asyncio.Task[None] | None = None
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                if checking is None or checking.done():
                    checking = group.create_task(self._check_servers())
                try:
                    await self._beat_once()
                except Exception:
                    # Not Redis's failure (each call below tells of those) but a bug, ours or
                    # the client library's: told, and the next beat comes all the same.
                    # Ended, no reply of this process would be kept alive, or hear of a
                    # cancel, again.
                    log.exception("the reply store's heartbeat failed")

    async def _beat_once(self) -> None:
        self._writer.prune()
        live = list(self._writer.tables.live)
        if live:
            await self._refresh(live)
        else:
            self._refresh_outage.idle()
        reading = self._still_reading()
        if reading:
            await self._mark_read(reading)
        else:
            self._marks_outage.idle()
        left = [reply_id for reply_id in self._left if reply_id not in self._readers]
        self._left.clear()
        if left:
            await self._unmark(left)

    async def _check_servers(self) -> None:
        """Whether another Redis answers than at the last beat (restarted, or failed over):
        if so, the link has what this process holds written again (a failure of the call is
        an outage, which the writes find and tell of themselves)."""
        try:
            await self._link.servers_changed()
        except (RedisError, OSError):
            pass
        except Exception:  # a bug: told, and asked again at the next beat
            log.exception("asking which Redis answers failed")

    async def reading(self, reply_id: str, joined: bool = False) -> None:
        """A reader here has just read reply ``reply_id``, produced elsewhere and not ended
        (``joined``: its first such read): its mark is left at once the first time (the
        producer may be counting down its detach grace), then refreshed by the heartbeat
        while the reader goes on reading."""
        if joined:
            self._readers[reply_id] = self._readers.get(reply_id, 0) + 1
        first = reply_id not in self._reading
        self._reading[reply_id] = time.monotonic()
        if first:
            await self._mark_read([reply_id])

    def left(self, reply_id: str) -> None:
        """A reader here that had joined reply ``reply_id`` (``reading``) is done with it."""
        count = self._readers.get(reply_id, 0) - 1
        if count > 0:
            self._readers[reply_id] = count
            return
        self._readers.pop(reply_id, None)
        self._reading.pop(reply_id, None)
        self._left.add(reply_id)

    def _still_reading(self) -> list[str]:
        """Replies produced elsewhere that a reader here has read within ``liveness_s``."""
        since = time.monotonic() - self.liveness_s
        for reply_id in [r for r, at in self._reading.items() if at < since]:
            del self._reading[reply_id]
        return list(self._reading)

    async def _mark_read(self, replies: list[str]) -> None:
        """Leave each reply a reader's mark for its producer's heartbeat to find."""
        try:
            async with _within_a_beat(), self.redis.pipeline(transaction=False) as pipe:
                for reply_id in replies:
                    pipe.set(
                        self._keys.key(reply_id, ":read"), b"1", ex=max(1, int(self.liveness_s))
                    )
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._marks_outage.failed(exc)
            self._link.write_failed(exc)
            return
        self._marks_outage.succeeded()
        self._link.write_taken()

    async def _unmark(self, replies: list[str]) -> None:
        """Take away the marks of replies no reader here follows any more (a mark Redis
        cannot drop now lapses by itself within ``liveness_s``)."""
        try:
            async with _within_a_beat():
                await self.redis.delete(*(self._keys.key(r, ":read") for r in replies))
        except (RedisError, OSError) as exc:
            self._marks_outage.failed(exc)

    async def _refresh(self, live: list[str]) -> None:
        """Refresh the liveness of ``live`` replies, pass on the cancels asked for them, and
        find what Redis evicted of them: one script call (one per hash slot with
        ``one_slot_per_call``)."""
        # Taken before the call below is sent: a stream shorter than this then has lost
        # events it had acknowledged (Redis evicted it, perhaps made anew since).
        written = await self._writer.acknowledged(live)
        groups: dict[int, list[str]] = {}
        for reply_id in live:
            groups.setdefault(self._keys.group(reply_id), []).append(reply_id)
        failures = await asyncio.gather(
            *(self._beat(replies, written) for replies in groups.values())
        )
        failure = next((exc for exc in failures if exc is not None), None)
        if failure is None:
            self._refresh_outage.succeeded()
            self._link.write_taken()
        else:
            self._refresh_outage.failed(failure)
            self._link.write_failed(failure)

    async def _beat(self, replies: list[str], written: dict[str, int] | None) -> Exception | None:
        """One slot group's beat; why it failed, if it did."""
        keys: list[str] = []
        for reply_id in replies:
            keys += (
                self._keys.key(reply_id, ":live"),
                self._keys.key(reply_id, ":cancel"),
                self._keys.key(reply_id, ":meta"),
                self._keys.key(reply_id),
                self._keys.key(reply_id, ":read"),
            )
        try:
            async with _within_a_beat():
                answer = await self._heartbeat(
                    keys=keys,
                    args=[max(1, int(self.liveness_s)), self._writer.hold_s],
                )
        except (RedisError, OSError) as exc:
            return exc
        writer = self._writer
        deleted = []
        for n, reply_id in enumerate(replies):
            cancelled, beat, length, read = answer[4 * n : 4 * n + 4]
            if read:
                writer.tables.read_elsewhere[reply_id] = time.monotonic()
            if beat == 0:  # deleted, on another replica: stop, and forget it here too
                deleted.append(reply_id)
                writer.forget(reply_id)
            if cancelled:
                writer.stop(reply_id)
            if beat == -1:  # found lost while this process stalled: it ends as told
                writer.taken_for_lost(reply_id)
                continue
            if beat == 0:
                continue
            if beat == 1:
                # The count started again: the metadata was gone (evicted, or lost in a
                # failover). Write the reply again from this process's copy.
                log.warning("reply %s: its metadata is gone; writing it again", reply_id[:8])
                writer.failover.rewrite(reply_id)
            elif writer.failover.stream_lost(reply_id, int(length), written):
                log.warning("reply %s: its log is gone; writing it again", reply_id[:8])
                writer.failover.rewrite(reply_id)
        if deleted:
            # A flush sent before they were forgotten may have landed after the script.
            async with writer.flushing:
                for reply_id in deleted:
                    with contextlib.suppress(RedisError, OSError):
                        await self.redis.delete(
                            self._keys.key(reply_id), self._keys.key(reply_id, ":live")
                        )
        return None


@contextlib.asynccontextmanager
async def _within_a_beat() -> AsyncIterator[None]:
    """A beat's call to Redis, cut short past ``BEAT_CALL_S`` as Redis's own command timeout
    is (a ``RedisError``, which every caller takes for Redis not answering)."""
    try:
        async with asyncio.timeout(BEAT_CALL_S):
            yield
    except TimeoutError:
        raise RedisTimeoutError(f"Redis did not answer within {BEAT_CALL_S:g} s") from None
