"""The contract every ReplayStore keeps: the in-memory store and the Redis store alike.

For Redis, "a reader elsewhere" is a second store instance on the same Redis (another
replica), which has no local copy and reads the stream itself. ``redis-cluster`` runs the same
suite on a real three-shard Redis Cluster with a replica per shard (one per module; each test
has its own key prefix).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from replystream.delivery import replay
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import (
    LogEntry,
    LogTail,
    MemoryReplayStore,
    ReplayStore,
    ReplyInfo,
)
from tests.conftest import wait_for
from tests.redis_server import RedisCluster, redis_cluster, redis_server


def frames(start: int, stop: int) -> list[LogEntry]:
    """Events of every kind a log holds: named ones, and plain messages (no type)."""
    return [
        LogEntry(n, "token" if n % 3 else None, f'{{"n": {n}, "text": "\\u00e9"}}')
        for n in range(start, stop)
    ]


# A log's byte bound in these stores: far above what the small frames above add up to.
KEPT_BYTES = 64 << 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[ReplayStore, ReplayStore]]:
    """(the producer's store, a reader's store): the same object for memory."""
    if request.param == "memory":
        store = MemoryReplayStore(ttl_after_end_s=0.5, max_entries=50, max_bytes=KEPT_BYTES)
        yield store, store
        await store.aclose()
        return
    options = {
        "ttl_after_end_s": 1.0,
        "liveness_s": 1.0,
        "max_entries": 50,
        "max_bytes": KEPT_BYTES,
    }
    if request.param == "redis-cluster":
        url = request.getfixturevalue("cluster").url
        prefix = f"test:{uuid.uuid4().hex}:"
        producer = RedisReplayStore(url, prefix=prefix, **options)  # type: ignore[arg-type]
        reader = RedisReplayStore(url, prefix=prefix, **options)  # type: ignore[arg-type]
        yield producer, reader
        await producer.aclose()
        await reader.aclose()
        return
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, **options)  # type: ignore[arg-type]
        reader = RedisReplayStore(server.url, **options)  # type: ignore[arg-type]
        yield producer, reader
        await producer.aclose()
        await reader.aclose()


async def settle(store: ReplayStore) -> None:
    if isinstance(store, RedisReplayStore):
        await store.flush()


async def test_a_store_that_takes_its_commands_says_so_when_first_asked(stores):
    # Asked before serving (``serve`` stops on a refusal): every store here takes them, a
    # Redis and a Redis Cluster that ask no password included. Refusals: test_redis_first_contact.
    for store in stores:
        assert await store.first_contact() is None


async def test_a_store_says_whether_another_process_reads_its_replies(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("told"))
    producer.append("told", frames(1, 2))
    await settle(producer)
    # Memory's two roles are one object: another process's store is another object.
    elsewhere = reader if reader is not producer else MemoryReplayStore()
    assert (await elsewhere.info("told") is not None) is producer.shared is reader.shared


async def test_replay_after_an_id_then_follow_the_live_tail_to_the_end(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("r1", owner="k"))
    producer.append("r1", frames(1, 6))
    await settle(producer)
    first = await reader.read("r1", 2, wait_s=0)
    assert [e.seq for e in first.entries] == [3, 4, 5]
    assert first.ending is None and first.lost is None

    async def produce_later() -> None:
        await asyncio.sleep(0.1)
        producer.append("r1", frames(6, 8))
        await settle(producer)

    async with asyncio.TaskGroup() as group:
        group.create_task(produce_later())
        live = await reader.read("r1", 5, wait_s=5)
    assert [e.seq for e in live.entries][:1] == [6]
    producer.end("r1", "finished")
    await settle(producer)
    rest = await reader.read("r1", live.entries[-1].seq, wait_s=1)
    assert [e.seq for e in rest.entries] == list(range(live.entries[-1].seq + 1, 8))
    assert rest.ending == "finished"
    whole = await reader.read("r1", 0, wait_s=0)
    assert whole.entries == frames(1, 8)  # every field, as it was appended
    assert (await reader.info("r1")) == ReplyInfo("r1", owner="k")


async def test_a_finished_reply_is_readable_until_its_ttl_then_gone(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("r2"))
    producer.append("r2", frames(1, 3))
    await settle(producer)
    # Read once while it runs: the reader's first look (a cluster's slots learned, its
    # connections made) may take longer than the 1 s the ended reply is kept on a busy machine.
    assert (await reader.read("r2", 0, wait_s=0)).entries == frames(1, 3)
    producer.end("r2", "finished")
    await settle(producer)
    assert (await reader.read("r2", 0, wait_s=0)).ending == "finished"
    if isinstance(producer, RedisReplayStore):
        await producer.aclose()  # the producing replica goes away; Redis keeps the reply
    await asyncio.sleep(1.6)
    assert await reader.read("r2", 0, wait_s=0) is None
    assert await reader.info("r2") is None


async def test_unknown_replies_are_none(stores):
    _, reader = stores
    assert await reader.read("never", 0, wait_s=0) is None
    assert await reader.info("never") is None


async def test_entries_no_longer_kept_are_reported_as_lost_not_skipped(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("r3"))
    for start in range(1, 201, 20):  # 200 entries into a log that keeps about 50
        producer.append("r3", frames(start, start + 20))
        await settle(producer)
    result = await reader.read("r3", 10, wait_s=0)
    assert result.lost is not None
    first_kept = result.entries[0].seq
    assert result.lost == (11, first_kept - 1)
    assert first_kept > 11 and result.entries[-1].seq == 200
    # A reader only just behind what is kept: told of the two it missed, then given all the
    # rest (not only as many of the newest as it is behind).
    near = await reader.read("r3", first_kept - 3, wait_s=0)
    assert near.lost == (first_kept - 2, first_kept - 1)
    assert [e.seq for e in near.entries] == list(range(first_kept, 201))
    # Those reads were the server's own (finding a reply, answering an object): nobody was
    # told of a gap. A reader's read, through its cursor, is told: each one counted.
    assert reader.stats().gaps == 0
    reads = {10: result.lost, first_kept - 3: near.lost, first_kept - 1: None}
    for after, lost in reads.items():
        cursor = reader.cursor("r3", after)
        told = await cursor.read(0)
        cursor.close()
        assert told is not None and told.lost == lost
    assert reader.stats().gaps == 2  # the two that found entries gone, no other


async def test_a_log_keeps_its_newest_entries_within_its_byte_bound(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("big"))
    # Deltas of 20 KiB: a handful outgrow a 64 KiB log long before 50 entries do.
    for seq in range(1, 13):
        producer.append("big", [LogEntry(seq, None, f'{{"n": {seq}, "t": "{"x" * 20_000}"}}')])
        await settle(producer)
        # A trim drops the oldest down to nine tenths of the bound, no further: a reader a
        # little behind still finds what it has not read.
        so_far = await reader.read("big", 0, wait_s=0)
        kept_now = sum(len(e.data) for e in so_far.entries)
        assert kept_now >= min(seq * 20_000, KEPT_BYTES * 9 // 10 - 20_100)
    result = await reader.read("big", 0, wait_s=0)
    assert result is not None and result.lost is not None
    first_kept = result.entries[0].seq
    assert result.lost == (1, first_kept - 1)
    assert [e.seq for e in result.entries] == list(range(first_kept, 13))
    # The producer keeps at most its bound (trimmed to nine tenths of it, a step); a shared
    # store keeps what the producer keeps (trimmed whole nodes at a time: perhaps one more).
    kept = sum(len(e.data) for e in result.entries)
    assert len(result.entries) >= 2 and kept <= KEPT_BYTES + 20_100
    if isinstance(producer, RedisReplayStore):
        # A live reply's stream shorter than what was written, because the producer's copy
        # dropped its start, is no stream Redis lost: nothing is written again.
        await asyncio.sleep(2.2)  # two heartbeats
        assert (producer.stats().evictions, producer.stats().repairs) == (0, 0)
    # One entry larger than the whole bound is still kept, as the newest.
    producer.append("big", [LogEntry(13, None, f'{{"t": "{"y" * (KEPT_BYTES + 1)}"}}')])
    producer.end("big", "finished")
    await settle(producer)
    ended = await reader.read("big", 12, wait_s=0)
    assert ended is not None and [e.seq for e in ended.entries] == [13]
    assert (ended.lost, ended.ending) == (None, "finished")
    if not isinstance(producer, RedisReplayStore):  # (Redis trims whole nodes: perhaps more)
        assert [e.seq for e in (await producer.read("big", 0, wait_s=0)).entries] == [13]


async def test_a_reader_blocked_on_a_live_reply_wakes_for_the_ending(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("r4"))
    producer.append("r4", frames(1, 2))
    await settle(producer)

    async def end_later() -> None:
        await asyncio.sleep(0.1)
        producer.end("r4", "errored")
        await settle(producer)

    async with asyncio.TaskGroup() as group:
        group.create_task(end_later())
        result = await reader.read("r4", 1, wait_s=5)
    assert result.entries == [] and result.ending == "errored"


async def test_a_read_with_nothing_new_waits_its_wait(stores):
    producer, reader = stores
    await producer.create(ReplyInfo("quiet"))
    producer.append("quiet", frames(1, 2))
    await settle(producer)
    # A follower reads with a wait of a second at most (its liveness poll, or less to a
    # keep-alive): a read of a quiet reply that came back at once would have it spin.
    began = time.monotonic()
    result = await reader.read("quiet", 1, wait_s=0.5)
    assert result is not None and (result.entries, result.ending) == ([], None)
    assert time.monotonic() - began >= 0.4


async def test_cancel_requests_reach_the_producer(stores):
    producer, reader = stores
    stopped: list[str] = []
    producer.on_cancel(stopped.append)
    await producer.create(ReplyInfo("r5"))
    await producer.create(ReplyInfo("other"))
    await reader.request_cancel("r5")  # on the producer's replica or another one
    async with asyncio.timeout(15):  # a heartbeat a second; generous for a loaded machine
        while not stopped:  # noqa: ASYNC110  (a remote request is seen by a heartbeat)
            await asyncio.sleep(0.05)
    assert stopped == ["r5"]


@pytest.mark.parametrize("where", ["producer", "reader"])
async def test_a_cursor_measures_its_lag_in_bytes_and_moves_as_it_sends(stores, where):
    producer, reader = stores
    await producer.create(ReplyInfo("r8"))
    producer.append("r8", frames(1, 11))
    await settle(producer)
    store = producer if where == "producer" else reader
    size = {e.seq: len(e.data) for e in frames(1, 11)}
    cursor = store.cursor("r8", 3)
    result = await cursor.read(wait_s=0)
    assert [e.seq for e in result.entries] == list(range(4, 11))
    assert cursor.after == 3  # a read does not move the cursor; sending does
    assert cursor.lag_bytes() == sum(size[n] for n in range(4, 11))
    cursor.sent(5, size[4] + size[5])
    assert (cursor.after, cursor.lag_bytes()) == (5, sum(size[n] for n in range(6, 11)))
    producer.append("r8", frames(11, 13))
    await settle(producer)
    result = await cursor.read(wait_s=0)
    assert [e.seq for e in result.entries] == list(range(6, 13))
    assert cursor.lag_bytes() == sum(size[n] for n in range(6, 11)) + sum(
        len(e.data) for e in frames(11, 13)
    )


@pytest.mark.parametrize("where", ["producer", "reader"])
async def test_a_cursor_measures_lag_in_utf8_bytes_whatever_the_text(stores, where):
    # The slow-client limit is in bytes: data of two-, three- and four-byte characters
    # (accents, CJK, emoji) counts each character's UTF-8 bytes, not one per character.
    producer, reader = stores
    await producer.create(ReplyInfo("r12"))
    texts = ["caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e\u306e\u6587", "\U0001f600" * 8, "ascii"]
    entries = [LogEntry(n, "token", text) for n, text in enumerate(texts, start=1)]
    producer.append("r12", entries)
    await settle(producer)
    store = producer if where == "producer" else reader
    size = [len(text.encode()) for text in texts]
    assert size == [12, 15, 32, 5]
    cursor = store.cursor("r12", 0)
    result = await cursor.read(wait_s=0)
    assert result is not None and result.entries == entries
    assert cursor.lag_bytes() == sum(size)
    cursor.sent(2, size[0] + size[1])
    assert cursor.lag_bytes() == size[2] + size[3]
    # A cursor that starts part way knows the bytes up to its place from the store.
    later = store.cursor("r12", 3)
    await later.read(wait_s=0)
    assert later.lag_bytes() == size[3]
    producer.append("r12", [LogEntry(5, None, "\u00e9" * 100)])
    await settle(producer)
    await cursor.read(wait_s=0)
    assert await cursor.measure() == (size[2] + size[3] + 200, 200)
    # The log's latest write, whole: what one append added, however many entries it held.
    producer.append("r12", [LogEntry(6, None, "x" * 30), LogEntry(7, None, "\u00e9" * 5)])
    await settle(producer)
    assert await cursor.measure() == (size[2] + size[3] + 200 + 40, 40)


async def test_release_and_discard_never_lose_what_a_reader_still_needs(stores):
    producer, _ = stores
    await producer.create(ReplyInfo("r9"))
    producer.append("r9", frames(1, 6))
    producer.release("r9", 3)  # a reply nobody may resume: 1-3 were sent
    result = await producer.read("r9", 3, wait_s=0)
    assert [e.seq for e in result.entries] == [4, 5] and result.lost is None
    producer.release("r9", 4)  # all but the newest
    result = await producer.read("r9", 4, wait_s=0)
    assert [e.seq for e in result.entries] == [5] and result.lost is None
    producer.end("r9", "finished")
    await settle(producer)
    producer.discard("r9")
    after_discard = await producer.read("r9", 5, wait_s=0)
    if isinstance(producer, RedisReplayStore):
        # Redis keeps a reply for whoever resumes it, on any replica, until its TTL.
        assert after_discard is not None and after_discard.ending == "finished"
    else:
        assert after_discard is None


async def test_a_reader_releasing_as_it_goes_loses_nothing_however_long_the_reply(stores):
    producer, _ = stores
    await producer.create(ReplyInfo("long"))
    # Five times the log's byte bound in all, never more than two entries unsent, released
    # but for the newest (the first half) or whole: the bound counts what is kept, not what
    # came and went.
    sent = 0
    for seq in range(1, 331):
        producer.append("long", [LogEntry(seq, None, "x" * 1000)])
        if seq % 3 == 0:
            result = await producer.read("long", sent, wait_s=0)
            assert result.lost is None, seq
            assert [e.seq for e in result.entries] == list(range(sent + 1, seq + 1))
            sent = seq
            producer.release("long", seq - 1 if seq <= 165 else seq)
    await settle(producer)


async def test_redis_reader_reports_a_producer_that_stopped_refreshing_liveness(tmp_path: Path):
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, liveness_s=1.0)
        reader = RedisReplayStore(server.url)
        await producer.create(ReplyInfo("r6"))
        producer.append("r6", frames(1, 4))
        await producer.flush()
        # The producing replica dies without writing an ending (no flush, no heartbeat).
        for task in producer._tasks:
            task.cancel()
        await asyncio.sleep(1.5)
        result = await reader.read("r6", 0, wait_s=0)
        assert result is not None and [e.seq for e in result.entries] == [1, 2, 3]
        lost = await reader.read("r6", 3, wait_s=0.2)
        assert lost is not None and lost.producer_lost and lost.ending is None
        await reader.aclose()
        await producer.redis.aclose()


async def test_redis_down_makes_create_fail_clearly_and_recovers(tmp_path: Path):
    from replystream.delivery.replay import StoreUnavailable

    with redis_server(tmp_path) as server:
        store = RedisReplayStore(server.url, connect_timeout_s=0.5)
        await store.create(ReplyInfo("before"))
        server.stop()
        with pytest.raises(StoreUnavailable):
            await store.create(ReplyInfo("during"))
        server.start()
        await store.create(ReplyInfo("after"))
        assert await store.info("after") is not None
        await store.aclose()


async def test_tail_names_the_last_event_and_whether_the_reply_ended(stores):
    producer, reader = stores
    assert await reader.tail("never") is None
    await producer.create(ReplyInfo("r7"))
    await settle(producer)
    assert await reader.tail("r7") == LogTail(0, ended=False)
    producer.append("r7", frames(1, 5))
    await settle(producer)
    assert await reader.tail("r7") == LogTail(4, ended=False)
    assert await producer.tail("r7") == LogTail(4, ended=False)
    producer.end("r7", "done")
    await settle(producer)
    # Once ended, every event up to the last is readable: a resume past it is a mistake.
    assert await reader.tail("r7") == LogTail(4, ended=True)
    assert await producer.tail("r7") == LogTail(4, ended=True)
    result = await reader.read("r7", 4, wait_s=0)
    assert result is not None and result.entries == [] and result.ending == "done"


@pytest.mark.parametrize("deleted_on", ["producer", "reader"])
async def test_a_reply_deleted_while_produced_is_stopped_and_stays_deleted(stores, deleted_on):
    producer, reader = stores
    stopped: list[str] = []
    producer.on_cancel(stopped.append)
    await producer.create(ReplyInfo("r11", owner="k"))
    producer.append("r11", frames(1, 4))
    await settle(producer)
    await (producer if deleted_on == "producer" else reader).delete("r11")
    # Elsewhere, the producer hears of it at its next heartbeat (a second apart).
    await wait_for(lambda: stopped == ["r11"], timeout_s=5)
    # Stopping, it appends its last events and ends, as a cancelled reply does; and the
    # heartbeats go on meanwhile. None of it makes the reply again.
    producer.append("r11", frames(4, 6))
    await settle(producer)
    if isinstance(producer, RedisReplayStore):
        await asyncio.sleep(2.5)
    producer.end("r11", "cancelled")
    await settle(producer)
    for store in (producer, reader):
        assert await store.info("r11") is None
        assert await store.tail("r11") is None
        assert await store.read("r11", 0, wait_s=0) is None


async def test_a_replys_dialect_is_kept_with_it_before_any_event(stores):
    # A resume before the first event is logged tells its reader's notices in this dialect.
    producer, reader = stores
    info = ReplyInfo("r11", owner="k", dialect="anthropic")
    await producer.create(info)
    await settle(producer)
    assert await reader.info("r11") == info
    assert await producer.info("r11") == info
    producer.end("r11", "finished")
    await settle(producer)


async def test_a_replys_asked_keepalive_is_kept_with_it_for_its_readers_anywhere(stores):
    # A resume on any replica keeps the interval the reply's request asked for.
    producer, reader = stores
    asked = ReplyInfo("r14", owner="k", dialect="openai", keepalive_s=0.3)
    none_asked = ReplyInfo("r15", owner="k")
    for info in (asked, none_asked):
        await producer.create(info)
    await settle(producer)
    for info in (asked, none_asked):
        assert await reader.info(info.reply_id) == info
        producer.end(info.reply_id, "finished")
    await settle(producer)
    assert await reader.info("r14") == asked  # kept with the reply after its end too


async def test_delete_forgets_a_reply_everywhere_and_context_is_kept_until_then(stores):
    producer, reader = stores
    info = ReplyInfo("r10", owner="k", context='[{"role": "user"}]')
    await producer.create(info)
    producer.append("r10", frames(1, 4))
    await settle(producer)
    # Read once while it runs: the reader's first look (a cluster's slots learned, its
    # connections made) may take longer than the 1 s the ended reply is kept on a busy machine.
    assert await reader.info("r10") == info
    producer.end("r10", "finished")
    await settle(producer)
    assert await reader.info("r10") == info
    await reader.delete("r10")  # from any replica
    assert await producer.info("r10") is None
    assert await reader.info("r10") is None
    assert await reader.read("r10", 0, wait_s=0) is None


@pytest.mark.parametrize("deleted_on", ["producer", "reader"])
async def test_a_deleted_reply_is_told_as_deleted_not_as_unknown_or_expired(stores, deleted_on):
    # A reader that finds a reply gone asks why: a deleted one says so (its readers are told
    # ``deleted``, not ``expired``), on every replica, whichever made the delete.
    producer, reader = stores
    await producer.create(ReplyInfo("r13", owner="k"))
    producer.append("r13", frames(1, 4))
    await settle(producer)
    cursors = [producer.cursor("r13", 0), reader.cursor("r13", 0)]
    for cursor in cursors:
        assert (await cursor.read(wait_s=0)).entries == frames(1, 4)
        assert await cursor.gone() is None  # there: nothing to tell
    await (producer if deleted_on == "producer" else reader).delete("r13")
    # Elsewhere, the producer's copy goes at its next heartbeat: its reader reads on until then.
    async with asyncio.timeout(5):
        while await producer.read("r13", 0, wait_s=0) is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    for store in (producer, reader):
        gone = await store.gone("r13")
        assert gone is not None and gone.reason == "deleted" and "deleted" in gone.detail
    for cursor in cursors:
        assert await cursor.read(wait_s=0) is None
        gone = await cursor.gone()
        assert gone is not None and gone.reason == "deleted"
        cursor.close()


async def test_what_a_producer_writes_after_a_delete_made_elsewhere_is_never_read(stores):
    # Its producer hears of the delete at its next heartbeat, and writes on until then. A
    # reader following the reply (on Redis: the shared XREAD) read those events from the
    # stream they made again: the client got text said after the delete, or, had it been
    # behind, an ``events_lost`` for the events the delete removed, never ``deleted``.
    producer, reader = stores
    await producer.create(ReplyInfo("r16", owner="k"))
    producer.append("r16", frames(1, 4))
    await settle(producer)
    cursor = reader.cursor("r16", 0)
    assert (await cursor.read(wait_s=0)).entries == frames(1, 4)
    await reader.delete("r16")
    producer.append("r16", frames(4, 6))
    await settle(producer)
    assert await cursor.read(wait_s=0.5) is None  # waiting for what follows event 3
    gone = await cursor.gone()
    assert gone is not None and gone.reason == "deleted"
    cursor.close()
    assert await reader.read("r16", 0, wait_s=0) is None


async def test_an_unknown_or_expired_reply_is_not_told_as_gone_for_a_reason(stores):
    producer, reader = stores
    assert await reader.gone("never") is None
    await producer.create(ReplyInfo("r14"))
    producer.append("r14", frames(1, 2))
    producer.end("r14", "finished")
    await settle(producer)
    assert (await reader.read("r14", 0, wait_s=0)).ending == "finished"
    if isinstance(producer, RedisReplayStore):
        await producer.aclose()  # the producing replica goes away; Redis keeps the reply
    await asyncio.sleep(1.6)
    assert await reader.read("r14", 0, wait_s=0) is None
    assert await reader.gone("r14") is None  # expired: nothing said of it


async def test_the_memory_store_remembers_deleted_replies_for_a_while_and_a_bounded_number(
    monkeypatch: pytest.MonkeyPatch,
):
    now = [1000.0]
    monkeypatch.setattr(replay, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(replay, "DELETED_TOLD_MAX", 3)
    store = MemoryReplayStore()
    for n in range(5):
        await store.create(ReplyInfo(f"d{n}"))
        await store.delete(f"d{n}")
    # The oldest are forgotten past the bound; the newest are told.
    told = [(await store.gone(f"d{n}")) is not None for n in range(5)]
    assert told == [False, False, True, True, True]
    now[0] += replay.DELETED_TOLD_S - 1
    assert await store.gone("d4") is not None
    now[0] += 2  # past the time a delete is told for
    assert [await store.gone(f"d{n}") for n in range(5)] == [None] * 5
    assert store._deleted == {}  # forgotten, not only untold
    # An id made again (it never is, in practice) is not told as deleted.
    await store.delete("d0")
    await store.create(ReplyInfo("d0"))
    assert await store.gone("d0") is None
    await store.aclose()
