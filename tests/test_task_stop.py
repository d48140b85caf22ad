"""A background task that makes Redis calls is stopped for good by ``stop_task``; a task
cancelled once ends at its next ``end_if_cancelled`` if the cancel was lost.

On Python 3.11 a cancel that lands as a command's reply arrives is lost inside redis-py
(its ``asyncio.wait_for``), so one ``cancel()`` and an ``await`` can wait forever: the
store's close hung that way. These tests cancel such tasks at many points of their calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from pathlib import Path

import pytest

from replystream.delivery.redis_connect import connect, parse_redis_url
from replystream.delivery.task_stop import drop_task, end_if_cancelled, stop_task
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


async def test_a_task_that_lost_its_one_cancel_ends_at_its_next_check():
    rounds = 0

    async def looping() -> None:
        nonlocal rounds
        while True:
            end_if_cancelled()
            rounds += 1
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # lost, as inside redis-py: the task goes round again

    task = asyncio.ensure_future(looping())
    await asyncio.sleep(0)
    task.cancel()
    async with asyncio.timeout(5):
        await asyncio.wait({task})
    assert task.cancelled() and rounds == 1


async def test_a_timeout_that_expired_and_was_handled_ends_nothing():
    async def looping() -> int:
        for _ in range(3):
            end_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.001):
                    await asyncio.sleep(10)
        return 3

    async with asyncio.timeout(5):
        assert await asyncio.ensure_future(looping()) == 3


class _Held:
    """What a reply's task holds in its frame (its log, say), and the task itself."""

    task: asyncio.Task[None] | None = None


async def _holding(held: _Held) -> None:
    held.task = asyncio.current_task()  # the frame holds the task: a cycle through its error
    await asyncio.sleep(60)


@pytest.mark.parametrize("let_go", ["stop_task", "drop_task"])
async def test_a_task_let_go_of_is_freed_without_the_cycle_collector(let_go: str):
    # A cancelled task keeps its CancelledError, whose traceback holds its frames: with the
    # task in their locals, all it held waited for a full collection, which the server makes
    # rare. Let go of here, it is freed as soon as nothing else holds it.
    gc.collect()
    gc.disable()
    try:
        task = asyncio.get_running_loop().create_task(_holding(_Held()), name="held")
        await asyncio.sleep(0)
        if let_go == "stop_task":
            await stop_task(task)
        else:
            drop_task(task)
            await asyncio.wait({task})
            await asyncio.sleep(0)  # its done callbacks run
        del task
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [t for t in gc.garbage if isinstance(t, asyncio.Task) and t.get_name() == "held"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
