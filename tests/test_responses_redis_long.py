"""A response longer than one Redis read (1,000 events), retrieved whole on another replica.

Redis answers a read of a reply's log 1,000 entries at a time; ``GET /v1/responses/{id}``
(not streamed) must read on to the end, on a replica that did not produce the response
(which reads Redis, not its own copy). Two ``replystream serve`` processes share a real
redis-server on loopback.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from replystream.delivery.redis_reads import READ_BATCH
from tests.processes import replica
from tests.redis_server import redis_server

pytestmark = pytest.mark.slow

TOKENS = READ_BATCH + 300  # one delta event per token, and a few more around them


def fast(tokens: int, delay_ms: str) -> tuple[str, ...]:
    return (
        "--engine",
        "simulated",
        "--delay-ms",
        delay_ms,
        "--jitter-ms",
        "0",
        "--tokens",
        str(tokens),
    )


async def retrieve(http: aiohttp.ClientSession, url: str, response_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/responses/{response_id}") as got:
        assert got.status == 200, await got.text()
        body: dict[str, Any] = await got.json()
        return body


def text_of(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


async def count_events(http: aiohttp.ClientSession, url: str, response_id: str) -> int:
    """How many events the response's log holds (its stream, replayed from the start)."""
    query = {"stream": "true", "starting_after": "0"}
    async with http.get(f"{url}/v1/responses/{response_id}", params=query) as got:
        raw = await got.read()
    return raw.count(b"\nevent: ") + raw.startswith(b"event: ")


async def test_a_completed_response_of_more_than_one_read_is_retrieved_whole_elsewhere(
    tmp_path: Path,
):
    with redis_server(tmp_path) as redis:
        args = (*fast(TOKENS, "0"), "--redis-url", redis.url)
        async with (
            replica(*args) as (_, producer),
            replica(*args) as (_, other),
            aiohttp.ClientSession() as http,
        ):
            async with http.post(f"{producer}/v1/responses", json={"input": "x"}) as made:
                assert made.status == 200
                made_here = await made.json()
            assert made_here["status"] == "completed"
            assert await count_events(http, other, made_here["id"]) > READ_BATCH
            elsewhere = await retrieve(http, other, made_here["id"])
    assert elsewhere["status"] == "completed"
    assert text_of(elsewhere) == text_of(made_here) and len(text_of(made_here).split()) == TOKENS
    assert elsewhere == made_here


async def test_a_running_response_past_one_read_is_told_with_all_its_text_so_far(
    tmp_path: Path,
):
    with redis_server(tmp_path) as redis:
        args = (*fast(4 * READ_BATCH, "2"), "--redis-url", redis.url)
        async with (
            replica(*args) as (_, producer),
            replica(*args) as (_, other),
            aiohttp.ClientSession() as http,
        ):
            body = {"input": "x", "background": True}
            async with http.post(f"{producer}/v1/responses", json=body) as made:
                response_id = (await made.json())["id"]
            async with asyncio.timeout(60):
                while True:  # until the producer's own copy holds more than one read's worth
                    here = await retrieve(http, producer, response_id)
                    if len(text_of(here).split()) > READ_BATCH + 100:
                        break
                    await asyncio.sleep(0.2)
            elsewhere = await retrieve(http, other, response_id)
            final = await retrieve(http, producer, response_id)
            async with http.post(f"{producer}/v1/responses/{response_id}/cancel") as cancelled:
                assert cancelled.status == 200
    assert elsewhere["status"] == "in_progress"
    # Everything Redis held when asked: at least what the producer showed before, and a
    # prefix of the text it went on with.
    assert len(text_of(elsewhere)) >= len(text_of(here))
    assert text_of(final).startswith(text_of(elsewhere))
    print(
        json.dumps(
            {
                "words_here": len(text_of(here).split()),
                "words_elsewhere": len(text_of(elsewhere).split()),
            }
        )
    )
