"""A ``maxmemory`` Redis evicts reply logs: what was evicted is told, never replayed wrong.

Redis under ``maxmemory`` with an eviction policy drops whole keys, any of a reply's four
(its stream, metadata, liveness and cancel keys), in any order. The first tests evict one
key at a time (``DEL``, as eviction does) and pin what a reader is told for each; the last
ones run a real redis-server with a small ``maxmemory`` under each eviction policy
deployments use, fill it past its limit, and account for every reply: exact, or told (a gap
for a missing range, or gone: 404, or 410 when its log outlived its metadata), and never
``generator_lost`` for a reply that ended. ``noeviction`` makes writes fail instead: the
store treats it as an outage (new replies refused, live ones stopped past the failover
window). The HTTP side of it is in ``tests/test_redis_eviction_http.py``.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from replystream.delivery.redis_repair import LocalCopy, StreamState, plan
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import DELETED, LogEntry, LogTail, ReplyInfo, StoreUnavailable
from tests.conftest import wait_for
from tests.redis_server import redis_server


def events(reply: str, start: int, stop: int, size: int = 100) -> list[LogEntry]:
    """Events whose data names their reply and number, so a misplaced one shows."""
    return [LogEntry(n, "token", f"{reply}:{n}:".ljust(size, "x")) for n in range(start, stop)]


async def ended(producer: RedisReplayStore, reply: str, count: int = 12) -> None:
    await producer.create(ReplyInfo(reply, owner="k"))
    producer.append(reply, events(reply, 1, count + 1))
    producer.end(reply, "finished")
    await producer.flush()


def key(store: RedisReplayStore, reply: str, part: str = "") -> str:
    return store.keys.key(reply, part)


async def test_a_stream_evicted_after_its_end_is_told_as_a_gap_then_the_end(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await ended(producer, "s")
        await producer.redis.delete(key(producer, "s"))
        # Not a producer lost: the reply ended, and its metadata says where.
        assert await reader.tail("s") == LogTail(12, True)
        whole = await reader.read("s", 0, wait_s=1)
        assert whole is not None
        assert (whole.entries, whole.lost, whole.ending) == ([], (1, 12), "finished")
        assert not whole.producer_lost
        midway = await reader.read("s", 7, wait_s=1)
        assert midway is not None and (midway.lost, midway.ending) == ((8, 12), "finished")
        at_end = await reader.read("s", 12, wait_s=1)
        assert at_end is not None and (at_end.lost, at_end.ending) == (None, "finished")
        assert reader.stats().evictions == 3
        assert reader.stats().gaps == 0  # the server's own reads: nobody was told
        cursor = reader.cursor("s", 7)  # a reader's read: it is told of the gap
        told = await cursor.read(1)
        cursor.close()
        assert told is not None and told.lost == (8, 12) and reader.stats().gaps == 1
        await producer.aclose()
        await reader.aclose()


async def test_a_read_past_the_end_of_a_whole_stream_counts_no_eviction(tmp_path: Path):
    # A reader on another replica may follow a live reply from past its last event (its
    # producer's log may be ahead of Redis); the reply ends before that place. Its stream is
    # all there: what the reader is told is the ending, and nothing was evicted.
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await ended(producer, "p")
        past = await reader.read("p", 1000, wait_s=0)
        assert past is not None
        assert (past.entries, past.lost, past.ending, past.last_seq) == ([], None, "finished", 12)
        assert reader.stats().evictions == 0 and reader.stats().gaps == 0
        await producer.aclose()
        await reader.aclose()


async def test_metadata_evicted_behind_its_log_is_reported_evicted_not_unknown(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await ended(producer, "m")
        await producer.redis.delete(key(producer, "m", ":meta"))
        assert await reader.info("m") is None  # whose it was went with it: nobody may read
        gone = await reader.gone("m")
        assert gone is not None and gone.reason == "evicted" and "evicted" in gone.detail
        # A reader already following it (its owner was checked) reads on to the end.
        rest = await reader.read("m", 4, wait_s=0)
        assert rest is not None and rest.entries == events("m", 5, 13)
        assert rest.ending == "finished"
        # Every key gone: nothing tells it from a reply that never was (a 404).
        await producer.redis.delete(key(producer, "m"))
        assert await reader.gone("m") is None and await reader.read("m", 0, 0) is None
        await producer.aclose()
        await reader.aclose()


async def test_a_liveness_key_evicted_under_a_live_producer_is_not_taken_for_its_death(
    tmp_path: Path,
):
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await producer.create(ReplyInfo("l"))
        producer.append("l", events("l", 1, 4))
        await producer.flush()
        await producer.redis.delete(key(producer, "l", ":live"))
        result = await reader.read("l", 3, wait_s=0.2)
        # The heartbeat count moved while the reader watched: the producer lives.
        assert result is not None and not result.producer_lost and result.ending is None
        assert await producer.redis.exists(key(producer, "l", ":live"))  # set again
        producer.end("l", "finished")
        await producer.flush()
        assert (await reader.read("l", 3, wait_s=1)).ending == "finished"  # type: ignore[union-attr]
        await producer.aclose()
        await reader.aclose()


async def test_a_dead_producer_whose_stream_was_evicted_is_still_reported_lost(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, liveness_s=1.0)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("d"))
        producer.append("d", events("d", 1, 4))
        await producer.flush()
        for task in producer._tasks:  # the replica dies: no heartbeat, no ending
            task.cancel()
        await producer.redis.delete(key(producer, "d"))
        await asyncio.sleep(1.5)
        # Told within a few reads (on a busy machine its last beat's key may outlive the
        # sleep a little), and never as an ending.
        async with asyncio.timeout(10):
            while True:
                result = await reader.read("d", 3, wait_s=0.2)
                assert result is not None and result.ending is None
                if result.producer_lost:
                    break
        await reader.aclose()
        await producer.redis.aclose()


async def test_a_live_producer_writes_its_evicted_metadata_and_log_again(tmp_path: Path):
    # All of its metadata: whose it is, what its route keeps, its dialect and the keep-alive
    # its request asked (each a reader elsewhere needs).
    info = ReplyInfo("p", owner="k", context="ctx", dialect="anthropic", keepalive_s=2.5)
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await producer.create(info)
        producer.append("p", events("p", 1, 6))
        await producer.flush()
        await producer.redis.delete(key(producer, "p", ":meta"), key(producer, "p"))
        # A reader asking meanwhile waits for it (the producer lives), then finds it whole.
        async with asyncio.timeout(10):
            assert await reader.info("p") == info
            while (await reader.read("p", 0, wait_s=0)).entries != events("p", 1, 6):  # type: ignore[union-attr]  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        # Counted once the repair's write has answered, after readers may see it.
        await wait_for(lambda: producer.stats().repairs == 1)
        assert producer.stats().evictions == 1
        await producer.aclose()
        await reader.aclose()


async def test_a_reader_following_a_reply_evicted_whole_waits_for_its_live_producer(
    tmp_path: Path,
):
    """Every key of a live reply evicted at once, its liveness key among them: nothing in
    Redis says a producer writes it, but one does, at its next beat. A reader that was
    following it is not told it expired (it was cut so, with its producer alive); it waits
    for the reply to be written again and reads on. A delete is still told at once."""
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await producer.create(ReplyInfo("w", owner="k"))
        producer.append("w", events("w", 1, 4))
        await producer.flush()
        cursor = reader.cursor("w", 0)
        first = await cursor.read(0)
        assert first is not None and first.entries == events("w", 1, 4)
        cursor.sent(3, 300)
        await producer.redis.delete(*(key(producer, "w", part) for part in ("", ":meta", ":live")))
        # A short wait: the reader looks before the producer's next beat has written it again.
        during = await cursor.read(0.05)
        assert during is not None and during.ending is None, during
        producer.append("w", events("w", 4, 6))
        producer.end("w", "finished")
        await producer.flush()
        async with asyncio.timeout(10):
            rest = await cursor.read(1)
            assert rest is not None and rest.entries == events("w", 4, 6) and not rest.lost
        cursor.close()

        await producer.create(ReplyInfo("x", owner="k"))
        producer.append("x", events("x", 1, 4))
        await producer.flush()
        cursor = reader.cursor("x", 0)
        assert (await cursor.read(0)) is not None
        cursor.sent(3, 300)
        await producer.delete("x")
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert await cursor.read(0.05) is None
        assert (await cursor.gone()) == DELETED
        assert loop.time() - began < 1.0  # not the wait for a producer to write it again
        cursor.close()
        await producer.aclose()
        await reader.aclose()


async def whole_again(reader: RedisReplayStore, reply: str, upto: int) -> float:
    """Read ``reply`` from its start until Redis holds events 1..``upto`` again; meanwhile
    every read is a contiguous prefix, or told what it lacks (never a silent hole). Returns
    how long it took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with asyncio.timeout(10):
        while True:
            result = await reader.read(reply, 0, wait_s=0)
            assert result is not None and not result.producer_lost
            first = result.lost[1] + 1 if result.lost is not None else 1
            assert result.entries == events(reply, first, first + len(result.entries))
            if result.lost is None and result.entries == events(reply, 1, upto + 1):
                return loop.time() - began
            await asyncio.sleep(0.05)


