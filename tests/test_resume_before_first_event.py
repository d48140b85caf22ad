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

from replystream.delivery.replay import MemoryReplayStore, ReplyInfo
from replystream.server import create_app, running
from replystream.server.responses_stored import FIRST_EVENT_WAIT_S
from replystream.sse import EventParser
from tests.conftest import fast_engine
from tests.processes import replica, start_server, stop
from tests.rawhttp import raw_request
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


class _DeletedAfterALook(MemoryReplayStore):
    """A store whose reply is deleted right after its second look at the reply (a resume's
    first look finds it; its second tells it has a dialect stored, so no event is waited
    for): a DELETE from another connection landing between a resume's reads."""

    looks = 0

    async def info(self, reply_id: str) -> ReplyInfo | None:
        found = await super().info(reply_id)
        self.looks += 1
        if self.looks == 2:
            await self.delete(reply_id)
        return found


async def test_a_reply_deleted_between_a_resumes_reads_is_not_followed_in_our_dialect():
    # Its log held no event yet, and its dialect (stored with it) was seen; deleted before
    # the notices were chosen, its dialect could not be told, and the resume began a stream
    # in ours whose deletion notice a Responses client cannot read. It is a 404 now.
    store = _DeletedAfterALook()
    app = create_app(fast_engine(), store=store)
    async with running(app) as url:
        await store.create(ReplyInfo("r4", dialect="responses"))
        answer = await raw_request(f"{url}/v1/replies/r4/stream")
        async with asyncio.timeout(30):
            body = await answer.read_body()
    assert answer.status == 404, body
    assert json.loads(body)["error"]["code"] == "reply_not_found"
