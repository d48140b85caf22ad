"""Readers of replies produced on other replicas follow them through one blocking XREAD.

A reader that has read everything a stream holds waits for what comes next. With a command
(and a blocking ``XREAD``) of its own per reader, a few hundred readers need a few hundred
pooled connections at once, and each new entry costs each reader a round trip of three
commands. Here every following reader of this process shares one call: ``StreamWatch.after``
registers a stream and the last entry the reader has; one task reads every registered stream
at once (blocking for at most ``BLOCK_MS``, then again with the streams registered since)
and hands each reader the entries after its own. A reader registered while a call is under
way is in the next one: at most ``BLOCK_MS`` later, sooner if any stream in the current call
gets an entry. A Redis Cluster takes a command's keys from one hash slot only: there the
call is one ``XREAD`` per slot, sent together. The shared call fails as one: every reader
waiting on it gets its error (and retries). A reader's place and lag (``RemoteCursor``)
follow from what its reads returned. This file knows stream keys and entry ids
(``0-<seq>``), not what entries hold (``redis_rows`` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import RedisError

from replystream.delivery.redis_connect import RedisClient
from replystream.delivery.redis_rows import Newest, Offsets
from replystream.delivery.replay import Gone, Lag, ReadResult
from replystream.delivery.task_stop import stop_task

BLOCK_MS = 50
Rows = list[tuple[bytes, dict[bytes, bytes]]]  # (entry id, fields), as XRANGE answers
_Outcome = Rows | BaseException


class FollowedStore(Protocol):
    """The reads a ``RemoteCursor`` makes of the store (``RedisReplayStore``)."""

    async def read_measured(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]: ...

    async def follow(
        self, reply_id: str, after: int, wait_s: float
    ) -> tuple[ReadResult | None, Offsets]: ...

    async def newest_write(self, reply_id: str) -> Newest: ...

    async def gone(self, reply_id: str) -> Gone | None: ...

    async def reading(self, reply_id: str, joined: bool = False) -> None: ...

    def left(self, reply_id: str) -> None: ...


class RemoteCursor:
    """A reader's place in a reply produced on another replica. Its lag is the log's size
    at the last read, less the bytes up to the reader's place, both from the offsets every
    entry carries (``b``)."""

    __slots__ = ("_following", "_joined", "_logged", "_sent_upto", "_store", "after", "reply_id")

    def __init__(self, store: FollowedStore, reply_id: str, after: int) -> None:
        self._store = store
        self.reply_id = reply_id
        self.after = after
        self._sent_upto: int | None = None  # bytes up to ``after``, known from the first read
        self._logged = 0
        # The last read found the reply, not ended: the next waits on the shared XREAD first.
        self._following = False
        self._joined = False  # counted among the reply's readers here (until ``close``)

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
        if self._following:
            joined = not self._joined
            self._joined = True
            # Its producer keeps it going for us.
            await self._store.reading(self.reply_id, joined=joined)
        return result

    async def gone(self) -> Gone | None:
        return await self._store.gone(self.reply_id)

    def close(self) -> None:
        if self._joined:
            self._joined = False
            self._store.left(self.reply_id)

    def sent(self, upto: int, log_bytes: int) -> None:
        self.after = upto
        if self._sent_upto is not None:
            self._sent_upto += log_bytes

    def lag_bytes(self) -> int:
        return 0 if self._sent_upto is None else max(0, self._logged - self._sent_upto)

    async def measure(self) -> Lag:
        newest = await self._store.newest_write(self.reply_id)
        if self._following:
            # Asked while its reader waits on a slow socket (within the slow-client limits),
            # reading nothing from Redis: it is a reader all the same, and its producer keeps
            # the reply going for it only while its mark stays.
            await self._store.reading(self.reply_id)
        if newest.logged is not None:
            self._logged = newest.logged
        lag = self.lag_bytes()
        return Lag(lag, min(lag, newest.latest))


class StreamWatch:
    """One ``XREAD`` at a time for every stream some reader of this process follows."""

    def __init__(
        self, redis: RedisClient, count: int, slot_of: Callable[[str], int] | None = None
    ) -> None:
        self._redis = redis
        self._count = count  # entries per stream per call, at most
        # A key's hash slot, when one call may touch one slot only (a Cluster); None: one call.
        self._slot_of = slot_of
        # Per stream key: (the last entry a reader has, what it waits on).
        self._waiting: dict[str, list[tuple[int, asyncio.Future[_Outcome]]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.calls = 0  # XREADs sent (for tests and benchmarks)

    async def after(self, key: str, after: int, wait_s: float) -> Rows:
        """Entries of stream ``key`` after ``0-after`` (up to ``count``) as soon as there are
        some; none if ``wait_s`` passed first. Raises what the shared call failed with
        (``RedisError``, ``OSError``)."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[_Outcome] = loop.create_future()
        waiter = (after, woken)
        self._waiting.setdefault(key, []).append(waiter)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._watch(), name="redis-stream-watch")
        try:
            async with asyncio.timeout(wait_s):
                outcome = await woken
        except TimeoutError:
            return []
        finally:
            waiters = self._waiting.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[key]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _watch(self) -> None:
        while self._waiting:
            calls: dict[int, dict[Any, Any]] = {}
            cursors: dict[str, int] = {}  # per key, the entry this call reads after
            for key, waiters in self._waiting.items():
                slot = self._slot_of(key) if self._slot_of is not None else 0
                cursors[key] = min(after for after, _ in waiters)
                calls.setdefault(slot, {})[key] = f"0-{cursors[key]}"
            try:
                answers = await asyncio.gather(
                    *(
                        self._redis.xread(streams, count=self._count, block=BLOCK_MS)
                        for streams in calls.values()
                    )
                )
            except (RedisError, OSError) as exc:
                self._wake_all(exc)
                continue
            self.calls += len(calls)
            for found in answers:
                for key, rows in _answered(found):
                    self._hand_over(key, rows, cursors.get(key))

    def _hand_over(self, key: str, rows: Rows, cursor: int | None) -> None:
        """Give each reader of ``key`` the entries after its own; keep those with none, and
        those registered during the call behind its ``cursor``: the call did not read their
        next entries, and the next call does (handing them what it read would skip those)."""
        waiters = self._waiting.get(key)
        if not waiters or not rows:
            return
        kept = []
        for after, woken in waiters:
            newer = [row for row in rows if _seq(row[0]) > after]
            if not newer or cursor is None or after < cursor:
                kept.append((after, woken))
            elif not woken.done():
                woken.set_result(newer)
        if kept:
            self._waiting[key] = kept
        else:
            del self._waiting[key]

    def _wake_all(self, error: BaseException) -> None:
        for waiters in self._waiting.values():
            for _, woken in waiters:
                if not woken.done():
                    woken.set_result(error)
        self._waiting.clear()

    async def aclose(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1])


def _answered(found: Any) -> list[tuple[str, Rows]]:
    """(stream key, its entries) per stream in an XREAD answer (RESP2: a list of pairs;
    RESP3: a map of key to a list holding the entries)."""
    if isinstance(found, dict):
        return [(_name(key), value[0] if value else []) for key, value in found.items()]
    return [(_name(key), rows) for key, rows in found or ()]


def _name(key: bytes | str) -> str:
    return key.decode() if isinstance(key, bytes) else key
