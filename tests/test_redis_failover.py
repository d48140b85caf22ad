"""The Redis primary SIGKILLed under 200 live resumable replies; Sentinel promotes its replica.

Producers and readers reconnect to the promoted replica; what Redis lost (asynchronous
replication) is written again by each reply's producer from its copy, or told to readers as a
``gap``: every client has the exact text or was told, none lost anything silently, none saw
an event twice, nothing hangs (``tests/failover_scenario.py``; the figures, with recovery
times, from ``python benchmarks/redis_failover.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from replystream.delivery.redis_call_counts import CallCounts, Verdict
from replystream.delivery.redis_link import RedisLink
from replystream.delivery.redis_log_writer import LogWriter
from replystream.delivery.redis_repair import LocalCopy, StreamState, plan
from replystream.delivery.redis_reply_tables import ReplyTables
from replystream.delivery.redis_rewrite import write_repair
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo
from tests.failover_scenario import run
from tests.redis_server import redis_server, redis_with_sentinel


async def test_primary_killed_under_200_live_replies_every_client_exact_or_told(tmp_path: Path):
    async with asyncio.timeout(120):  # nothing hangs
        outcome = await run(tmp_path, replies=200)
    print(outcome.summary())
    assert outcome.silent == 0 and outcome.duplicated == 0
    assert outcome.exact + outcome.told_gap + sum(outcome.told_error.values()) == 200
    # The producers re-append what Redis lost: readers are not merely told, they get it.
    assert outcome.exact >= 190, outcome.summary()


def test_repair_plans_reappend_a_lost_tail_and_rewrite_a_stream_with_a_hole():
    entries = [LogEntry(n, None, "ab") for n in range(1, 11)]
    copy = LocalCopy(entries, bytes_before=0, ending=None, next_seq=11)
    intact = plan(copy, StreamState(first=1, last=10, length=10, known=True))
    assert intact.action == "nothing"
    tail = plan(copy, StreamState(first=1, last=6, length=6, known=True))
    assert (tail.action, [e.seq for e in tail.entries], tail.offsets) == (
        "append",
        [7, 8, 9, 10],
        [14, 16, 18, 20],  # the log's size up to each, as every entry carries it
    )
    hole = plan(copy, StreamState(first=1, last=10, length=7, known=True))
    assert hole.action == "rewrite" and [e.seq for e in hole.entries] == list(range(1, 11))
    trimmed = LocalCopy(entries[4:], bytes_before=8, ending="done", next_seq=11)
    short = plan(trimmed, StreamState(first=1, last=2, length=2, known=True))
    # Events 3 and 4 are held nowhere: they stay a hole, and readers are told.
    assert (short.action, short.entries[0].seq, short.missing) == ("append", 5, 2)
    assert (short.ending, short.ending_seq) == ("done", 11)
    lost_meta = plan(copy, StreamState(first=1, last=10, length=10, known=False))
    assert lost_meta.action == "rewrite"


def test_call_counts_tell_a_short_count_from_an_evicted_or_expired_one():
    counts = CallCounts(ttl_s=10)
    assert counts.after(0, 5, sent=0.0, now=0.1) == Verdict("as_expected")  # the first seen
    assert counts.after(0, 6, sent=1.0, now=1.1) == Verdict("as_expected")
    assert counts.after(0, 4, sent=2.0, now=2.1) == Verdict("lost", 3)  # 7 expected
    assert counts.after(0, 1, sent=3.0, now=3.1) == Verdict("evicted")  # started again
    # A TTL after the previous call, the count may have expired as it should: no verdict.
    assert counts.after(0, 1, sent=13.0, now=13.1) == Verdict("as_expected")
    assert counts.after(1, 1, sent=13.0, now=13.1) == Verdict("as_expected")  # its own group
    counts.forget()  # a call failed: its count is unknown
    assert counts.after(0, 1, sent=14.0, now=14.1) == Verdict("as_expected")
    assert counts.after(0, 1, sent=15.0, now=15.1) == Verdict("evicted")


def test_a_call_expects_the_count_its_last_call_left_and_learns_another_one():
    counts = CallCounts(ttl_s=10)
    assert counts.expected(0, now=0.0, within_s=5) == 0  # none seen: not checked
    counts.after(0, 7, sent=1.0, now=1.1)
    assert counts.expected(0, now=2.0, within_s=5) == 7
    # Answered past a TTL after the previous call, the count may have expired: unchecked.
    assert counts.expected(0, now=6.0, within_s=5) == 0
    assert counts.unexpected(0, 4, sent=2.0) == Verdict("lost", 3)
    assert counts.expected(0, now=2.1, within_s=5) == 4  # counted on from what Redis holds
    assert counts.unexpected(0, 9, sent=2.2) == Verdict("elsewhere")  # another primary's
    assert counts.unexpected(0, 0, sent=2.3) == Verdict("evicted")  # the count is gone
    assert counts.after(0, 1, sent=2.4, now=2.5) == Verdict("as_expected")
    counts.forget()
    assert counts.expected(0, now=2.6, within_s=5) == 0


async def test_a_hole_in_a_stream_is_told_as_lost_never_skipped(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("h"))
        producer.append("h", [LogEntry(n, "token", f"{n}") for n in range(1, 13)])
        producer.end("h", "finished")
        await producer.flush()
        # Events 6-8 lost, as a failover loses them when no producer holds them any more.
        await producer.redis.xdel(producer.keys.key("h"), "0-6", "0-7", "0-8")
        first = await reader.read("h", 0, wait_s=0)
        assert first is not None
        assert [e.seq for e in first.entries] == [1, 2, 3, 4, 5] and first.ending is None
        rest = await reader.read("h", 5, wait_s=0)
        assert rest is not None
        assert rest.lost == (6, 8) and [e.seq for e in rest.entries] == [9, 10, 11, 12]
        assert rest.ending == "finished"
        assert reader.stats().gaps == 0  # reads of the server's own tell nobody of a gap
        cursor = reader.cursor("h", 5)  # a reader's: it is told
        told = await cursor.read(0)
        cursor.close()
        assert told is not None and told.lost == (6, 8)
        assert reader.stats().gaps == 1
        await producer.aclose()
        await reader.aclose()


async def test_a_redis_restarted_empty_gets_back_every_reply_this_replica_holds(tmp_path: Path):
    # Redis restarted without its data (or a promoted replica that lacks the last writes)
    # while one reply was live and another had just ended: the producer holds both, and
    # writes both again, so a reader elsewhere reads the ended one whole, to its end.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("ended"))
        producer.append("ended", [LogEntry(n, "token", f"{n}") for n in range(1, 6)])
        producer.end("ended", "finished")
        await producer.create(ReplyInfo("live"))
        producer.append("live", [LogEntry(1, "token", "1")])
        await producer.flush()
        server.stop()
        producer.append("live", [LogEntry(2, "token", "2")])
        await producer.flush()  # fails: Redis is down
        server.start()
        async with asyncio.timeout(10):
            while producer.stats().repairs == 0:
                await producer.flush()
                await asyncio.sleep(0.1)
        for reply_id, last, ending in (("ended", 5, "finished"), ("live", 2, None)):
            result = await reader.read(reply_id, 0, wait_s=0)
            assert result is not None, reply_id
            assert [e.seq for e in result.entries] == list(range(1, last + 1))
            assert result.ending == ending
        await producer.aclose()
        await reader.aclose()


async def test_a_live_reply_redis_lost_is_waited_for_while_its_producer_writes_it_again(
    tmp_path: Path,
):
    # Redis came back without the reply (restarted without its data, or a promoted replica
    # that lacks it) a moment before its producer writes it again: a reader elsewhere, or a
    # resume there, must wait for it rather than be told the reply is gone.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("r"))
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(1, 4)])
        await producer.flush()
        for task in producer._tasks:  # its writes are made below, when the test says
            task.cancel()
        following = asyncio.create_task(reader.read("r", 3, wait_s=1.0))
        await asyncio.sleep(0.2)
        server.stop()
        await asyncio.sleep(0.3)
        server.start()
        async with asyncio.timeout(10):
            assert await following is not None  # it waits on
        producer.append("r", [LogEntry(4, "token", "4")])

        async def write_again() -> None:
            await asyncio.sleep(0.5)
            while producer.stats().repairs == 0:
                await producer.flush()
                await asyncio.sleep(0.1)

        writing = asyncio.create_task(write_again())
        async with asyncio.timeout(10):
            assert await reader.info("r") is not None  # a resume waits for it too
            await writing
            result = await reader.read("r", 0, wait_s=0)
        assert result is not None and [e.seq for e in result.entries] == [1, 2, 3, 4]
        await producer.aclose()
        await reader.aclose()


async def test_a_restart_no_command_saw_is_found_and_what_it_lost_written_again(
    tmp_path: Path,
):
    # Redis restarted without its data between two commands: none failed, on the producer or
    # on a reader elsewhere. A resume elsewhere at once waits for the live reply (its producer
    # writes it again) rather than calling it gone; the reply that had ended is written again
    # too, so every replica reads it, not only its producer.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("ended"))
        producer.append("ended", [LogEntry(n, "token", f"{n}") for n in range(1, 4)])
        producer.end("ended", "finished")
        await producer.create(ReplyInfo("live"))
        producer.append("live", [LogEntry(1, "token", "1")])
        await producer.flush()
        assert await reader.info("live") is not None
        await asyncio.sleep(1.5)  # a heartbeat on each side has seen this Redis
        server.stop()
        server.start()
        async with asyncio.timeout(10):
            assert await reader.info("live") is not None  # waited for, not gone
            while (result := await reader.read("ended", 0, wait_s=0)) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert [e.seq for e in result.entries] == [1, 2, 3] and result.ending == "finished"
        live = await reader.read("live", 0, wait_s=0)
        assert live is not None and [e.seq for e in live.entries] == [1]
        await producer.aclose()
        await reader.aclose()


async def test_the_producing_replica_serves_its_copy_of_an_ended_reply_redis_lost(
    tmp_path: Path,
):
    # Redis restarted without its data after a reply ended: its producer still holds the
    # whole reply, and a resume there reads it, as it does when only the stream was
    # evicted. Only a delete (which leaves its mark) makes the producer drop its copy.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("r", owner="k"))
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(1, 6)])
        producer.end("r", "finished")
        await producer.flush()
        server.stop()
        server.start()
        async with asyncio.timeout(10):
            assert await producer.info("r") == ReplyInfo("r", owner="k")
            result = await producer.read("r", 0, wait_s=0)
        assert result is not None and [e.seq for e in result.entries] == [1, 2, 3, 4, 5]
        assert result.ending == "finished"
        await producer.aclose()


async def _created(store: RedisReplayStore, info: ReplyInfo) -> None:
    """``create``, flushed here: no flusher task runs, so every write is one of the test's."""
    creating = asyncio.ensure_future(store.writer.create(info))
    await asyncio.sleep(0)  # queued
    await store.flush()
    assert await creating is None


