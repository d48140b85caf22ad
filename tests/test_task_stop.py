"""A background task that makes Redis calls is stopped for good by ``stop_task``.

On Python 3.11 a cancel that lands as a command's reply arrives is lost inside redis-py
(its ``asyncio.wait_for``), so one ``cancel()`` and an ``await`` can wait forever: the
store's close hung that way. These tests cancel such tasks at many points of their calls.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from replystream.delivery.redis_connect import connect, parse_redis_url
from replystream.delivery.task_stop import stop_task
from tests.redis_server import redis_server

ROUNDS = 200


async def test_a_task_beating_on_redis_is_stopped_wherever_the_cancel_lands(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        client = connect(parse_redis_url(redis.url), connect_timeout_s=2, command_timeout_s=5)
        rng = random.Random(7)
        try:

            async def beating() -> None:  # as the store's heartbeat does, faster
                while True:
                    await client.delete("a:read", "b:read")
                    await asyncio.sleep(0.002)

            for _ in range(ROUNDS):
                task = asyncio.ensure_future(beating())
                await asyncio.sleep(rng.random() * 0.002)
                async with asyncio.timeout(5):
                    await stop_task(task)
                assert task.done()
        finally:
            await client.aclose()


async def test_a_task_that_swallows_a_cancel_is_cancelled_again_until_it_ends():
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while swallowed < 3:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1  # as a lost cancel leaves it: running, "cancelling"
        await asyncio.sleep(10)

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await stop_task(task)
    assert task.cancelled() and swallowed == 3
