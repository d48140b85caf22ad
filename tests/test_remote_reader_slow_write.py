"""A reader on another replica whose socket is slow to drain still keeps its reply going.

A reply's producer keeps a detached reply (or one whose disconnect policy is ``cancel``)
going while a reader on another replica follows it: that replica leaves a mark in Redis,
refreshed every heartbeat for each reply a reader there is reading. A reader whose client
has stopped taking bytes for a while (a phone between cells, a browser tab in the
background) waits on its socket, within the slow-client limits, and reads nothing from
Redis meanwhile. Its mark lapsed a few seconds into such a wait, and the producer then
stopped the reply (``detach_expired``, or ``client_gone``) under a reader that was still there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.server.app import create_app
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.narrow_link import NarrowResponse, narrow
from tests.rawhttp import raw_request
from tests.redis_server import redis_server

TOKENS = 40
# A token every 300 ms: the reply lasts 12 s, well past the reader's pause below.
ENGINE = {"reply_text": ("y" * 16_000 + " ") * TOKENS, "delay_ms": 300.0, "jitter_ms": 0.0}
# Far past the reader's pause: only a lapsed mark can stop the reply.
PATIENT = DeliveryPolicy(slow_client_s=120.0, slow_client_bytes=64 << 20)
PAUSE_S = 7.0  # more than twice a reader mark's life (3 s) and the producer's look (1.5 s)


async def read_to_end(reader: NarrowResponse) -> bytes:
    body = bytearray()
    while chunk := await reader.read():
        body += chunk
    return bytes(body)


@pytest.mark.parametrize("disconnect", ["detach", "cancel"])
async def test_a_remote_reader_whose_socket_stalls_keeps_its_reply_going(
    disconnect: str, tmp_path: Path
):
    with redis_server(tmp_path) as redis:
        a = create_app(
            fast_engine(**ENGINE),
            ServerConfig(policy=PATIENT, detach_grace_s=0.5),
            RedisReplayStore(redis.url),
        )
        b = create_app(fast_engine(), ServerConfig(policy=PATIENT), RedisReplayStore(redis.url))
        b.on_response_prepare.append(narrow)  # B's writes to its reader soon wait
        async with running(a) as url_a, running(b) as url_b:
            body = f'{{"prompt": "x", "resumable": true, "disconnect": "{disconnect}"}}'
            first = await raw_request(f"{url_a}/v1/replies", "POST", body.encode())
            assert first.status == 200
            reply_id = first.headers["x-reply-id"]
            where = urlsplit(url_b)
            assert where.hostname is not None and where.port is not None
            late = await NarrowResponse.request(
                where.hostname, where.port, "GET", f"/v1/replies/{reply_id}/stream", b"", {}
            )
            assert late.status == 200
            await asyncio.sleep(1.5)  # B's reader has joined, and left its mark
            await first.aclose()  # the reply's only reader now is B's
            await asyncio.sleep(PAUSE_S)  # B's client takes nothing: its reader's write waits
            late.widen()
            async with asyncio.timeout(60):
                whole = await read_to_end(late)
            await late.close()
    assert b"reply stopped" not in whole[-600:]
    assert whole.endswith(b"event: done\ndata: {}\n\n") or b"finish_reason" in whole[-400:]