async def _wrote_three(url: str) -> tuple[RedisReplayStore, RedisReplayStore]:
    """A producer that created reply "r" and wrote its events 1 to 3, each write flushed by
    the test, and a reader of the same Redis."""
    producer, reader = RedisReplayStore(url), RedisReplayStore(url)
    await _created(producer, ReplyInfo("r", owner="k"))
    producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(1, 4)])
    await producer.flush()
    return producer, reader


async def _read_all(reader: RedisReplayStore, reply_id: str) -> tuple[list[int], list[object]]:
    """Every event of a reply Redis holds now, read from the start as a reader elsewhere
    reads it, and what it was told was lost."""
    seqs: list[int] = []
    told: list[object] = []
    after = 0
    while True:
        result = await reader.read(reply_id, after, wait_s=0)
        assert result is not None
        if result.lost is not None:
            told.append(result.lost)
        if not result.entries:
            return seqs, told
        seqs += [e.seq for e in result.entries]
        after = result.entries[-1].seq


async def _replicate(client: object, port: int | None) -> None:
    """``REPLICAOF`` a loopback Redis (None: ``NO ONE``), waiting for the sync to end."""
    redis = client
    if port is None:
        await redis.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[attr-defined]
        return
    await redis.execute_command("REPLICAOF", "127.0.0.1", port)  # type: ignore[attr-defined]
    async with asyncio.timeout(10):
        while True:
            info = await redis.info("replication")  # type: ignore[attr-defined]
            if info.get("master_link_status") == "up" and not info.get("master_sync_in_progress"):
                return
            await asyncio.sleep(0.05)


