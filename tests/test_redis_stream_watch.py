"""The one shared XREAD that readers of replies made on other replicas wait on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from replystream.delivery import redis_follow
from replystream.delivery.redis_follow import StreamWatch
from tests.redis_server import redis_server


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as server:
        yield server.url


async def test_a_reader_that_waits_during_a_call_behind_its_cursor_misses_no_entry(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader registered while the shared call read after a later entry than its own was
    # handed that call's entries: those between its place and the call's were skipped, and
    # its stream told a gap of events Redis still held.
    monkeypatch.setattr(redis_follow, "BLOCK_MS", 5000)  # the call stays under way
    redis = Redis.from_url(url)
    try:
        for seq in range(1, 6):
            await redis.xadd("log", {"d": str(seq)}, id=f"0-{seq}")
        watch = StreamWatch(redis, count=100)
        ahead = asyncio.create_task(watch.after("log", 5, 10.0))
        await asyncio.sleep(0.2)  # its call, after entry 5, blocks in Redis
        behind = asyncio.create_task(watch.after("log", 2, 10.0))
        await asyncio.sleep(0)
        await redis.xadd("log", {"d": "6"}, id="0-6")
        got_ahead, got_behind = await asyncio.gather(ahead, behind)
        assert [row[0] for row in got_ahead] == [b"0-6"]
        assert [row[0] for row in got_behind] == [b"0-3", b"0-4", b"0-5", b"0-6"]
        await watch.aclose()
    finally:
        await redis.aclose()
