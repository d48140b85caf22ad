"""The Redis store's batched writes, against a real redis-server: one call carries many
replies, any text survives it byte for byte, a failed write fails its own reply only, and
keys expire (and stay alive while a reply lives) without a command per event.

"Another replica" is a second store on the same Redis, which reads the streams itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, LogTail, ReplyInfo, StoreUnavailable
from tests.redis_server import RedisServer, redis_server


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    with redis_server(tmp_path) as running:
        yield running


async def test_a_burst_of_replies_is_created_and_written_in_a_few_calls(server: RedisServer):
    producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
    ids = [f"burst-{n}" for n in range(200)]
    await asyncio.gather(*(producer.create(ReplyInfo(i, owner="k")) for i in ids))
    created_in = producer.writer.writes
    # Every create waits for one flush; a burst shares them (the first may go alone).
    assert 1 <= created_in <= 3
    for n, reply_id in enumerate(ids):
        producer.append(reply_id, [LogEntry(1, "token", f'{{"n": {n}}}')])
    await producer.flush()
    assert producer.writer.writes == created_in + 1  # every reply's entry, one call
    for n, reply_id in enumerate(ids[::37]):
        result = await reader.read(reply_id, 0, wait_s=0)
        assert result is not None and result.entries == [
            LogEntry(1, "token", f'{{"n": {ids.index(reply_id)}}}')
        ], n
    assert await reader.info(ids[5]) == ReplyInfo(ids[5], owner="k")
    await producer.aclose()
    await reader.aclose()


async def test_any_text_reaches_another_replica_byte_for_byte_and_its_size_in_bytes(
    server: RedisServer,
):
    producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
    await producer.create(ReplyInfo("text", context='[{"content": "né 😀 \\" \\\\ \\n"}]'))
    entries = [
        LogEntry(1, None, '{"text": "é😀\\u0000 \\"quoted\\" \\\\"}'),
        LogEntry(2, "token", 'raw é 😀 \t tab, \\ and " inside'),
        LogEntry(3, "", "[DONE]"),  # an empty type reads back as a plain message
        LogEntry(4, "token", ""),
    ]
    producer.append("text", entries)
    producer.end("text", '{"finish_reason": "stop", "note": "fin ✓"}')
    await producer.flush()
    cursor = reader.cursor("text", 0)
    result = await cursor.read(wait_s=0)
    assert result is not None
    assert result.entries == [entries[0], entries[1], LogEntry(3, None, "[DONE]"), entries[3]]
    assert result.ending == '{"finish_reason": "stop", "note": "fin ✓"}'
    # Offsets count what the local store counts (the data's UTF-8 bytes), so lag agrees.
    assert cursor.lag_bytes() == sum(len(e.data.encode()) for e in entries)
    info = await reader.info("text")
    assert info is not None and info.context == '[{"content": "né 😀 \\" \\\\ \\n"}]'
    await producer.aclose()
    await reader.aclose()


async def test_a_write_redis_refuses_fails_that_reply_alone(server: RedisServer):
    producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
    await producer.create(ReplyInfo("bad"))
    await producer.create(ReplyInfo("good"))
    # Something else wrote the bad reply's stream further on: entry 1 can no longer go in.
    await reader.redis.xadd(producer.keys.key("bad"), {"d": "x"}, id="0-100")
    producer.append("bad", [LogEntry(1, "token", "a")])
    producer.append("good", [LogEntry(1, "token", "b")])
    producer.end("good", "finished")
    await producer.flush()
    failure = producer.failure("bad")
    assert failure is not None and "Redis write failed" in failure
    assert producer.failure("good") is None
    good = await reader.read("good", 0, wait_s=0)
    assert good is not None and [e.data for e in good.entries] == ["b"]
    assert good.ending == "finished"
    # The failed reply writes nothing more (its producer stops on ``failure``).
    producer.append("bad", [LogEntry(2, "token", "c")])
    await producer.flush()
    assert await reader.redis.xlen(producer.keys.key("bad")) == 1
    await producer.aclose()
    await reader.aclose()


async def test_a_flush_that_fails_as_no_redis_error_refuses_its_creates_and_flushing_goes_on(
    server: RedisServer, caplog: pytest.LogCaptureFixture
):
    # A bug (here: the client library raising TypeError, as redis-py does for a connection
    # option it does not know) once killed the flusher task: every create waited forever.
    producer = RedisReplayStore(server.url)
    write = producer.writer._write

    async def broken(**_: object) -> object:
        raise TypeError("an unexpected keyword argument")

    producer.writer._write = broken  # type: ignore[assignment]
    results = await asyncio.wait_for(
        asyncio.gather(
            *(producer.create(ReplyInfo(f"r{n}")) for n in range(3)), return_exceptions=True
        ),
        timeout=10,
    )
    assert all(isinstance(r, StoreUnavailable) and "TypeError" in str(r) for r in results)
    assert "writing reply logs to Redis failed" in caplog.text
    producer.writer._write = write
    await asyncio.wait_for(producer.create(ReplyInfo("after")), timeout=10)
    assert await producer.info("after") == ReplyInfo("after")
    await producer.aclose()


async def test_keys_expire_from_the_first_write_and_after_the_end_and_live_replies_keep_them(
    server: RedisServer,
):
    producer = RedisReplayStore(server.url, ttl_after_end_s=3.0, liveness_s=1.0)
    redis = producer.redis
    await producer.create(ReplyInfo("long"))
    await producer.create(ReplyInfo("short"))
    producer.append("short", [LogEntry(1, "token", "x")])
    await producer.flush()
    assert 0 < await redis.ttl(producer.keys.key("short")) <= 3
    producer.end("short", "finished")
    await producer.flush()
    for part in ("", ":meta"):
        assert 0 < await redis.ttl(producer.keys.key("short", part)) <= 3
    assert not await redis.exists(producer.keys.key("short", ":live"))
    # A reply that outlives the TTL keeps its keys while it is written to (refreshed every
    # second here: a third of the TTL).
    for seq in range(1, 21):
        producer.append("long", [LogEntry(seq, "token", "y")])
        await producer.flush()
        await asyncio.sleep(0.25)
    assert await redis.xlen(producer.keys.key("long")) == 20
    assert await redis.exists(producer.keys.key("long", ":meta"))
    assert not await redis.exists(producer.keys.key("short"))  # 5 s after its end
    await producer.aclose()


async def test_an_ended_reply_is_kept_in_redis_no_shorter_than_a_fractional_ttl(
    server: RedisServer,
):
    """EXPIRE takes whole seconds: a TTL of 2.5 s is rounded up, never cut to 2 (another
    replica would lose the reply half a second before the producer's own copy)."""
    producer = RedisReplayStore(server.url, ttl_after_end_s=2.5, liveness_s=1.0)
    redis = producer.redis
    await producer.create(ReplyInfo("part"))
    producer.append("part", [LogEntry(1, "token", "x")])
    producer.end("part", "finished")
    await producer.flush()
    for part in ("", ":meta"):
        assert await redis.pttl(producer.keys.key("part", part)) > 2500
    await asyncio.sleep(2.2)
    reader = RedisReplayStore(server.url, ttl_after_end_s=2.5, liveness_s=1.0)
    assert await reader.info("part") is not None
    await reader.aclose()
    await producer.aclose()


async def test_with_one_slot_per_call_a_flush_sends_a_call_per_hash_slot(server: RedisServer):
    """What a Redis Cluster needs (a script touches one slot's keys): the same writes, split."""
    producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
    producer.keys.one_slot_per_call = True
    stopped: list[str] = []
    producer.on_cancel(stopped.append)
    ids = [f"slot-{n}" for n in range(12)]
    await asyncio.gather(*(producer.create(ReplyInfo(i)) for i in ids))
    slots = {key_slot(producer.keys.key(i).encode()) for i in ids}
    before = producer.writer.writes
    for reply_id in ids:
        producer.append(reply_id, [LogEntry(1, "token", reply_id)])
    producer.end(ids[0], "finished")
    await producer.flush()
    assert producer.writer.writes - before == len(slots) > 1
    for reply_id in ids:
        result = await reader.read(reply_id, 0, wait_s=0)
        assert result is not None and [e.data for e in result.entries] == [reply_id]
    assert (await reader.read(ids[0], 1, wait_s=0)).ending == "finished"  # type: ignore[union-attr]
    await reader.request_cancel(ids[3])
    async with asyncio.timeout(5):
        while not stopped:  # noqa: ASYNC110  (the heartbeat, once a second, passes it on)
            await asyncio.sleep(0.05)
    assert stopped == [ids[3]]
    await producer.aclose()
    await reader.aclose()


async def test_hundreds_of_readers_on_another_replica_follow_through_one_shared_read(
    server: RedisServer,
):
    """More followers than the client's 100 pooled connections: once a reader has read what
    a stream holds, it waits on the one blocking XREAD the replica shares, not on a
    connection of its own, and gets exactly its reply's entries and ending."""
    producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
    try:
        ids = [f"follow-{n}" for n in range(300)]
        await asyncio.gather(*(producer.create(ReplyInfo(i)) for i in ids))
        tokens = 15
        cursors = {reply_id: reader.cursor(reply_id, 0) for reply_id in ids}
        for cursor in cursors.values():  # the first reads, one at a time: nothing yet
            first = await cursor.read(wait_s=0)
            assert first is not None and first.entries == []

        async def follow(reply_id: str) -> list[str]:
            cursor = cursors[reply_id]
            seen: list[str] = []
            while True:
                result = await cursor.read(wait_s=10.0)
                assert result is not None and not result.producer_lost and result.lost is None
                seen += [e.data for e in result.entries]
                if result.entries:
                    cursor.sent(result.entries[-1].seq, 0)
                if result.ending is not None:
                    assert result.ending == "finished"
                    return seen

        async def produce() -> None:
            await asyncio.sleep(0.3)  # every follower waiting
            for seq in range(1, tokens + 1):
                for reply_id in ids:
                    producer.append(reply_id, [LogEntry(seq, "token", f"{reply_id}/{seq}")])
                await asyncio.sleep(0.03)
            for reply_id in ids:
                producer.end(reply_id, "finished")

        async with asyncio.timeout(60), asyncio.TaskGroup() as group:
            followers = [group.create_task(follow(reply_id)) for reply_id in ids]
            group.create_task(produce())
        for reply_id, task in zip(ids, followers, strict=True):
            assert task.result() == [f"{reply_id}/{seq}" for seq in range(1, tokens + 1)]
        # Far fewer shared reads than entries handed over (300 readers x 15 entries).
        assert 0 < reader.reads.watch.calls < len(ids) * tokens / 5
    finally:
        await producer.aclose()
        await reader.aclose()


@pytest.mark.parametrize("ttl_s", [2.0, 1.0, 0.5])
async def test_a_live_reply_that_pauses_longer_than_the_ttl_keeps_its_keys(
    server: RedisServer, ttl_s: float
):
    # A producer that makes no event for longer than the reply TTL (a model thinking, an
    # upstream slow to answer) still generates: its keys must not expire under it, or a
    # resume on another replica finds no reply and the producer takes the expiry for an
    # eviction and writes the reply again. A TTL no longer than the heartbeat's second
    # too: keys refreshed for the TTL alone would lapse between two beats.
    producer = RedisReplayStore(server.url, ttl_after_end_s=ttl_s, liveness_s=1.0)
    reader = RedisReplayStore(server.url, ttl_after_end_s=ttl_s, liveness_s=1.0)
    await producer.create(ReplyInfo("paused"))
    producer.append("paused", [LogEntry(1, "token", "a")])
    await producer.flush()
    seen = []
    for _ in range(8):  # 4 s: two TTLs or more without an event
        await asyncio.sleep(0.5)
        seen.append(await reader.tail("paused"))
        assert await producer.redis.ttl(producer.keys.key("paused", ":meta")) > 0
    assert set(seen) == {LogTail(1, False)}, seen
    assert producer.stats().evictions == 0 and producer.stats().repairs == 0
    await producer.aclose()
    await reader.aclose()


@pytest.mark.parametrize("asked", ["cancel", "delete"])
async def test_a_cancel_or_delete_asked_on_another_replica_outlives_the_gap_between_two_beats(
    server: RedisServer, asked: str
):
    # Whatever the reply TTL, the producer reads a cancel's or a delete's mark at its next
    # heartbeat, which may come a second or more later on a loaded machine: the mark must
    # still be there. A delete's, gone, would leave no metadata: the producer would take it
    # for an eviction and write the deleted reply again.
    producer = RedisReplayStore(server.url, ttl_after_end_s=0.5, liveness_s=1.0)
    reader = RedisReplayStore(server.url, ttl_after_end_s=0.5, liveness_s=1.0)
    stopped: list[str] = []
    producer.on_cancel(stopped.append)
    await producer.create(ReplyInfo("asked"))
    producer.append("asked", [LogEntry(1, "token", "a")])
    await producer.flush()
    if asked == "cancel":
        await reader.request_cancel("asked")
    else:
        await reader.delete("asked")
    mark = reader.keys.key("asked", ":cancel" if asked == "cancel" else ":meta")
    assert await reader.redis.pttl(mark) > 2_000
    async with asyncio.timeout(10):
        while not stopped:  # noqa: ASYNC110  (a remote request is seen by a heartbeat)
            await asyncio.sleep(0.05)
    assert stopped == ["asked"]
    if asked == "delete":
        await asyncio.sleep(1.5)  # more beats: none writes it again
        assert await reader.info("asked") is None
        assert producer.stats().repairs == 0
    await producer.aclose()
    await reader.aclose()


async def test_a_stream_made_anew_by_a_late_write_expires_even_if_its_producer_dies(
    server: RedisServer,
):
    # The reply is deleted on another replica (or its stream evicted) and its producer's
    # next write lands before the producer hears of it: that write makes the stream again.
    # If the producer's replica then dies, nothing else would ever delete it: it must expire.
    producer, other = RedisReplayStore(server.url), RedisReplayStore(server.url)
    await producer.create(ReplyInfo("deleted"))
    producer.append("deleted", [LogEntry(1, "token", "x")])
    await producer.flush()
    for task in producer._tasks:  # its replica dies after the next write: no heartbeat
        task.cancel()
    await other.delete("deleted")
    producer.append("deleted", [LogEntry(2, "token", "y")])
    await producer.flush()
    redis = other.redis
    for key in await redis.keys(f"{producer.keys.prefix}*"):
        assert await redis.ttl(key) > 0, key
    await producer.aclose()
    await other.aclose()
