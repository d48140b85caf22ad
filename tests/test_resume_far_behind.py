"""A reader that resumes, or joins, further behind than the byte limit may read what it asked for.

``--slow-client-bytes`` cuts a reader that falls behind, not one that starts behind: a reader
is held to the limit plus the smallest backlog it has had, so a resume from the first event of
a reply longer than the limit reads it all, on the memory store and on Redis (a reply made on
this replica or on another), over the native route and the Responses one. Such a reader that
then stops reading is still cut, by time or by falling more than the limit further behind; and
a reader cut for byte lag that resumes reads the reply to its end. Real servers on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from replystream.client import ResumingReader
from replystream.client.resume import Backoff
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.engine.base import Engine
from replystream.server.app import create_app
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.rawhttp import RawResponse, raw_request
from tests.redis_server import redis_server
from tests.scripted_engine import GroupedPushEngine

LIMIT = 64 << 10
STORES = ["memory", "redis"]
# Only the byte limit can cut a reader within a test, unless a test sets a short stall limit.
BYTES_ONLY = DeliveryPolicy(slow_client_bytes=LIMIT, slow_client_s=600.0)
RESUMABLE = b'{"prompt": "x", "resumable": true}'
TOKEN = 4000  # bytes of text per token: a reply of 200 is more than 12 times the limit


def long_reply_engine(tokens: int = 200, size: int = TOKEN) -> GroupedPushEngine:
    """A reply of ``tokens`` tokens of ``size`` bytes, all logged at once."""
    return GroupedPushEngine(["y" * size] * tokens, group=tokens)


@contextlib.contextmanager
def stores(kind: str, tmp_path: Path) -> Iterator[list[RedisReplayStore | None]]:
    """Two replicas' stores: both memory (each its own), or one Redis shared by both."""
    if kind == "memory":
        yield [None, None]
        return
    with redis_server(tmp_path) as redis:
        yield [RedisReplayStore(redis.url, max_entries=10_000) for _ in range(2)]


@contextlib.asynccontextmanager
async def serving(
    engine: Engine, policy: DeliveryPolicy, store: RedisReplayStore | None
) -> AsyncIterator[str]:
    app: web.Application = create_app(engine, ServerConfig(policy=policy), store)
    async with running(app) as url:
        yield url


async def finished_reply(url: str) -> tuple[str, bytes]:
    """Start a resumable reply and read it whole: its id and its body."""
    first = await raw_request(f"{url}/v1/replies", "POST", RESUMABLE)
    assert first.status == 200
    return first.headers["x-reply-id"], await first.read_body()


def after_event(body: bytes, seq: int) -> bytes:
    """The SSE bytes of ``body`` from the event numbered ``seq + 1`` on."""
    return body[body.rindex(b"event: ", 0, body.index(f"\nid: {seq + 1}\n".encode())) :]


@contextlib.asynccontextmanager
async def reading_along(url: str, body: bytes, at_least: int) -> AsyncIterator[RawBody]:
    """POST a reply and read it as it comes until ``at_least`` bytes are in; then yield, and
    read the rest meanwhile (its whole body: the ``RawBody``'s ``result()``)."""
    async with aiohttp.ClientSession() as http:
        headers = {"Content-Type": "application/json"}
        async with http.post(url, data=body, headers=headers) as response:
            assert response.status == 200
            seen = bytearray()
            async with asyncio.timeout(30):
                while len(seen) < at_least:
                    seen += await response.content.read(65536)
            rest = asyncio.ensure_future(response.content.read())
            try:
                yield RawBody(response.headers["x-reply-id"], seen, rest)
                async with asyncio.timeout(60):
                    await rest
            finally:
                rest.cancel()


class RawBody:
    def __init__(self, reply_id: str, seen: bytearray, rest: asyncio.Future[bytes]) -> None:
        self.reply_id = reply_id
        self._seen = seen
        self._rest = rest

    async def result(self) -> bytes:
        async with asyncio.timeout(60):
            return bytes(self._seen) + await self._rest


