"""``POST /v1/embeddings`` at shutdown: a relay process (SIGTERM) in front of a slow
embeddings upstream on a loopback port. A request in flight is a buffered reply: the grace
period waits for its answer, and one still coming after it gets a 503 ``shutdown`` in
OpenAI's shape, never a connection closed without a word; a request made once shutdown
has begun is refused so too."""

from __future__ import annotations

import asyncio
import signal
from urllib.parse import urlsplit

import aiohttp

from replystream.server import running
from tests.processes import replica
from tests.test_upstream_embeddings import EmbeddingUpstream

BODY = {"model": "m", "input": "a text", "encoding_format": "float"}


async def _embed(url: str) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/embeddings", json=BODY) as response,
    ):
        return response.status, await response.json()


async def _in_flight_at_sigterm(slow_s: float, grace_s: float) -> tuple[int, dict[str, object]]:
    up = EmbeddingUpstream(["m"], mode="slow", slow_s=slow_s)
    async with (
        running(up.app()) as upstream,
        replica("--engine", f"upstream:{upstream}/v1", "--shutdown-grace-s", str(grace_s)) as (
            process,
            url,
        ),
    ):
        asked = asyncio.create_task(_embed(url))
        await asyncio.wait_for(up.requested.wait(), 10)
        process.send_signal(signal.SIGTERM)
        answer = await asyncio.wait_for(asked, 20)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    return answer


async def test_an_answer_within_the_grace_period_is_sent():
    status, body = await _in_flight_at_sigterm(slow_s=1.0, grace_s=5)
    assert status == 200, body
    assert body["model"] == "m"


async def test_an_answer_still_coming_after_the_grace_period_is_a_503():
    status, body = await _in_flight_at_sigterm(slow_s=30, grace_s=0.3)
    assert status == 503, body
    assert body["error"] == {
        "message": "the server is shutting down",
        "type": "server_error",
        "param": None,
        "code": "shutdown",
    }


async def test_a_request_once_shutdown_has_begun_is_refused():
    up = EmbeddingUpstream(["m"], mode="slow", slow_s=3)
    async with (
        running(up.app()) as upstream,
        replica("--engine", f"upstream:{upstream}/v1", "--shutdown-grace-s", "10") as (
            process,
            url,
        ),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session,
    ):
        async with session.get(f"{url}/healthz") as response:  # a connection kept alive
            assert response.status == 200
            await response.read()
        asked = asyncio.create_task(_embed(url))  # keeps the server draining
        await asyncio.wait_for(up.requested.wait(), 10)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        async with session.post(f"{url}/v1/embeddings", json=BODY) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "shutdown"
        assert (await asyncio.wait_for(asked, 20))[0] == 200
        assert await asyncio.wait_for(process.wait(), 15) == 0
    assert len(up.bodies) == 1  # the refused one never went upstream


async def test_a_reply_refused_at_shutdown_ends_its_kept_alive_connection():
    # The 503 comes on a connection kept alive from before: the connection ends with it, so
    # the client's retry makes a new connection (to a replica still serving) instead of
    # asking the stopping one again on the same socket until its grace ends.
    asks = {
        b"/v1/chat/completions": b'{"model": "simulated", "messages": [{"role": "user", '
        b'"content": "x"}]}',
        b"/v1/responses": b'{"model": "simulated", "input": "x"}',
    }
    serve = ("--engine", "simulated", "--delay-ms", "50", "--shutdown-grace-s", "10")
    async with replica(*serve) as (process, url):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        draining, draining_writer = await asyncio.open_connection(host, port)
        draining_writer.write(b"GET /stream?max_tokens=100 HTTP/1.1\r\nHost: x\r\n\r\n")
        await draining.readuntil(b"\r\n\r\n")  # a reply running: the server drains it
        kept = []
        for _ in asks:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readuntil(b"}")  # answered, and kept alive
            kept.append((reader, writer))
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        for (path, body), (reader, writer) in zip(asks.items(), kept, strict=True):
            writer.write(
                b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            assert head.startswith("http/1.1 503 ") and "connection: close\r\n" in head, head
            assert b'"shutdown"' in await asyncio.wait_for(reader.read(), 5)  # then its end
            writer.close()
        draining_writer.close()
