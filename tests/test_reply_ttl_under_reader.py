"""A reader still sending an ended reply reads it to its end, however short the reply TTL.

``--reply-ttl-s`` says how long an ended resumable reply can still be found (resumed,
retrieved). A reader already sending it when it ended, whose client took its last events
slowly (a pause within the slow-client limits), found the log gone under it once the TTL
ran out, and ended the stream with ``expired``: its client lost the end of a reply it was
being sent, and the reply's finish with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import MemoryReplayStore, ReplayStore
from replystream.server.app import create_app
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.narrow_link import NarrowResponse, narrow
from tests.redis_server import redis_server

TTL_S = 1.0
PAUSE_S = 4.0  # the client takes nothing for this long: the reply ends, and its TTL runs out
# Far past the pause: only the TTL could cut this reader.
PATIENT = DeliveryPolicy(slow_client_s=120.0, slow_client_bytes=64 << 20)
TOKENS = 20


@contextlib.contextmanager
def store_of(kind: str, tmp_path: Path) -> Iterator[ReplayStore]:
    if kind == "memory":
        yield MemoryReplayStore(ttl_after_end_s=TTL_S)
        return
    with redis_server(tmp_path) as redis:
        yield RedisReplayStore(redis.url, ttl_after_end_s=TTL_S)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_reader_paused_past_the_reply_ttl_still_gets_the_end(kind: str, tmp_path: Path):
    # 20 tokens of 16 KB, made in a tenth of a second: far more than the narrow link holds.
    engine = fast_engine(reply_text=("y" * 16_000 + " ") * TOKENS, delay_ms=5.0, jitter_ms=0.0)
    with store_of(kind, tmp_path) as store:
        app = create_app(engine, ServerConfig(policy=PATIENT), store)
        app.on_response_prepare.append(narrow)  # the server's writes to this client soon wait
        async with running(app) as url:
            port = int(url.rsplit(":", 1)[1])
            body = b'{"prompt": "x", "resumable": true}'
            reader = await NarrowResponse.request(
                "127.0.0.1", port, "POST", "/v1/replies", body, {}
            )
            assert reader.status == 200
            await asyncio.sleep(PAUSE_S)
            reader.widen()
            whole = bytearray()
            async with asyncio.timeout(60):
                while chunk := await reader.read():
                    whole += chunk
            await reader.close()
    assert b"expired" not in whole[-300:]
    assert whole.count(b"event: token\n") == TOKENS
    assert whole.endswith(b'event: done\nid: 23\ndata: {"finish_reason": "stop"}\n\n')
