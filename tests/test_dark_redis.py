"""Redis on a network of its own (a veth pair into a namespace, ``tests/netns.py``) that goes
dark: every packet dropped, no FIN, no reset, as behind a partition or a pulled cable. The
store must tell Redis unreachable within its documented bounds, in one log line, and serve
again as it was once the partition heals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from replystream.delivery.redis_link import BEAT_CONFIRM_S, COMMAND_TIMEOUT_S, HEARTBEAT_S
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo, StoreUnavailable
from tests.netns import client_namespace
from tests.redis_server import redis_cluster

pytestmark = pytest.mark.slow

LIVENESS_S = 3.0  # the store's default: a live reply's key lasts this long unless refreshed


async def test_a_store_that_met_its_cluster_dark_keeps_its_replies_alive_once_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # A replica started (or running) while no node of its Redis Cluster answers: the
    # Cluster client then says so with errors of its own, outside redis-py's RedisError,
    # which no part of the store took for Redis unreachable: the write was logged as a bug
    # with a traceback, and the heartbeat ended for good, so that once the cluster answered
    # again no live reply's liveness was refreshed, and a reader on another replica called
    # its producer lost after a few quiet seconds.
    with (
        client_namespace() as ns,
        redis_cluster(tmp_path, replicas=0, host=ns.client_ip, launcher=ns.inside) as cluster,
    ):
        await ns.blackout()
        # Connects given up after a quarter of a second: a dark node costs each try that.
        producer = RedisReplayStore(
            cluster.url, liveness_s=LIVENESS_S, failover_s=0.5, connect_timeout_s=0.25
        )
        elsewhere = RedisReplayStore(cluster.url, liveness_s=LIVENESS_S)  # another replica
        try:
            with pytest.raises(StoreUnavailable):
                await producer.create(ReplyInfo("early"))
            await asyncio.sleep(4 * HEARTBEAT_S)  # beats that meet the cluster dark
            await ns.restore()
            await producer.create(ReplyInfo("later"))
            producer.append("later", [LogEntry(1, "token", "{}")])
            await producer.flush()
            # Quiet (a long prefill, a tool call): only the heartbeat keeps it alive, past
            # the time its liveness key lasts and a reader's wait for a beat.
            until = time.monotonic() + LIVENESS_S + BEAT_CONFIRM_S + 3.0
            while time.monotonic() < until:
                result = await elsewhere.read("later", 1, wait_s=1.0)
                assert result is not None and not result.producer_lost
        finally:
            await producer.aclose()
            await elsewhere.aclose()
    ours = [r for r in caplog.records if r.name.startswith("replystream")]
    assert not [r for r in ours if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in ours
    ]


async def test_replies_on_the_shards_that_answer_stay_alive_while_one_shard_is_dark(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # One primary of a Cluster gone dark, the others answering (before the cluster fails
    # it over: its cluster-node-timeout, 15 s by default). The heartbeat waited on the dark
    # node for the command timeout at each beat, twice (asking which servers answer, and
    # its replies' refresh), so the replies on the shards that answer had no beat for 10 s
    # at a time: readers on another replica called their live producer lost.
    with (
        client_namespace() as ns,
        redis_cluster(tmp_path, replicas=0, host=ns.client_ip, launcher=ns.inside) as cluster,
    ):
        producer = RedisReplayStore(cluster.url, liveness_s=LIVENESS_S)
        elsewhere = RedisReplayStore(cluster.url, liveness_s=LIVENESS_S)  # another replica
        try:
            ids = [f"reply{n:02d}" for n in range(12)]  # spread over the three shards
            for reply_id in ids:
                await producer.create(ReplyInfo(reply_id))
                producer.append(reply_id, [LogEntry(1, "token", "{}")])
            await producer.flush()
            # The shard of the last slots: not the first, whose node the Cluster client asks
            # what the keys of a blocking read are (its default node).
            dark = cluster.nodes[-1]
            owners = {reply_id: cluster.owner_of(producer.keys.key(reply_id)) for reply_id in ids}
            answering = [r for r in ids if owners[r] != f"{ns.client_ip}:{dark.port}"]
            assert 0 < len(answering) < len(ids), owners
            for reply_id in answering:  # read once: the other replica knows the cluster
                assert await elsewhere.read(reply_id, 0, wait_s=0) is not None
            await ns.blackout(dark.port, dark.port + 10000)  # its clients' port, its bus's
            # Quiet replies (a long prefill): only the heartbeat keeps them alive. Read past
            # the time two slow beats took, and a reader's wait for a beat.
            until = time.monotonic() + 4 * COMMAND_TIMEOUT_S
            while time.monotonic() < until:
                results = await asyncio.gather(
                    *(elsewhere.read(reply_id, 1, wait_s=1.0) for reply_id in answering)
                )
                lost = [r for r, result in zip(answering, results, strict=True) if not result]
                lost += [
                    r
                    for r, result in zip(answering, results, strict=True)
                    if result and result.producer_lost
                ]
                assert not lost, f"called lost while their producer lives: {lost}"
            await ns.restore()
        finally:
            await producer.aclose()
            await elsewhere.aclose()
    told = [r.getMessage() for r in caplog.records if r.name == "replystream.redis_store"]
    assert sum("liveness refresh failed" in line for line in told) == 1, told


async def test_a_reader_elsewhere_gets_each_event_at_once_while_the_first_shard_is_dark(
    tmp_path: Path,
):
    # The Cluster client asks one node of its own (its default: the first shard's primary)
    # what the keys of a blocking XREAD are. With that node dark, the blocking read of the
    # readers on another replica never came back in time: readers of the replies on the
    # shards that answer got their events in bursts, as each gave up waiting (2.5 s, or
    # the connect timeout if shorter) and read again plainly, not as they were made.
    connect_s = 4.0
    with (
        client_namespace() as ns,
        redis_cluster(tmp_path, replicas=0, host=ns.client_ip, launcher=ns.inside) as cluster,
    ):
        producer = RedisReplayStore(cluster.url, connect_timeout_s=connect_s)
        elsewhere = RedisReplayStore(cluster.url, connect_timeout_s=connect_s)
        try:
            ids = [f"reply{n:02d}" for n in range(6)]
            for reply_id in ids:
                await producer.create(ReplyInfo(reply_id))
                producer.append(reply_id, [LogEntry(1, "token", "{}")])
            await producer.flush()
            dark = cluster.nodes[0]  # the first slots' shard
            owners = {r: cluster.owner_of(producer.keys.key(r)) for r in ids}
            answering = [r for r in ids if owners[r] != f"{ns.client_ip}:{dark.port}"]
            assert answering, owners
            for reply_id in answering:  # read once: the other replica knows the cluster
                assert await elsewhere.read(reply_id, 0, wait_s=0) is not None
            await ns.blackout(dark.port, dark.port + 10000)
            for seq in (2, 3, 4):
                # The reader waits for the next event, which comes a moment later.
                waits = [
                    asyncio.create_task(elsewhere.read(r, seq - 1, wait_s=2 * connect_s))
                    for r in answering
                ]
                await asyncio.sleep(0.3)
                made = time.monotonic()
                for reply_id in answering:
                    producer.append(reply_id, [LogEntry(seq, "token", "{}")])
                await producer.flush()
                results = await asyncio.gather(*waits)
                late = time.monotonic() - made
                assert all(r is not None and [e.seq for e in r.entries] == [seq] for r in results)
                assert late < connect_s / 2, f"event {seq} reached the reader {late:.1f} s late"
            await ns.restore()
        finally:
            await producer.aclose()
            await elsewhere.aclose()
