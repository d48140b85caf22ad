"""A reply resumed on another replica before its first event is logged is told what its
reader decides in its own dialect.

The Messages route logs nothing until the first token (``message_start`` waits for it), so a
resume then found no event to tell the dialect by, and spoke the native one: a lost
producer's ``event: error`` came as ``{"error": {"code": ...}}`` instead of Anthropic's error
object. The route stores its dialect with the reply (``ReplyInfo.dialect``), in Redis too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp

from replystream.server.responses_stored import FIRST_EVENT_WAIT_S
from replystream.sse import EventParser
from tests.processes import replica, start_server, stop
from tests.redis_server import redis_server

SLOW_START = ("--engine", "simulated", "--first-token-ms", "60000", "--resumable-by-default")
ASK = {
    "model": "simulated",
    "max_tokens": 20,
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}


async def test_a_messages_reply_resumed_before_its_first_token_is_told_in_anthropic_words(
    tmp_path: Path,
):
    with redis_server(tmp_path) as redis:
        a_proc, a_url = await start_server(*SLOW_START, "--redis-url", redis.url)
        try:
            async with (
                replica(*SLOW_START, "--redis-url", redis.url) as (_, b_url),
                aiohttp.ClientSession() as http,
            ):
                async with http.post(f"{a_url}/v1/messages", json=ASK) as started:
                    assert started.status == 200
                    reply_id = started.headers["X-Reply-Id"]
                    a_proc.send_signal(signal.SIGKILL)  # before its first token
                    await a_proc.wait()
                async with asyncio.timeout(20):
                    async with http.get(f"{b_url}/v1/replies/{reply_id}/stream") as resumed:
                        assert resumed.status == 200
                        events = EventParser().feed(await resumed.read())
        finally:
            await stop(a_proc)
    assert [e.type for e in events if e.type != "ping"] == ["error"]
    error = json.loads(events[-1].data)
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error" and error["error"]["code"] == "generator_lost"


async def test_a_messages_reply_resumed_before_its_first_token_is_answered_at_once():
    # Its dialect is stored with it, so nothing waits for a first event to tell it: the
    # response began only after a 2 s wait for one (its keep-alives later still).
    process, url = await start_server(*SLOW_START)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/messages", json=ASK) as started:
                assert started.status == 200
                reply_id = started.headers["X-Reply-Id"]
                began = time.monotonic()
                async with http.get(f"{url}/v1/replies/{reply_id}/stream") as resumed:
                    waited_s = time.monotonic() - began
                    assert resumed.status == 200
                    assert resumed.headers["Content-Type"].startswith("text/event-stream")
    finally:
        await stop(process)
    assert waited_s < FIRST_EVENT_WAIT_S - 0.2  # (it was answered after that wait, whole)