async def test_events_after_writes_redis_lost_wait_for_their_repair_never_a_false_gap(
    tmp_path: Path,
):
    # The primary acknowledged events 4 and 5, then a replica that had only 1-3 took over
    # (Sentinel's planned failover: here the replica is promoted, and the old primary made a
    # replica of it, so it takes its data, as a demoted primary does). No call failed. The
    # producer's next events, 6 and 7, must not land past the hole: a reader elsewhere would
    # be told 4 and 5 were lost, though the producer holds them and writes them again. Its
    # call finds its count short and writes nothing; 4 to 7 are written, in order, first.
    with redis_server(tmp_path / "primary") as primary, redis_server(tmp_path / "spare") as spare:
        producer, reader = await _wrote_three(primary.url)
        other = RedisReplayStore(spare.url)
        await _replicate(other.redis, primary.port)
        assert await producer.redis.execute_command("WAIT", 1, 5000) == 1
        await _replicate(other.redis, None)  # promoted, without what comes next
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(4, 6)])
        await producer.flush()  # acknowledged by the old primary alone
        await _replicate(producer.redis, spare.port)  # demoted: it takes the new one's data
        await _replicate(producer.redis, None)
        assert (await _read_all(reader, "r"))[0] == [1, 2, 3]  # 4 and 5 are gone
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(6, 8)])
        await producer.flush()
        assert await _read_all(reader, "r") == ([1, 2, 3, 4, 5, 6, 7], [])
        assert producer.stats().lost_writes == 1 and reader.stats().gaps == 0
        producer.append("r", [LogEntry(8, "token", "8")])
        producer.end("r", "finished")
        await producer.flush()
        assert await _read_all(reader, "r") == (list(range(1, 9)), [])
        assert producer.stats().lost_writes == 1
        for store in (producer, reader, other):
            await store.aclose()


