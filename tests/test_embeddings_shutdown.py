"""``POST /v1/embeddings`` at shutdown: a relay process (SIGTERM) in front of a slow
embeddings upstream on a loopback port. A request in flight is a buffered reply: the grace
period waits for its answer, and one still coming after it gets a 503 ``shutdown`` in
OpenAI's shape, never a connection closed without a word; a request made once shutdown
has begun is refused so too."""

from __future__ import annotations

import asyncio
import signal

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
