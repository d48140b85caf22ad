"""The relay benchmark's upstream (``benchmarks/relay/upstream_server.py``) keeps its schedule.

Every relay figure is set against this server: a reply it leaves unfinished is a stall the
relay would be blamed for. Run as the benchmark runs it, a real process on a loopback port.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

UPSTREAM = Path(__file__).resolve().parents[1] / "benchmarks" / "relay" / "upstream_server.py"
BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture
async def upstream_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    chunks, interval_ms = request.param
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(UPSTREAM),
        "--port",
        "0",
        "--chunks",
        str(chunks),
        "--interval-ms",
        str(interval_ms),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        found = re.search(rb"listening on (http://\S+)", line)
        assert found is not None, line
        yield found.group(1).decode()
    finally:
        process.kill()
        await process.wait()


async def _reply(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.post(f"{url}/v1/chat/completions", json=BODY) as response:
        assert response.status == 200
        return await asyncio.wait_for(response.read(), 10)


@pytest.mark.parametrize("upstream_url", [(40, 1)], indirect=True)
async def test_chunks_a_slot_apart_all_arrive(upstream_url: str) -> None:
    """An interval of one timer slot puts each next chunk in a slot already due as the tick
    writes the one before: every chunk of every reply still comes, on one kept-alive
    connection one reply after another and on several at once."""
    async with aiohttp.ClientSession() as session:
        for _ in range(6):
            body = await _reply(session, upstream_url)
            assert body.count(b"zq") == 40
            assert body.endswith(b"data: [DONE]\n\n")
        together = await asyncio.gather(*(_reply(session, upstream_url) for _ in range(8)))
    assert [body.count(b"zq") for body in together] == [40] * 8