async def test_events_after_calls_another_primary_took_wait_for_the_repair_never_a_false_gap(
    tmp_path: Path,
):
    # A demoted primary still took writes while the client reached both (a planned
    # failover): the call that wrote events 4 and 5 went to the other one, which also took
    # more calls of this producer since; the Redis answering now lacks 4 and 5, and holds a
    # count past the one the producer's last call left. Events 6 and 7 must not land past
    # the hole; a repair planned from a read of one primary must not append to the other.
    with redis_server(tmp_path) as server:
        producer, reader = await _wrote_three(server.url)
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(4, 6)])
        await producer.flush()
        # This Redis never had 4 and 5, and its count is the other primary's.
        await reader.redis.xdel(producer.keys.key("r"), "0-4", "0-5")
        await reader.redis.execute_command("XSETID", producer.keys.key("r"), "0-3")
        await reader.redis.incrby(producer.keys.counter_key(0), 2)
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(6, 8)])
        await producer.flush()
        assert await _read_all(reader, "r") == (list(range(1, 8)), [])
        # A repair planned from one state is not applied to a stream found otherwise.
        entries = [LogEntry(n, "token", f"{n}") for n in range(1, 10)]
        copy = LocalCopy(entries, bytes_before=0, ending=None, next_seq=10)
        state = StreamState(first=1, last=7, length=7, known=True)
        repair = plan(copy, state)
        assert repair.action == "append"
        await reader.redis.xdel(producer.keys.key("r"), "0-7")  # not the stream it read
        await reader.redis.execute_command("XSETID", producer.keys.key("r"), "0-6")
        async with reader.redis.pipeline(transaction=False) as pipe:
            write_repair(
                pipe,
                producer.keys.key,
                ReplyInfo("r", owner="k"),
                repair,
                state,
                ttl_s=60,
                live_s=3.0,
                kept_from=1,
            )
            assert await pipe.execute() == [2]  # written nothing: planned again
        assert (await _read_all(reader, "r"))[0] == list(range(1, 7))
        for store in (producer, reader):
            await store.aclose()


