"""Resumable replies over a real three-shard Redis Cluster (a replica per shard), on loopback.

A reply's keys carry its id as a hash tag, so they share one slot (multi-key commands and a
reply's reads go to one shard), while different replies spread over the shards. Two
``replystream serve`` replicas use ``redis+cluster://``; a reply cut on one resumes on the
other. The resume contract suite runs on a cluster too (``tests/test_replay_contract.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo
from tests.processes import replica
from tests.rawhttp import raw_request
from tests.redis_server import RedisCluster, redis_cluster
from tests.test_redis_cancel_channel import HEARD_WITHIN_S, cancel_delays

REPLICA_ARGS = ("--engine", "simulated", "--delay-ms", "4", "--jitter-ms", "1", "--tokens", "80")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


async def test_a_replys_keys_share_one_slot_and_replies_spread_over_the_shards(
    cluster: RedisCluster,
):
    store = RedisReplayStore(cluster.url, prefix="slots:")
    ids = [f"reply{n:02d}" for n in range(24)]
    for reply_id in ids:
        await store.create(ReplyInfo(reply_id))
        store.append(reply_id, [LogEntry(1, "token", "{}")])
        await store.request_cancel(reply_id)  # writes the :cancel key too
    await store.flush()

    def owning_shards() -> set[str]:
        shards: set[str] = set()
        for reply_id in ids:
            keys = [f"slots:{{{reply_id}}}{part}" for part in ("", ":meta", ":live", ":cancel")]
            assert all(cluster.command("exists", key) == "1" for key in keys)
            assert len({cluster.command("cluster", "keyslot", key) for key in keys}) == 1, keys
            owners = {cluster.owner_of(key) for key in keys}
            assert len(owners) == 1, keys
            shards |= owners
        return shards

    # Hundreds of redis-cli runs: in a thread, so the store's heartbeat keeps each reply's
    # short-lived liveness key alive meanwhile, however slow the machine.
    shards = await asyncio.to_thread(owning_shards)
    assert len(shards) == 3  # 24 replies: every shard holds some
    await store.delete(ids[0])  # one script on all four keys: legal only within one slot
    gone = [f"slots:{{{ids[0]}}}{part}" for part in ("", ":live", ":cancel")]
    assert [cluster.command("exists", key) for key in gone] == ["0"] * 3
    # The metadata's place holds the delete's mark, alone.
    assert cluster.command("hkeys", f"slots:{{{ids[0]}}}:meta") == "deleted"
    await store.aclose()


async def test_a_reply_cut_on_one_replica_resumes_on_the_other_over_the_cluster(
    cluster: RedisCluster,
):
    args = (*REPLICA_ARGS, "--redis-url", cluster.url)
    async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
        starts = [
            await raw_request(f"{a_url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}')
            for _ in range(6)  # six replies: their keys land on every shard
        ]
        ids = []
        for start in starts:
            ids.append(start.headers["x-reply-id"])
            await start.reader.readuntil(b"\n\n")  # the reply event
            await start.reader.readuntil(b"\n\n")  # and the first token: then the cut
            await start.aclose()

        async def resume(reply_id: str) -> tuple[bytes, bytes]:
            resumed = await raw_request(
                f"{b_url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "2"}
            )
            body = await resumed.read_body()
            whole = await raw_request(f"{a_url}/v1/replies/{reply_id}/stream")
            return body, await whole.read_body()

        results = await asyncio.gather(*(resume(reply_id) for reply_id in ids))
    for body, whole in results:
        assert body.startswith(b"event: token\nid: 3\n")
        assert whole.endswith(body) and b"event: done" in body
        tokens = [
            json.loads(line[6:])["text"]
            for line in whole.split(b"\n")
            if line.startswith(b'data: {"text"')
        ]
        assert len(tokens) == 80


async def test_a_cancel_asked_on_another_replica_is_heard_at_once_over_the_cluster(
    cluster: RedisCluster,
):
    # Published on one node, a cluster's message reaches a listener on any other.
    delays = await cancel_delays(cluster.url, prefix="cancels:")
    assert max(delays) < HEARD_WITHIN_S, [round(d, 3) for d in delays]