async def test_a_live_producer_writes_its_evicted_stream_again_from_its_copy(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        await producer.create(ReplyInfo("v", owner="k"))
        producer.append("v", events("v", 1, 6))
        await producer.flush()
        # Evicted between appends: the producer's heartbeat finds it shorter than written.
        await producer.redis.delete(key(producer, "v"))
        took = await whole_again(reader, "v", 5)
        # Counted once the repair's write has answered, after readers may see it.
        await wait_for(lambda: producer.stats().repairs == 1)
        assert producer.stats().evictions == 1
        # Evicted, then made anew by the next append (it starts late: a reader is told of
        # the gap), and written whole again from the producer's copy.
        await producer.redis.delete(key(producer, "v"))
        producer.append("v", events("v", 6, 8))
        await producer.flush()
        took = max(took, await whole_again(reader, "v", 7))
        await wait_for(lambda: producer.stats().repairs == 2)
        assert producer.stats().evictions == 2
        assert producer.stats().holes == 0  # it held every event: nothing stays lost
        producer.end("v", "finished")
        await producer.flush()
        ended = await reader.read("v", 0, wait_s=0)
        assert ended is not None and ended.entries == events("v", 1, 8)
        assert (ended.lost, ended.ending) == (None, "finished")
        print(f"an evicted stream was whole again within {took:.2f} s")
        await producer.aclose()
        await reader.aclose()


def test_a_stream_that_starts_late_but_was_never_trimmed_is_rewritten():
    copy = LocalCopy(events("x", 1, 11), 0, None, 11)
    # Made anew by an append after it was evicted: events 1-6 are gone from its start.
    late = plan(copy, StreamState(first=7, last=10, length=4, known=True))
    assert (late.action, late.entries, late.missing) == ("rewrite", copy.entries, 0)
    # Redis trims only to where the producer's copy starts: a stream that starts after that,
    # however long, lost its start.
    trimmed = plan(copy, StreamState(first=3, last=10, length=8, known=True))
    assert (trimmed.action, trimmed.missing) == ("rewrite", 0)
    # A copy trimmed further than Redis: the stream starting before the copy is whole.
    shorter = LocalCopy(events("x", 5, 11), 400, None, 11)
    assert plan(shorter, StreamState(first=3, last=10, length=8, known=True)).action == "nothing"


async def test_noeviction_makes_writes_fail_and_the_store_treats_it_as_an_outage(
    tmp_path: Path,
):
    with redis_server(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as srv:
        producer = RedisReplayStore(srv.url, failover_s=0.5)
        await producer.create(ReplyInfo("n"))
        producer.append("n", events("n", 1, 3))
        await producer.flush()
        await fill_until_full(srv.url)
        with pytest.raises(StoreUnavailable, match="maxmemory"):
            await producer.create(ReplyInfo("refused"))
        # A live reply's writes fail for the failover window, then its producer is stopped
        # (an in-band error for its readers) rather than writing into a hole.
        producer.append("n", events("n", 3, 4))
        async with asyncio.timeout(10):
            while producer.failure("n") is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert "maxmemory" in (producer.failure("n") or "")
        await producer.aclose()


async def test_a_full_redis_is_told_without_the_command_it_refused(tmp_path: Path):
    """redis-py's error of a pipelined command begins with the command, here the source of
    our write script ("Command # 1 (EVAL local r = cjson.decode(ARGV[1]) ...) of pipeline
    caused error: ..."), which went on to clients in the 503 and the in-band error."""
    with redis_server(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as srv:
        producer = RedisReplayStore(srv.url, failover_s=0.5)
        await producer.create(ReplyInfo("n"))
        await producer.flush()
        await fill_until_full(srv.url)
        with pytest.raises(StoreUnavailable) as refused:
            await producer.create(ReplyInfo("refused"))
        producer.append("n", events("n", 1, 4))
        async with asyncio.timeout(10):
            while producer.failure("n") is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        for said in (str(refused.value), producer.failure("n") or ""):
            assert "command not allowed when used memory > 'maxmemory'" in said, said
            assert "pipeline" not in said and "EVAL" not in said and "INCR" not in said, said
            # Nor which of our scripts, at which line, ran the command refused.
            assert "user_script" not in said and "script:" not in said, said
        # A Redis that answers and refuses is not one that "cannot be reached".
        assert refused.value.describe().startswith("the reply store is unavailable: ")
        await producer.aclose()


async def fill_until_full(url: str) -> None:
    """Write junk until a noeviction Redis refuses writes."""
    client = aioredis.Redis.from_url(url)
    try:
        for n in range(10_000):
            try:
                await client.set(f"junk:{n}", b"j" * 10_000)
            except aioredis.ResponseError:
                break
        else:
            raise AssertionError("Redis never said it was full")
        # Stays full, whatever it frees of its clients' buffers when this one leaves.
        await client.config_set("maxmemory", 1)
    finally:
        await client.aclose()


# A real small-maxmemory Redis under each eviction policy deployments use.

REPLIES = 1200
EVENTS = 30  # of 100 bytes: about 4.7 KB a reply in Redis; 1,200 are about twice 4 MB's room


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl"])
async def test_replies_evicted_under_maxmemory_are_exact_or_told_never_replayed_wrong(
    tmp_path: Path, policy: str
):
    limit = ("--maxmemory", "4mb", "--maxmemory-policy", policy)
    with redis_server(tmp_path, *limit) as server:
        producer, reader = RedisReplayStore(server.url), RedisReplayStore(server.url)
        # Live replies, produced all along: under volatile-ttl their liveness keys (the
        # nearest to expire) go first; none may be taken for a dead producer.
        live = [f"live{n}" for n in range(10)]
        for reply in live:
            await producer.create(ReplyInfo(reply, owner="k"))
        for batch in range(0, REPLIES, 50):
            for n in range(batch, batch + 50):
                reply = f"r{n}"
                await producer.create(ReplyInfo(reply, owner="k"))
                producer.append(reply, events(reply, 1, EVENTS + 1))
                producer.end(reply, "finished")
            for reply in live:
                seq = producer._local._logs[reply].next_seq
                producer.append(reply, events(reply, seq, seq + 2))
            await producer.flush()
        info = await producer.redis.info("stats")
        assert info["evicted_keys"] > 0, "Redis did not evict: the test proves nothing"
        # Readers a few at a time: every connection's buffers count against maxmemory too
        # (600 at once evict everything).
        outcomes: collections.Counter[str] = collections.Counter()
        for batch in range(0, REPLIES, 20):
            replies = [f"r{n}" for n in range(batch, batch + 20)]
            outcomes.update(await asyncio.gather(*(account(reader, r) for r in replies)))
        alive = await asyncio.gather(*(reader.read(r, 10**6, wait_s=0.1) for r in live))
        print(policy, "evicted keys", info["evicted_keys"], dict(outcomes))
        assert set(outcomes) <= {"exact", "told gap", "gone 404", "gone 410"}, outcomes
        assert outcomes["exact"] < REPLIES  # some were evicted, and were told
        # Logs evicted behind their ending, which used to read as a lost generator.
        assert outcomes["told gap"] > 0
        assert not [r for r in alive if r is not None and r.producer_lost]
        await producer.aclose()
        await reader.aclose()


async def account(reader: RedisReplayStore, reply: str) -> str:
    """How a reader who resumes ``reply`` from its start fares: what it was told, or "wrong"
    (an event misplaced or altered, a silent hole, a lost producer for an ended reply)."""
    if await reader.info(reply) is None:
        gone = await reader.gone(reply)
        return "gone 410" if gone is not None and gone.reason == "evicted" else "gone 404"
    after, told = 0, False
    while True:
        result = await reader.read(reply, after, wait_s=0.5)
        if result is None:
            return "gone 404"  # evicted while read: the reader is told it expired
        if result.producer_lost:
            return "wrong: generator_lost"
        if result.lost is not None:
            if result.lost[0] != after + 1:
                return "wrong: gap misplaced"
            told, after = True, result.lost[1]
        for entry in result.entries:
            if entry != events(reply, entry.seq, entry.seq + 1)[0] or entry.seq != after + 1:
                return "wrong: event"
            after = entry.seq
        if result.ending is not None:
            if result.ending != "finished":
                return "wrong: ending"
            if told:
                return "told gap"
            return "exact" if after == EVENTS else "wrong: silent loss"


async def test_a_write_count_that_expired_while_idle_is_not_taken_for_an_eviction(
    tmp_path: Path,
):
    # The store's count of its calls lives the reply TTL after its last call: a replica that
    # writes nothing for that long finds it gone, by design, not evicted.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, ttl_after_end_s=1.0)
        await ended(producer, "before")
        await asyncio.sleep(2.5)  # idle for more than the TTL: the count expires
        await ended(producer, "after")
        assert producer.stats().evictions == 0
        assert producer.stats().repairs == 0
        await producer.aclose()
