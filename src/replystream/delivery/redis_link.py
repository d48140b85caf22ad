"""The reply log's link to Redis: its client, and how a failed command is retried.

One client (one Redis, Sentinel or a Cluster: ``redis_connect``) serves every part of the
store. A command that fails is retried for ``failover_s`` (a Sentinel failover takes its
down-after-milliseconds and an election; the promoted replica is reached through the same
client), then reported as ``StoreUnavailable``. While Redis fails and for a few heartbeats
after it answers again (``recovering``), what producers write cannot be trusted to be there:
a promoted replica may hold stale liveness keys, and a reply Redis lost altogether (a
restart without its data) is there again only once its producer writes it again. The
timings every part shares (a command's timeout, the heartbeat's period) live here too, and
whether the Redis answering is still the one that answered before
(``servers_changed``: a restart quick enough that no command failed). This file must not know
what the keys hold.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from replystream.delivery.redis_connect import (
    connect,
    error_text,
    follow_primary,
    parse_redis_url,
)
from replystream.delivery.replay import StoreUnavailable

T = TypeVar("T")

# Every command's answer must come within this: a Redis that stops answering (hung, or a
# network that drops packets) is then reported like one that is down, and no reader or
# flush waits on it for ever. A blocking read blocks for at most half of it.
COMMAND_TIMEOUT_S = 5.0
RETRY_FIRST_S = 0.05  # the first retry's pause; each next one doubles, up to RETRY_MAX_S
RETRY_MAX_S = 0.5
# A producer refreshes its replies' liveness (and bumps their heartbeat counts) this often.
HEARTBEAT_S = 1.0
# A reader that finds a producer's liveness key gone waits this long for its heartbeat count
# to move before calling it lost: the key may have been evicted (``volatile-ttl`` evicts the
# keys nearest their expiry first) while the producer lives.
BEAT_CONFIRM_S = 2 * HEARTBEAT_S + 0.5


def ttl_whole_s(ttl_after_end_s: float) -> int:
    """A reply's TTL as Redis's EXPIRE takes it, in whole seconds: rounded up, so that an
    ended reply is readable on every replica at least as long as ``--reply-ttl-s`` says (2.9
    cut to 2 would lose it on another replica while the producer's own copy still serves
    it), and at least 1 (0 would delete it at once)."""
    return max(1, math.ceil(ttl_after_end_s))


def live_hold_s(ttl_after_end_s: float, liveness_s: float) -> int:
    """How long each refresh keeps a live reply's keys, and a cancel asked for it: the reply
    TTL, but never less than the time a producer's heartbeats may be apart before it is called
    lost. With a TTL no longer than a beat, keys refreshed for the TTL alone would lapse
    between two beats (and a cancel mark expire before the producer reads it)."""
    return max(ttl_whole_s(ttl_after_end_s), math.ceil(liveness_s + 2 * HEARTBEAT_S))


class RedisLink:
    """The client of the Redis a URL names, with the store's retry policy."""

    def __init__(
        self, url: str, *, connect_timeout_s: float, failover_s: float, liveness_s: float
    ) -> None:
        self.target = parse_redis_url(url)
        self.where = f"Redis at {self.target.shown}"  # errors reach clients: no credentials
        self.redis = connect(
            self.target, connect_timeout_s=connect_timeout_s, command_timeout_s=COMMAND_TIMEOUT_S
        )
        self.failover_s = failover_s
        self.liveness_s = liveness_s
        # When a command last failed, or first succeeded after failing: until producers have
        # written again, Redis may lack their liveness keys, or every key of their replies.
        self._troubled_at = -float("inf")
        # The run ids of the Redis servers answering (a Cluster's primaries), when last asked,
        # and what must follow a change, whichever caller finds it (the writer's repair).
        self._servers: frozenset[str] | None = None
        self.on_replaced: Callable[[], None] | None = None
        # Since when this process's heartbeat writes fail while it sends them, when one last
        # failed, and why (None: the last one was taken).
        self._writes_failing: tuple[float, float, BaseException] | None = None

    def unavailable(self, why: object) -> StoreUnavailable:
        """What a caller is told when Redis cannot be reached."""
        return StoreUnavailable(f"{self.where}: {error_text(why)}")

    async def retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, retried for ``failover_s`` while Redis cannot be reached (a
        failover: the client finds the promoted replica); then ``StoreUnavailable``."""
        deadline: float | None = None
        pause = RETRY_FIRST_S
        while True:
            try:
                result = await attempt()
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                self.failed()
                if deadline is None:
                    deadline = now + self.failover_s
                if now >= deadline:
                    raise self.unavailable(exc) from exc
                await asyncio.sleep(min(pause, deadline - now))
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            if deadline is not None:
                self.recovered()
            return result

    def failed(self) -> None:
        """A command failed: Redis may come back without what it held."""
        self._troubled_at = time.monotonic()

    def recovered(self) -> None:
        """Redis answered again after failing."""
        self._troubled_at = time.monotonic()

    def write_failed(self, why: BaseException) -> None:
        """A heartbeat's write (a liveness refresh, a reader's mark) failed."""
        now = time.monotonic()
        since = now if self._writes_failing is None else self._writes_failing[0]
        self._writes_failing = (since, now, why)

    def write_taken(self) -> None:
        """A heartbeat's write was taken."""
        self._writes_failing = None

    def refusing_writes(self) -> bool:
        """Whether Redis refuses or holds back this process's writes now while it answers
        reads (full under ``noeviction``, ``CLIENT PAUSE WRITE`` in a failover): every
        producer's heartbeat then fails as its own do, so a reply's liveness key gone and its
        heartbeat count still do not tell its producer died.
        Writes fail only while some are sent (a beat's, every second while it has a reply or
        a reader's mark to write): one that failed longer ago than two beats tells nothing.

        Raises:
            StoreUnavailable: they have failed for ``failover_s``, as a read that fails that
                long does.
        """
        if self._writes_failing is None:
            return False
        since, last, why = self._writes_failing
        now = time.monotonic()
        if now - last > 2 * HEARTBEAT_S + 1:
            return False
        if now - since >= self.failover_s:
            raise self.unavailable(why)
        return True

    async def servers_changed(self) -> bool:
        """Whether the Redis answering is another than when last asked (never, the first
        time): its ``run_id`` changes when it restarts, or another takes its place (a
        failover; for a Cluster, any of its primaries). A restart may be quick enough that no
        command here failed meanwhile, and without its data (no persistence) it lost every
        reply: a change counts as a failure (``recovering``), as one seen would, and
        ``on_replaced`` is called, so the replies held here are written again however the
        change was found (a heartbeat, or a reader that could not find a reply). Through
        Sentinel, it first asks which server is the primary (``follow_primary``).

        Raises:
            RedisError, OSError: Redis (or the Sentinels) could not be asked.
        """
        # Through Sentinel, the primary it names now (connections to another are closed).
        await follow_primary(self.redis)
        if isinstance(self.redis, RedisCluster):
            answer = await self.redis.info("server", target_nodes=RedisCluster.PRIMARIES)
        else:
            answer = await self.redis.info("server")
        servers = frozenset(_run_ids(answer))
        before, self._servers = self._servers, servers
        if before is None or servers == before:
            return False
        self.failed()
        if self.on_replaced is not None:
            self.on_replaced()
        return True

    def recovering(self) -> bool:
        """Whether Redis failed or came back too recently for what producers write to be
        trusted to be there: liveness keys are refreshed every second (a promoted replica may
        hold stale ones), and a reply Redis lost is written again once its producer reaches
        it."""
        return time.monotonic() - self._troubled_at < self.liveness_s + 2 * HEARTBEAT_S


def _run_ids(info: object) -> list[str]:
    """Every ``run_id`` in an ``INFO server`` answer (one server's, or one per node)."""
    if not isinstance(info, dict):
        return []
    if "run_id" in info:
        return [str(info["run_id"])]
    return [run_id for value in info.values() for run_id in _run_ids(value)]