async def stalled_request(url: str, headers: dict[str, str]) -> RawResponse:
    """A GET on a socket with a small receive buffer, its head read: the caller then reads
    nothing for as long as it likes, and the server's writes soon stop draining."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    lines = [f"GET {parts.path} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += ["Connection: close", *(f"{name}: {value}" for name, value in headers.items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    response = RawResponse(reader, writer)
    await response.read_head()
    assert response.status == 200
    return response


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_resume_from_the_first_event_reads_a_reply_longer_than_the_byte_limit(
    store_kind, tmp_path
):
    with stores(store_kind, tmp_path) as (store, _):
        async with serving(long_reply_engine(), BYTES_ONLY, store) as url:
            reply_id, whole = await finished_reply(url)
            resumed = await raw_request(
                f"{url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
            )
            async with asyncio.timeout(30):
                rest = await resumed.read_body()
    assert len(whole) > 10 * LIMIT and whole.endswith(b'data: {"finish_reason": "stop"}\n\n')
    assert rest == after_event(whole, 1)  # every event after the first, and nothing else


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_response_streamed_from_its_first_event_reads_to_its_end(store_kind, tmp_path):
    with stores(store_kind, tmp_path) as (store, _):
        async with serving(long_reply_engine(), BYTES_ONLY, store) as url:
            async with aiohttp.ClientSession() as http:
                body = {"input": "x", "background": True}
                async with http.post(f"{url}/v1/responses", json=body) as created:
                    assert created.status == 200, await created.text()
                    response_id = (await created.json())["id"]
                path = f"{url}/v1/responses/{response_id}"
                for _ in range(200):  # a background response runs unread: wait for its end
                    async with http.get(path) as got:
                        if (await got.json())["status"] == "completed":
                            break
                    await asyncio.sleep(0.05)
                query = {"stream": "true", "starting_after": "0"}  # response.created's
                async with asyncio.timeout(30), http.get(path, params=query) as streamed:
                    raw = await streamed.read()
    ids = [int(n) for n in re.findall(rb"^id: (\d+)$", raw, re.MULTILINE)]
    types = re.findall(rb"^event: (\S+)$", raw, re.MULTILINE)
    assert len(raw) > 10 * LIMIT and b"slow_client" not in raw
    assert ids == list(range(2, len(ids) + 2))  # every event after the first, once
    assert types[0] == b"response.queued" and types[-1] == b"response.completed"


async def test_a_late_reader_on_another_replica_reads_a_live_reply_to_its_end(tmp_path):
    # The reply is made on A and read there as it goes; once A has logged many times the limit,
    # a reader joins it from the start on B, whose cursor reads Redis (``RemoteCursor``).
    # 8 ms a token: the limit is 16 tokens, so B may be 130 ms behind A's log past where it
    # joined (its Redis reads, on a busy machine) and still be a reader that keeps up.
    engine = fast_engine(reply_text=("z" * TOKEN + " ") * 400, delay_ms=8.0, jitter_ms=0.0)
    with stores("redis", tmp_path) as (store_a, store_b):
        async with (
            serving(engine, BYTES_ONLY, store_a) as url_a,
            serving(fast_engine(), BYTES_ONLY, store_b) as url_b,
        ):
            async with reading_along(f"{url_a}/v1/replies", RESUMABLE, 8 * LIMIT) as first:
                late = await raw_request(f"{url_b}/v1/replies/{first.reply_id}/stream")
                async with asyncio.timeout(30):
                    joined = await late.read_body()
                whole = await first.result()
    assert joined == whole  # every event from the first, and nothing else
    assert whole.endswith(b'data: {"finish_reason": "stop"}\n\n')


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_reader_resumed_far_behind_that_stops_reading_is_cut_by_time(store_kind, tmp_path):
    # The reply has ended, so its log grows no more: only the stall limit can cut this reader.
    policy = DeliveryPolicy(slow_client_bytes=LIMIT, slow_client_s=1.0)
    with stores(store_kind, tmp_path) as (store, _):
        engine = long_reply_engine(tokens=160, size=64 << 10)  # 10 MB: more than sockets hold
        async with serving(engine, policy, store) as url:
            reply_id, whole = await finished_reply(url)
            stalled = await stalled_request(
                f"{url}/v1/replies/{reply_id}/stream", {"Last-Event-ID": "1"}
            )
            await asyncio.sleep(2.5)
            async with asyncio.timeout(30):
                got = await stalled.read_body()
    assert got.startswith(after_event(whole, 1)[:100_000])  # its replay went out until it stalled
    assert re.search(rb"event: error\ndata: .*did not drain.*slow_client", got[-300:])


@pytest.mark.parametrize("where", ["memory", "redis", "redis, another replica"])
async def test_a_reader_resumed_far_behind_a_live_reply_that_stops_reading_is_cut_for_bytes(
    where, tmp_path
):
    # A reply still being made (8 KB a token, 2 ms apart) and read as it goes; a reader resumes
    # it from its first event once it is many times the limit long (on the replica making it,
    # or on another: its cursor then measures its lag in Redis), and reads nothing more.
    engine = fast_engine(reply_text=("z" * 8000 + " ") * 3000, delay_ms=2.0, jitter_ms=0.0)
    with stores(where.split(",")[0], tmp_path) as (store_a, store_b):
        async with (
            serving(engine, BYTES_ONLY, store_a) as url_a,
            serving(fast_engine(), BYTES_ONLY, store_b) as url_b,
        ):
            url = url_b if "another" in where else url_a
            async with reading_along(f"{url_a}/v1/replies", RESUMABLE, 16 * LIMIT) as first:
                stalled = await stalled_request(
                    f"{url}/v1/replies/{first.reply_id}/stream", {"Last-Event-ID": "1"}
                )
                await asyncio.sleep(4.0)  # the reply goes on growing meanwhile
                async with asyncio.timeout(60):
                    got = await stalled.read_body()
                whole = await first.result()
    assert got.count(b"event: token\n") > (16 * LIMIT) // 8000  # its backlog went out
    assert re.search(rb"event: error\ndata: .*bytes behind.*slow_client", got[-300:])
    assert whole.endswith(b'data: {"finish_reason": "stop"}\n\n')  # the reply itself went on


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_reader_cut_for_byte_lag_resumes_and_reads_the_reply_to_its_end(
    store_kind, tmp_path, caplog
):
    # The whole reply is logged at once: the first connection cannot take it and is cut for
    # byte lag; the resume starts as far behind as that cut left it.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    engine = long_reply_engine(tokens=160, size=64 << 10)
    with stores(store_kind, tmp_path) as (store, _):
        async with serving(engine, BYTES_ONLY, store) as url:
            reader = ResumingReader(
                f"{url}/v1/replies",
                json_body={"prompt": "x", "resumable": True},
                backoff=Backoff(base_s=0.01, cap_s=0.05, max_attempts=5),
            )
            text = []
            async with asyncio.timeout(60):
                async for event in reader.events():
                    if event.type == "token":
                        text.append(json.loads(event.data)["text"])
    cuts = [r.getMessage() for r in caplog.records if "cut: " in r.getMessage()]
    assert cuts and all("bytes behind" in cut for cut in cuts)
    assert reader.reconnects == len(cuts) >= 1
    assert "".join(text) == "y" * (64 << 10) * 160
