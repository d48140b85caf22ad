"""What ``replystream_reply_log_gaps`` counts, on each of two replicas sharing one Redis.

A reader told that events it needed are lost (a native ``gap`` event, or the ``events_lost``
error that ends a Responses stream) is one gap, counted by the replica that told it. The
server's own reads of a log (to find the reply and its dialect before a resume begins, or to
answer a response's object, which its terminal event tells whole) tell nobody anything, and
count none: before, each resume of a trimmed log counted 2 (native) or 4 (Responses), and
every poll of a finished response's object one more.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from replystream.delivery.redis_store import RedisReplayStore
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine
from tests.redis_server import redis_server

KEPT = 20  # events each log keeps (Redis trims by whole nodes of 100): 250 tokens lose some


async def gaps(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as metrics:
        text = await metrics.text()
    prefix = 'replystream_reply_log_gaps{store="resumable"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


async def test_a_gap_told_to_one_reader_counts_once_where_it_was_told(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        engine = fast_engine(reply_text="word " * 300, delay_ms=0.2, jitter_ms=0.0)
        a = create_app(engine, ServerConfig(), RedisReplayStore(redis.url, max_entries=KEPT))
        b = create_app(fast_engine(), ServerConfig(), RedisReplayStore(redis.url, max_entries=KEPT))
        async with running(a) as a_url, running(b) as b_url, aiohttp.ClientSession() as http:
            made = {"prompt": "x", "max_tokens": 250, "resumable": True}
            async with http.post(f"{a_url}/v1/replies", json=made) as reply:
                reply_id = reply.headers["X-Reply-Id"]
                await reply.read()
            asked = {"input": "x", "max_output_tokens": 250, "stream": True}
            async with http.post(f"{a_url}/v1/responses", json=asked) as response:
                first = EventParser().feed(await response.read())[0]
                response_id = json.loads(first.data)["response"]["id"]

            told: dict[str, list[str]] = {}
            counted: dict[str, float] = {}
            # On B (a reply made elsewhere, read from Redis) and on A (its producer's copy).
            for name, url in (("b", b_url), ("a", a_url)):
                before = await gaps(http, url)
                resume = f"{url}/v1/replies/{reply_id}/stream"
                async with http.get(resume, headers={"Last-Event-ID": "3"}) as resumed:
                    native = EventParser().feed(await resumed.read())
                query = {"stream": "true", "starting_after": "2"}
                async with http.get(f"{url}/v1/responses/{response_id}", params=query) as again:
                    responses = EventParser().feed(await again.read())
                for _ in range(3):  # polled whole: its terminal event tells all of it
                    async with http.get(f"{url}/v1/responses/{response_id}") as whole:
                        assert whole.status == 200
                        assert (await whole.json())["status"] == "incomplete"
                told[name] = [
                    *(e.type for e in native if e.type == "gap"),
                    *(json.loads(e.data)["code"] for e in responses if e.type == "error"),
                ]
                counted[name] = await gaps(http, url) - before
    assert told == {"b": ["gap", "events_lost"], "a": ["gap", "events_lost"]}
    assert counted == {"b": 2, "a": 2}
