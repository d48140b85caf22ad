"""A cancel asked on another replica reaches the reply's producer at once, over a real Redis.

The cancel's key in Redis is read at the producer's heartbeat, once a second; its id is also
published on a channel the producer listens to (``redis_cancels``). Each cancel here is asked
at another point of the heartbeat's second, and each must be heard well within one: by the
key alone, six in a row would all land within 0.3 s of a beat about once in a thousand runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
from redis.asyncio import Redis

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo
from tests.redis_server import RedisServer, redis_server, redis_with_sentinel

HEARD_WITHIN_S = 0.3  # a heartbeat is 1 s apart


def hear(heard: dict[str, float], reply_id: str) -> None:
    """A producer's stop: when each reply's cancel reached it first."""
    heard.setdefault(reply_id, time.monotonic())


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    with redis_server(tmp_path) as running:
        yield running


async def cancel_delays(url: str, prefix: str = "replystream:reply:") -> list[float]:
    """Six replies produced on one store, each cancelled from another: how long each took
    to reach its producer."""
    producer = RedisReplayStore(url, prefix=prefix)
    other = RedisReplayStore(url, prefix=prefix)
    heard: dict[str, float] = {}
    producer.on_cancel(partial(hear, heard))
    ids = [f"cancelled{n}" for n in range(6)]
    for reply_id in ids:
        await producer.create(ReplyInfo(reply_id))
        producer.append(reply_id, [LogEntry(1, "token", "{}")])
    await producer.flush()
    async with asyncio.timeout(5):
        await producer.cancels.listening.wait()
    try:
        return await cancelled_one_by_one(other, ids, heard)
    finally:
        await producer.aclose()
        await other.aclose()


async def cancelled_one_by_one(
    other: RedisReplayStore, ids: list[str], heard: dict[str, float]
) -> list[float]:
    """Each of ``ids`` cancelled from ``other`` in turn, each at another point of the
    heartbeat's second: how long each took to be ``heard`` by its producer."""
    delays = []
    for reply_id in ids:
        asked = time.monotonic()
        await other.request_cancel(reply_id)
        async with asyncio.timeout(5):
            while reply_id not in heard:  # noqa: ASYNC110  (heard by a callback)
                await asyncio.sleep(0.005)
        delays.append(heard[reply_id] - asked)
        await asyncio.sleep(0.17)
    return delays


async def test_a_cancel_asked_on_another_replica_is_heard_within_a_fraction_of_a_beat(
    server: RedisServer,
) -> None:
    delays = await cancel_delays(server.url)
    assert max(delays) < HEARD_WITHIN_S, [round(d, 3) for d in delays]


async def test_a_cancel_is_still_heard_by_its_key_when_the_channel_is_down(
    server: RedisServer,
) -> None:
    producer = RedisReplayStore(server.url)
    other = RedisReplayStore(server.url)
    stopped: list[str] = []
    producer.on_cancel(stopped.append)
    await producer.create(ReplyInfo("unheard"))
    await producer.flush()
    other.cancels.channel = "nowhere"  # published where no replica listens: a message lost
    await other.request_cancel("unheard")
    async with asyncio.timeout(5):
        while not stopped:  # noqa: ASYNC110  (the heartbeat reads the key)
            await asyncio.sleep(0.02)
    assert stopped[0] == "unheard"
    await producer.aclose()
    await other.aclose()


async def test_the_channel_is_heard_again_after_the_primary_fails_over(tmp_path: Path) -> None:
    # The listener's connection dies with the primary; it subscribes again (through Sentinel,
    # to the primary it names now), and cancels are heard at once again.
    with redis_with_sentinel(tmp_path) as redis:
        producer = RedisReplayStore(redis.url)
        other = RedisReplayStore(redis.url)
        heard: dict[str, float] = {}
        producer.on_cancel(partial(hear, heard))
        ids = [f"live{n}" for n in range(3)]
        try:
            for reply_id in ids:
                await producer.create(ReplyInfo(reply_id))
            await producer.flush()
            async with asyncio.timeout(5):
                await producer.cancels.listening.wait()
            redis.primary.kill()
            await asyncio.to_thread(redis.wait_for_failover)
            await asyncio.sleep(3.0)  # the listener finds its connection gone, and comes back
            async with asyncio.timeout(10):
                await producer.cancels.listening.wait()
            delays = await cancelled_one_by_one(other, ids, heard)
            assert max(delays) < HEARD_WITHIN_S, [round(d, 3) for d in delays]
        finally:
            await producer.aclose()
            await other.aclose()


async def test_a_channel_the_acl_refuses_is_told_once_not_every_beat(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A user whose ACL leaves out the channel: Redis refuses the SUBSCRIBE, an answer that
    # comes as the listener reads. It was taken as subscribed as soon as it was sent, so each
    # second's try logged "succeeds again", then the refusal: two lines a second for ever.
    admin = Redis(port=server.port)
    await admin.acl_setuser(
        "narrow",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["other:*"],
        commands=["+@all"],
    )
    await admin.aclose()
    store = RedisReplayStore(f"redis://narrow:pw@127.0.0.1:{server.port}/0")
    stopped: list[str] = []
    store.on_cancel(stopped.append)
    try:
        await store.create(ReplyInfo("quiet"))
        await asyncio.sleep(4.5)  # four tries of the listener
        assert not store.cancels.listening.is_set()
        # The cancel still comes, by its key, at the next beat.
        await store.redis.set(store.keys.key("quiet", ":cancel"), b"1", ex=10)
        async with asyncio.timeout(5):
            while not stopped:  # noqa: ASYNC110  (the heartbeat reads the key)
                await asyncio.sleep(0.02)
    finally:
        await store.aclose()
    told = [r.getMessage() for r in caplog.records if "listening for cancels" in r.getMessage()]
    assert len(told) == 1, told
    assert "no permissions to access one of the channels" in told[0], told
