"""A reader of a reply made on another replica stops soon after its client disconnects.

Such a reader (its request's handler task) awaits Redis commands while the reply is quiet:
once every ``LIVENESS_POLL_S`` it asks whether the reply is still there and its producer
alive. aiohttp cancels the handler once when the client goes; on Python 3.11 a cancel that
lands as a command's reply arrives is lost inside redis-py (its ``asyncio.wait_for``), and
the reader went on following the reply, keeping its reader mark in Redis (so the producer
kept a reply nobody reads), until its next write: a keep-alive, an event or the end.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from replystream.delivery.follower import LIVENESS_POLL_S
from replystream.delivery.redis_connect import connect, parse_redis_url
from replystream.delivery.redis_store import RedisReplayStore
from replystream.server.app import create_app
from replystream.server.context import MANAGER_KEY
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request
from tests.redis_server import redis_server

CLIENTS = 80
# Well under the default keep-alive (15 s), whose write would end a reader that lost its
# cancel; well over a poll and a heartbeat (1 s each), which a reader that notices it takes.
STOPPED_WITHIN_S = 5.0


async def test_readers_on_another_replica_stop_when_their_clients_disconnect(tmp_path: Path):
    # Replica A makes a reply that stays quiet (its next token is minutes away); every client
    # reads it through replica B and disconnects at a random point near one of its reader's
    # liveness polls, where the cancel can land inside a Redis command.
    quiet = fast_engine(delay_ms=120_000.0, jitter_ms=0.0)
    rng = random.Random()
    with redis_server(tmp_path) as redis:
        a = create_app(quiet, ServerConfig(), RedisReplayStore(redis.url))
        b = create_app(fast_engine(), ServerConfig(), RedisReplayStore(redis.url))
        marks = connect(parse_redis_url(redis.url), connect_timeout_s=2, command_timeout_s=5)
        async with running(a) as url_a, running(b) as url_b:
            made = await raw_request(
                f"{url_a}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            reply_id = made.headers["x-reply-id"]

            async def read_then_leave() -> None:
                await asyncio.sleep(rng.random())
                reader = await raw_request(f"{url_b}/v1/replies/{reply_id}/stream")
                assert reader.status == 200
                polls = rng.choice((1, 2))
                await asyncio.sleep(polls * LIVENESS_POLL_S + rng.uniform(-0.003, 0.005))
                reader.writer.transport.abort()

            try:
                await asyncio.gather(*(read_then_leave() for _ in range(CLIENTS)))
                readers = b[MANAGER_KEY].readers
                try:
                    await wait_for(lambda: not readers, timeout_s=STOPPED_WITHIN_S)
                except TimeoutError:
                    pytest.fail(f"{len(readers)} of {CLIENTS} readers follow on, clients gone")
                async with asyncio.timeout(STOPPED_WITHIN_S):
                    # The producer is told its readers left: their marks go.
                    while await marks.keys("*:read"):  # noqa: ASYNC110  (Redis is polled)
                        await asyncio.sleep(0.05)
            finally:
                await made.aclose()
                await marks.aclose()