async def test_events_after_redis_lost_everything_wait_for_the_repair_never_a_false_gap(
    tmp_path: Path,
):
    # Redis lost everything between two calls, and no call failed (a restart without its data
    # quick enough that the connection held, as FLUSHALL leaves it), before any heartbeat
    # found another Redis answering: the producer's count of its calls is gone with the rest.
    # Its next events must not make the stream anew from event 4 (a reader elsewhere would
    # be told 1 to 3 were lost): the call writes nothing, the reply is written again from
    # its copy, then the rest.
    with redis_server(tmp_path) as server:
        producer, reader = await _wrote_three(server.url)
        await reader.redis.flushall()
        producer.append("r", [LogEntry(n, "token", f"{n}") for n in range(4, 6)])
        await producer.flush()
        assert await _read_all(reader, "r") == ([1, 2, 3, 4, 5], [])
        assert reader.stats().gaps == 0
        assert await reader.info("r") == ReplyInfo("r", owner="k")
        for store in (producer, reader):
            await store.aclose()


async def test_after_a_planned_failover_no_command_goes_to_the_old_primary(tmp_path: Path):
    # SENTINEL FAILOVER promotes the replica, and the old primary goes on taking writes until
    # Sentinel makes it a replica, about 10 s later. The connections made to it, idle or in
    # use as the failover happens, must not carry commands on: what they wrote is lost when
    # it becomes a replica, and one process writing to two primaries leaves holes in both.
    with redis_with_sentinel(tmp_path) as running:
        link = RedisLink(running.url, connect_timeout_s=2.0, failover_s=10.0, liveness_s=3.0)
        redis = link.redis
        assert isinstance(redis, Redis)
        assert await link.servers_changed() is False  # the first asked
        pool = redis.connection_pool
        in_use = [await pool.get_connection() for _ in range(3)]  # type: ignore[no-untyped-call]
        await asyncio.gather(*(redis.ping() for _ in range(3)))  # and some idle
        running.fail_over()
        changed = await link.servers_changed()  # a heartbeat, a second later at most
        for connection in in_use:
            await pool.release(connection)
        answers = await asyncio.gather(*(redis.info("server") for _ in range(8)))
        assert {int(answer["tcp_port"]) for answer in answers} == {running.replica.port}
        assert changed  # and what the old one took is written again (its count tells too)
        await redis.aclose()


def held(writer: LogWriter) -> dict[str, set[str]]:
    """The replies each of the writer's per-reply tables still holds (none empty)."""
    tables: dict[str, set[str]] = {
        name: set(getattr(writer.tables, name)) for name in ReplyTables.__slots__
    }
    return {name: replies for name, replies in tables.items() if replies}


async def test_replies_whose_writes_failed_are_forgotten_once_ended_and_their_copy_gone(
    tmp_path: Path,
):
    # One reply's write refused by Redis; one live through an outage longer than the
    # failover time (it fails); one that ended in that outage (its ending never sent). Once
    # each has ended and this replica's copy of it expired, the writer holds nothing of them.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, ttl_after_end_s=1.0, failover_s=0.5)
        for reply_id in ("refused", "outage", "ended"):
            await producer.create(ReplyInfo(reply_id))
            producer.append(reply_id, [LogEntry(1, "token", "1")])
        await producer.redis.xadd(producer.keys.key("refused"), {"d": "x"}, id="0-100")
        producer.append("refused", [LogEntry(2, "token", "2")])
        await producer.flush()
        assert producer.failure("refused") is not None
        server.stop()
        producer.append("outage", [LogEntry(2, "token", "2")])
        await producer.flush()  # fails: from now on the writer repairs before it writes
        producer.end("ended", "finished")
        async with asyncio.timeout(10):
            while producer.failure("outage") is None:
                await producer.flush()
                await asyncio.sleep(0.1)
        producer.end("outage", "errored")
        producer.end("refused", "errored")
        server.start()
        # And one that ended in an outage shorter than the failover time: repaired.
        await producer.create(ReplyInfo("repaired"))
        producer.append("repaired", [LogEntry(1, "token", "1")])
        await producer.flush()
        repairs = producer.stats().repairs
        server.stop()
        producer.append("repaired", [LogEntry(2, "token", "2")])
        await producer.flush()  # fails
        producer.end("repaired", "finished")
        server.start()
        async with asyncio.timeout(10):
            while producer.stats().repairs == repairs:
                await producer.flush()
                await asyncio.sleep(0.1)
        deadline = time.monotonic() + 15
        while held(producer.writer) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        assert held(producer.writer) == {}
        await producer.aclose()


