"""A reader far behind its reply is cut for byte lag, whichever store keeps the log.

The reader's cursor comes from the reply's store and says how far behind it is: in this
process's memory, or in Redis (for a reply made here, or on another replica). The stall
deadline is set far beyond the test, so only the byte limit can cut these readers.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import ReplayStore
from replystream.server.app import create_app
from replystream.server.context import MANAGER_KEY
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request
from tests.redis_server import redis_server
from tests.scripted_engine import GroupedPushEngine

LIMIT = 256 << 10
POLICY = DeliveryPolicy(slow_client_bytes=LIMIT, slow_client_s=600.0)


async def never_reading(url: str, body: dict[str, object]) -> tuple[bytes, float]:
    """Start a reply, read nothing while it runs, then everything; (body, seconds taken)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    response = await raw_request(f"{url}/v1/replies", "POST", json.dumps(body).encode())
    assert response.status == 200
    await asyncio.sleep(2.0)  # the server fills the socket and its own buffers meanwhile
    async with asyncio.timeout(60):
        return await response.read_body(), loop.time() - started


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
async def test_a_reader_far_behind_a_local_reply_is_cut_for_byte_lag(store_kind, tmp_path):
    # 200 tokens of 128 KB (25 MB) pushed at once to a client that does not read.
    engine = GroupedPushEngine(["y" * (128 << 10)] * 200, group=200)
    with redis_server(tmp_path) if store_kind == "redis" else _no_redis() as redis:
        store: ReplayStore | None = None
        if redis is not None:
            store = RedisReplayStore(redis.url, max_entries=1000)
        app = create_app(engine, ServerConfig(policy=POLICY), store)
        async with running(app) as url:
            body, _ = await never_reading(
                url, {"prompt": "x", "resumable": True, "disconnect": "cancel"}
            )
            await wait_for(lambda: not app[MANAGER_KEY].replies, timeout_s=20)
            metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert re.search(rb"event: error\ndata: .*bytes behind.*slow_client", body[-400:])
    assert b'outcome="slow_client"} 1.0' in metrics


async def test_a_reader_on_another_replica_is_cut_for_byte_lag(tmp_path: Path):
    # The reply is made on replica A (its own reader keeps up); a reader of it on replica B
    # reads nothing until the reply has ended. B's cursor measures its lag from the byte
    # offsets Redis entries carry. The reply (24 MB) is more than loopback's socket buffers
    # hold (some 10 MB at most), so B's backlog passes the limit however slowly A makes it;
    # a fixed 2 s wait once let a busy machine's slower reply fit in them, and B kept up.
    engine = fast_engine(reply_text=("z" * 8000 + " ") * 3000, delay_ms=1.0, jitter_ms=0.0)
    with redis_server(tmp_path) as redis:
        a = create_app(engine, ServerConfig(policy=POLICY), RedisReplayStore(redis.url))
        b = create_app(fast_engine(), ServerConfig(policy=POLICY), RedisReplayStore(redis.url))
        async with running(a) as url_a, running(b) as url_b:
            first = await raw_request(
                f"{url_a}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            reply_id = first.headers["x-reply-id"]
            reading = asyncio.ensure_future(first.read_body())
            slow = await raw_request(f"{url_b}/v1/replies/{reply_id}/stream")
            assert slow.status == 200
            async with asyncio.timeout(60):
                await reading  # the whole reply made, B reading none of it
                tail = await slow.read_body()
    assert re.search(rb"event: error\ndata: .*bytes behind.*slow_client", tail[-400:])


class _no_redis:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
