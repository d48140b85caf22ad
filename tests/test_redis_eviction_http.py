"""What a client resuming on another replica is told when Redis evicted a reply's keys.

Two ``replystream serve`` replicas share one real Redis; a reply made on one ends, then one of
its keys is dropped (``DEL``, as a ``maxmemory`` Redis evicts: whole keys, any of them) and
the reply is resumed on the other: a stream evicted after its end gives a ``gap`` event for
what is missing and a properly ended stream (not ``generator_lost``), metadata evicted behind
its log answers ``410 reply_evicted`` in our error shape, and a reply with nothing left
answers ``404 reply_not_found``. The store-level cases, and a real small-``maxmemory`` Redis
under each eviction policy, are in ``tests/test_redis_eviction.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import redis.asyncio as aioredis

from replystream.client.transport import http_request
from replystream.sse import EventParser
from tests.processes import replica
from tests.redis_server import redis_server
from tests.sse_client import Received, post_events

ENGINE = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0", "--tokens", "20")
PREFIX = "replystream:reply:"


async def resume(url: str, after: int) -> tuple[Received, bytes]:
    """GET a reply's stream after event ``after``: its events, or its error body."""
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
    async with http_request(url, headers=headers) as response:
        got = Received(response.status, response.headers)
        parser, raw = EventParser(), bytearray()
        async for chunk in response:
            raw += chunk.data
            got.events.extend(parser.feed(chunk.data))
        return got, bytes(raw)


async def written_through(client: aioredis.Redis, reply_id: str) -> None:
    """Wait until the producer's last write (its ending, which the write script puts in the
    metadata with the stream's terminal entry) is in Redis. A local reader gets ``done``
    from the producing replica's own copy, a moment before its batched writes land: a key
    deleted before then would be made again by them."""
    meta = f"{PREFIX}{{{reply_id}}}:meta"
    async with asyncio.timeout(10):
        while not await client.hexists(meta, "end"):  # noqa: ASYNC110  (another process writes it)
            await asyncio.sleep(0.01)


async def test_a_resume_of_an_evicted_reply_is_told_what_is_gone(tmp_path: Path):
    with redis_server(tmp_path) as server:
        client = aioredis.Redis.from_url(server.url)
        args = (*ENGINE, "--redis-url", server.url)
        async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
            made = {}
            for name in ("stream", "meta", "all"):
                reply = await post_events(f"{a_url}/v1/replies", {"prompt": "x", "resumable": True})
                assert reply.types[-1] == "done"
                made[name] = reply.of_type("reply")[0]["reply_id"]
                await written_through(client, made[name])
            await client.delete(f"{PREFIX}{{{made['stream']}}}")
            await client.delete(f"{PREFIX}{{{made['meta']}}}:meta")
            await client.delete(f"{PREFIX}{{{made['all']}}}", f"{PREFIX}{{{made['all']}}}:meta")

            told, _ = await resume(f"{b_url}/v1/replies/{made['stream']}/stream", after=3)
            assert told.status == 200 and told.types == ["gap"], told.types
            gap = json.loads(told.events[0].data)
            assert gap["lost_from"] == 4 and gap["lost_to"] > 20  # its tokens and its done
            # The producing replica still holds its copy: there, the text is whole.
            whole, _ = await resume(f"{a_url}/v1/replies/{made['stream']}/stream", after=0)
            assert whole.types[-1] == "done" and "gap" not in whole.types

            gone, body = await resume(f"{b_url}/v1/replies/{made['meta']}/stream", after=3)
            error = json.loads(body)["error"]
            assert gone.status == 410, body
            assert (error["code"], error["type"]) == ("reply_evicted", "invalid_request_error")
            assert "evicted" in error["message"] and error["param"] == "reply_id"

            unknown, body = await resume(f"{b_url}/v1/replies/{made['all']}/stream", after=3)
            assert unknown.status == 404 and json.loads(body)["error"]["code"] == "reply_not_found"
        await client.aclose()