async def test_a_reply_that_ended_in_an_outage_past_the_failover_time_is_written_after_it(
    tmp_path: Path,
):
    # Its writes failed for longer than failover_s, but the reply had ended: its copy here is
    # whole. It was dropped from the writes due (never written again), so after the outage
    # another replica answered 404 for a reply its producer still served.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, failover_s=0.5)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("ended", owner="k"))
        producer.append("ended", [LogEntry(1, "token", "a")])
        await producer.flush()
        server.stop()
        producer.append("ended", [LogEntry(2, "token", "b"), LogEntry(3, "token", "c")])
        producer.end("ended", "finished")
        await producer.flush()  # fails: the outage begins
        await asyncio.sleep(1.0)  # past the failover time
        await producer.flush()  # fails again, past it
        assert producer.failure("ended") is None  # ended, so not failed: still due
        server.start()
        async with asyncio.timeout(10):
            while True:  # the writer's retries reach Redis within a back-off
                got = await reader.read("ended", 0, wait_s=0)
                if got is not None and got.ending is not None:
                    break
                await asyncio.sleep(0.2)
        assert await reader.info("ended") == ReplyInfo("ended", owner="k")
        assert [e.data for e in got.entries] == ["a", "b", "c"] and got.ending == "finished"
        await producer.aclose()
        await reader.aclose()


async def test_readers_during_the_repair_of_an_ended_reply_never_see_a_false_gap(
    tmp_path: Path,
):
    # An ended reply whose metadata lost its owner (a write Redis lost) is rewritten from
    # its producer's copy while readers elsewhere read it again and again. The metadata
    # keeps the ending throughout, so a reader that found the stream half written would
    # take the rest for lost: each must read every event and the ending, or nothing.
    count = 5000
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, max_entries=2 * count)
        reader = RedisReplayStore(server.url, max_entries=2 * count)
        entries = [
            LogEntry(n, "token", f'{{"n": {n}, "pad": "{"x" * 20}"}}') for n in range(1, count + 1)
        ]
        await producer.create(ReplyInfo("r", owner="k"))
        producer.append("r", entries)
        producer.end("r", "finished")
        await producer.flush()
        seen: list[str] = []
        reading = True

        async def read_again_and_again() -> None:
            while reading:
                after, told = 0, ""
                while True:
                    result = await reader.read("r", after, wait_s=0)
                    assert result is not None
                    if result.lost is not None:
                        told = f"lost {result.lost}"
                        break
                    if result.entries:
                        assert result.entries[0].seq == after + 1
                        after = result.entries[-1].seq
                    if result.ending is not None:
                        told = f"{after} then {result.ending}"
                        break
                seen.append(told)

        readers = [asyncio.ensure_future(read_again_and_again()) for _ in range(4)]
        for _ in range(8):
            repairs = producer.stats().repairs
            await producer.redis.hdel(producer.keys.key("r", ":meta"), "owner")
            # Redis lost acknowledged writes (its count of this store's calls came back
            # short): the producer checks every reply it holds and rewrites this one.
            await producer.redis.decr(producer.keys.counter_key(0))
            await producer.create(ReplyInfo(f"next-{repairs}"))
            async with asyncio.timeout(10):
                while producer.stats().repairs == repairs:
                    await producer.flush()
            await asyncio.sleep(0.2)
        reading = False
        await asyncio.gather(*readers)
        assert seen and set(seen) == {f"{count} then finished"}, sorted(set(seen))
        await producer.aclose()
        await reader.aclose()


