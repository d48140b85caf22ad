"""A Redis that answers reads but takes no writes: a live producer is not called lost.

Redis refuses writes while it answers reads when it is full under ``noeviction`` (``OOM
command not allowed``), and holds them back under ``CLIENT PAUSE WRITE`` (which Redis's own
``FAILOVER`` and a Cluster's manual failover use). The producer's heartbeat is a write, so
its reply's liveness key lapses, and a reader on another replica, which still reads, found
the key gone and the heartbeat count still, and told its client ``generator_lost`` within
about 6 s: the replica making the reply was alive, and, Redis taking writes again within
``--redis-failover-s``, went on to finish it. The reader's replica finds its own writes (its
reader marks) failing too: it waits instead, as readers wait through an outage, and past
the failover window says what Redis said (``replay_store_unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo, StoreUnavailable
from tests.redis_server import redis_server
from tests.test_redis_eviction import fill_until_full


@contextlib.asynccontextmanager
async def producing(store: RedisReplayStore, reply_id: str) -> AsyncIterator[list[int]]:
    """A live reply that gains an event every 50 ms (the numbers appended so far)."""
    await store.create(ReplyInfo(reply_id))
    made: list[int] = []

    async def generate() -> None:
        while True:
            made.append(len(made) + 1)
            store.append(reply_id, [LogEntry(made[-1], "token", f"{made[-1]}")])
            await asyncio.sleep(0.05)

    task = asyncio.create_task(generate())
    try:
        yield made
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_live_producer_is_not_called_lost_while_redis_holds_writes_back(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        admin = aioredis.Redis.from_url(server.url)
        try:
            async with producing(producer, "paused") as made:
                cursor = reader.cursor("paused", 0)
                await asyncio.sleep(0.5)
                await admin.client_pause(7000, all=False)  # writes only
                resumed_at = time.monotonic() + 7.0
                got: list[int] = []
                # Read on through the pause, and until events made during it have come.
                while time.monotonic() < resumed_at + 3.0 or not got or got[-1] < made[0] + 150:
                    result = await cursor.read(wait_s=1.0)
                    assert result is not None
                    assert not result.producer_lost, f"called lost after event {got[-1:]}"
                    got += [int(entry.seq) for entry in result.entries]
                    if result.entries:
                        cursor.sent(result.entries[-1].seq, 0)
                    assert time.monotonic() < resumed_at + 15.0, "the reader never read on"
                assert got == list(range(1, got[-1] + 1))
                cursor.close()
        finally:
            await admin.aclose()
            await producer.aclose()
            await reader.aclose()


async def test_a_reader_told_of_a_full_redis_past_the_failover_window_not_a_lost_producer(
    tmp_path: Path,
):
    with redis_server(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as srv:
        producer = RedisReplayStore(srv.url, failover_s=3.0)
        reader = RedisReplayStore(srv.url, failover_s=3.0)
        try:
            async with producing(producer, "full"):
                cursor = reader.cursor("full", 0)
                await asyncio.sleep(0.5)
                await fill_until_full(srv.url)
                full_at = time.monotonic()
                with pytest.raises(StoreUnavailable) as told:
                    while True:
                        result = await cursor.read(wait_s=1.0)
                        assert result is not None and not result.producer_lost
                        if result.entries:
                            cursor.sent(result.entries[-1].seq, 0)
                        assert time.monotonic() < full_at + 20.0, "never told"
                assert "maxmemory" in told.value.describe(), told.value.describe()
                cursor.close()
        finally:
            await producer.aclose()
            await reader.aclose()


async def test_each_outage_of_the_liveness_refresh_is_told_as_it_begins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # The refresh's outage is told once as it begins and once as it ends; one whose last
    # live reply ended while Redis held writes back never ended: nothing was refreshed any
    # more to succeed. The next outage was then not told at all as it began, and its end
    # was told as one long failure since the first.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        admin = aioredis.Redis.from_url(server.url)
        try:
            for reply_id in ("first", "second"):
                await producer.create(ReplyInfo(reply_id))
                producer.append(reply_id, [LogEntry(1, "token", "{}")])
                await producer.flush()
                await admin.client_pause(2500, all=False)  # writes only
                await asyncio.sleep(1.8)  # a beat or so fails
                producer.end(reply_id, "finished")
                await producer.flush()  # taken as the pause ends
                await asyncio.sleep(2.0)  # beats with nothing live
        finally:
            await admin.aclose()
            await producer.aclose()
    told = [r.getMessage() for r in caplog.records if "liveness refresh" in r.getMessage()]
    began = [line for line in told if "liveness refresh failed" in line]
    assert len(began) == 2, told
    assert len(told) == 4, told
