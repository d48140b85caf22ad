"""A server left idle frees what its past requests left behind once it is due to go.

A server that runs for weeks meets bursts and then quiet hours. What a burst leaves (the logs
of ended replies, kept for ``--reply-ttl-s``; the ids of deleted responses, told as deleted
for a minute; a rate bucket per client) must go once its time is up, whether or not more
requests come or metrics are scraped: before, the memory store dropped expired logs only
every 256 new replies (or on a scrape), and the per-client limits forgot refilled buckets
only every 1,024 requests, so a quiet server held the last burst's replies and clients for
good.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from replystream.delivery import replay
from replystream.delivery.replay import MemoryReplayStore
from replystream.server import create_app, guard, running
from replystream.server.guard import GATE_KEY
from replystream.server.guard_config import GuardConfig, parse_trusted_proxies
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for

REPLIES = 12
TTL_S = 0.3


async def test_an_idle_server_frees_expired_replies_and_old_deletes(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(replay, "DELETED_TOLD_S", TTL_S)
    store = MemoryReplayStore(ttl_after_end_s=TTL_S)
    app = create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0), ServerConfig(), store)
    async with running(app) as url, aiohttp.ClientSession() as http:
        for n in range(REPLIES):
            body = {"prompt": f"p{n}", "max_tokens": 3, "resumable": True}
            async with http.post(f"{url}/v1/replies", json=body) as response:
                assert response.status == 200
                await response.read()
            body = {"input": f"i{n}", "max_output_tokens": 3}  # stored, as OpenAI's default
            async with http.post(f"{url}/v1/responses", json=body) as response:
                assert response.status == 200
                made = await response.json()
            async with http.delete(f"{url}/v1/responses/{made['id']}") as response:
                assert response.status == 200
        assert len(store._logs) == REPLIES  # the deleted ones are gone at once
        assert len(store._deleted) == REPLIES
        # Nothing more is asked (not even metrics): the store frees them on its own.
        await wait_for(lambda: not store._logs and not store._deleted, timeout_s=5.0)


async def test_an_idle_server_forgets_the_rate_buckets_of_its_clients(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(guard, "BUCKETS_SWEPT_EVERY_S", 0.2)
    proxies = parse_trusted_proxies(["127.0.0.1"])
    # A request's token comes back in a hundredth of a second: each bucket is full at once.
    config = ServerConfig(guard=GuardConfig(per_minute=6000, trusted_proxies=proxies))
    app = create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0), config)
    async with running(app) as url, aiohttp.ClientSession() as http:
        for n in range(REPLIES):
            client = {"X-Forwarded-For": f"203.0.113.{n}"}
            async with http.get(f"{url}/wait?max_tokens=1", headers=client) as response:
                assert response.status == 200
        gate = app[GATE_KEY]
        assert len(gate._buckets) == REPLIES
        await wait_for(lambda: not gate._buckets, timeout_s=5.0)


async def test_a_client_at_its_rate_limit_keeps_its_bucket_through_the_sweeps(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(guard, "BUCKETS_SWEPT_EVERY_S", 0.1)
    app = create_app(fast_engine(), ServerConfig(guard=GuardConfig(per_minute=2)))
    async with running(app) as url, aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(3):
            async with http.get(f"{url}/wait?max_tokens=1") as response:
                statuses.append(response.status)
        await asyncio.sleep(0.5)  # several sweeps: a drained bucket refills in 30 s
        async with http.get(f"{url}/wait?max_tokens=1") as response:
            statuses.append(response.status)
    assert statuses == [200, 200, 429, 429]