async def test_an_outage_is_logged_once_as_it_begins_and_once_as_it_ends(tmp_path: Path, caplog):
    # A replica producing a reply (its liveness refreshed every second) and reading one
    # made elsewhere (its reader mark refreshed every second) through 4 s of Redis down.
    caplog.set_level(logging.WARNING, logger="replystream.redis_store")
    with redis_server(tmp_path) as server:
        store = RedisReplayStore(server.url, liveness_s=10.0)
        await store.create(ReplyInfo("live"))
        await store.reading("elsewhere")
        await asyncio.sleep(1.5)
        server.stop()
        for _ in range(8):
            await store.reading("elsewhere")  # its reader goes on reading
            await asyncio.sleep(0.5)
        server.start()
        for _ in range(5):
            await store.reading("elsewhere")
            await asyncio.sleep(0.5)
        await store.aclose()
    told = [r.getMessage() for r in caplog.records if r.name == "replystream.redis_store"]
    for what in ("liveness refresh", "reader marks' refresh"):
        lines = [line for line in told if line.startswith(what)]
        assert len(lines) == 2, (what, told)
        assert " failed: " in lines[0]
        ended = r".* succeeds again, after failing for \d+\.\d s \(\d+ attempts\)"
        assert re.fullmatch(ended, lines[1]), lines[1]
        failed_for = float(lines[1].split("failing for ")[1].split(" s")[0])
        assert 3.0 <= failed_for <= 7.0, lines[1]


async def test_a_producer_found_lost_is_told_at_once_to_the_next_read(tmp_path: Path):
    # Finding a producer lost takes a wait for its heartbeat (BEAT_CONFIRM_S); a response's
    # object asked for again (every poll of a failed response) paid that wait each time.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, liveness_s=1.0)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("r"))
        producer.append("r", [LogEntry(1, "token", "1")])
        await producer.flush()
        for task in producer._tasks:  # it dies: no more heartbeats, its liveness lapses
            task.cancel()
        await asyncio.sleep(1.5)
        took = []
        for _ in range(2):
            began = time.monotonic()
            result = await reader.read("r", 1, wait_s=0.1)
            took.append(time.monotonic() - began)
            assert result is not None and result.producer_lost
        await producer.aclose()
        await reader.aclose()
    assert took[1] < took[0] / 2, took  # the second read asked no heartbeat again


async def test_a_restart_a_reader_found_first_still_has_the_replies_held_written_again(
    tmp_path: Path,
):
    # A replica that both produced a reply and looked for one it could not find: its read
    # found the restart before its heartbeat did, and the repair the heartbeat would have
    # ordered never came (the change was already seen): the ended reply stayed lost.
    with redis_server(tmp_path) as server:
        both = RedisReplayStore(server.url)
        other = RedisReplayStore(server.url)
        await both.create(ReplyInfo("ended"))
        both.append("ended", [LogEntry(n, "token", f"{n}") for n in range(1, 4)])
        both.end("ended", "finished")
        await both.flush()
        await asyncio.sleep(1.5)  # its heartbeat has seen this Redis
        for task in both._tasks:  # and beats no more: only the read below finds the restart
            if task.get_name() == "redis-store-heartbeat":
                task.cancel()
        server.stop()
        server.start()
        for _ in range(3):  # its pool's connections made anew: no command of the store fails
            with contextlib.suppress(RedisError, OSError):
                await both.redis.ping()
        assert await both.info("never-made") is None  # the read that finds the restart
        async with asyncio.timeout(10):
            while (result := await other.read("ended", 0, wait_s=0)) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert [e.seq for e in result.entries] == [1, 2, 3] and result.ending == "finished"
        await both.aclose()
        await other.aclose()


async def test_an_ended_reply_written_again_is_kept_only_what_is_left_of_its_ttl(
    tmp_path: Path,
):
    # Redis lost everything (a restart without its data); the producer writes its replies
    # again from its copy. An ended one is kept --reply-ttl-s from its end, not from the
    # repair: a restart must not keep a reply longer than the server promises.
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, ttl_after_end_s=8.0)
        reader = RedisReplayStore(server.url)
        await _created(producer, ReplyInfo("ended", owner="k"))
        producer.append("ended", [LogEntry(n, "token", f"{n}") for n in range(1, 4)])
        producer.end("ended", "finished")
        await producer.flush()
        await asyncio.sleep(3.0)
        await reader.redis.flushall()
        producer.writer.failover.redis_replaced()  # as its heartbeat finds another Redis
        await producer.flush()
        assert (await _read_all(reader, "ended"))[0] == [1, 2, 3]
        left = await reader.redis.ttl(producer.keys.key("ended"))
        assert 0 < left <= 6, left  # about 5 of its 8 s left, not 8 again
        for store in (producer, reader):
            await store.aclose()
