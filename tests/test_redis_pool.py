"""A replica's Redis client holds a bounded number of connections per node, and a burst of
commands past them waits for a free one instead of failing: for one server, through
Sentinel, and on a Cluster (real redis-server processes on loopback).

Each command here is a ``BLPOP`` that holds its connection for a fixed time, so a burst of
four times the pool's size runs in four waves: all succeed, and the waves show the bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from replystream.delivery.redis_connect import connect, parse_redis_url
from tests.redis_server import redis_cluster, redis_server, redis_with_sentinel

POOL = 10
HOLD_S = 0.3


@pytest.fixture(params=["single", "sentinel", "cluster"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "single":
        with redis_server(tmp_path) as server:
            yield server.url
    elif request.param == "sentinel":
        with redis_with_sentinel(tmp_path) as sentinel:
            yield sentinel.url
    else:
        with redis_cluster(tmp_path) as cluster:
            yield cluster.url


async def test_a_burst_past_the_pool_waits_for_connections_instead_of_failing(url: str):
    client = connect(
        parse_redis_url(url),
        connect_timeout_s=2.0,
        command_timeout_s=10.0,
        max_connections=POOL,
    )
    try:
        await client.ping()
        began = time.monotonic()
        # One key for all: on a Cluster every command goes to one node, whose pool is bounded.
        answers = await asyncio.gather(
            *(client.blpop(["burst"], timeout=HOLD_S) for _ in range(4 * POOL))
        )
        took = time.monotonic() - began
    finally:
        await client.aclose()
    assert answers == [None] * (4 * POOL)
    # Four waves of POOL commands, each holding its connection HOLD_S: at most POOL at once.
    assert took >= 3.5 * HOLD_S


async def test_a_cluster_connection_closed_mid_write_is_a_connection_error(
    monkeypatch: pytest.MonkeyPatch,
):
    """redis-py lets a close racing a send escape as the stream writer's AttributeError (seen
    resuming a reply over a Cluster); the client says what it means, so retries see it."""

    async def closed_mid_write(*args: object, **kwargs: object) -> object:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")

    monkeypatch.setattr(RedisCluster, "execute_command", closed_mid_write)
    client = connect(
        parse_redis_url("redis+cluster://127.0.0.1:7000"),
        connect_timeout_s=1.0,
        command_timeout_s=1.0,
    )
    with pytest.raises(RedisConnectionError, match="connection closed while in use"):
        await client.hgetall("k")
