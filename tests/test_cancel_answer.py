"""A cancel's answer says how the reply ended, when the cancel and the reply's own end meet.

``POST /v1/replies/{id}/cancel`` answers ``"cancel_requested": true`` only for a reply the
cancel stopped: a client told ``true`` takes its reply for cancelled. The reply here has
made its last token and its ending is decided (finished), but its engine stream is still
closing, so its log has no terminal entry yet: a cancel asked then, on its own replica or
on another one sharing Redis, comes too late to stop it, and must say so (``false``), as
every reader of the reply is told ``done``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from replystream.delivery.redis_store import RedisReplayStore
from replystream.engine.base import Delta, DeltaStream, GenerationRequest
from replystream.server import create_app, running
from replystream.server.context import MANAGER_KEY
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import wait_for
from tests.redis_server import redis_server
from tests.scripted_engine import ScriptedEngine

ASK = {"prompt": "hi", "resumable": True}


class _SlowToClose:
    """A pulled stream: its script, then its end; closing it waits for ``closed`` to be set
    (an engine freeing what it held for the request)."""

    def __init__(self, texts: tuple[str, ...], closing: asyncio.Event, closed: asyncio.Event):
        self._texts = list(texts)
        self._closing = closing
        self._closed = closed

    def __aiter__(self) -> _SlowToClose:
        return self

    async def __anext__(self) -> Delta:
        if not self._texts:
            raise StopAsyncIteration
        text = self._texts.pop(0)
        return Delta(text, 1, 0.0, None if self._texts else "stop")

    async def aclose(self) -> None:
        self._closing.set()
        await self._closed.wait()


class SlowToCloseEngine(ScriptedEngine):
    """Each reply's stream ends, then takes until the test says to close."""

    def __init__(self) -> None:
        super().__init__(("A ", "reply."))
        self.closing = asyncio.Event()
        self.closed = asyncio.Event()

    async def start(self, request: GenerationRequest) -> DeltaStream:
        return _SlowToClose(self._script, self.closing, self.closed)


async def last_event(http: aiohttp.ClientSession, url: str, reply_id: str) -> str | None:
    parser = EventParser()
    async with http.get(f"{url}/v1/replies/{reply_id}/stream") as response:
        events = parser.feed(await response.read())
    return events[-1].type if events else None


@asynccontextmanager
async def reply_closing(
    engine: SlowToCloseEngine, url: str, http: aiohttp.ClientSession
) -> AsyncIterator[str]:
    """A reply whose last token is made and whose stream is closing: its id."""
    async with http.post(f"{url}/v1/replies", json=ASK) as response:
        reply_id = response.headers["X-Reply-Id"]
        await engine.closing.wait()
        yield reply_id
        await response.read()


async def cancel(http: aiohttp.ClientSession, url: str, reply_id: str) -> bool:
    async with http.post(f"{url}/v1/replies/{reply_id}/cancel") as response:
        assert response.status == 200, await response.text()
        said: bool = (await response.json())["cancel_requested"]
        return said


async def test_a_cancel_that_meets_the_replys_end_on_its_replica_says_it_cancelled_nothing():
    engine = SlowToCloseEngine()
    app = create_app(engine)
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with reply_closing(engine, url, http) as reply_id:
            said = await cancel(http, url, reply_id)
            engine.closed.set()
        await wait_for(lambda: not app[MANAGER_KEY].replies)
        assert await last_event(http, url, reply_id) == "done"
        assert said is False


async def test_a_cancel_asked_on_another_replica_as_the_reply_ends_says_it_cancelled_nothing(
    tmp_path: Path,
):
    engine = SlowToCloseEngine()
    with redis_server(tmp_path) as redis:
        a = create_app(engine, ServerConfig(), RedisReplayStore(redis.url))
        b = create_app(SlowToCloseEngine(), ServerConfig(), RedisReplayStore(redis.url))
        async with running(a) as url_a, running(b) as url_b, aiohttp.ClientSession() as http:
            async with reply_closing(engine, url_a, http) as reply_id:
                asked = asyncio.create_task(cancel(http, url_b, reply_id))
                # The cancel reaches the producer, which has decided its ending already;
                # then its stream closes and it writes that ending.
                await asyncio.sleep(0.3)
                engine.closed.set()
                said = await asyncio.wait_for(asked, 10)
            for url in (url_a, url_b):
                assert await last_event(http, url, reply_id) == "done"
            assert said is False
            # Its log says so too: the terminal entry is the finish, on either replica.
            async with http.get(f"{url_b}/v1/replies/{reply_id}/stream") as response:
                data = EventParser().feed(await response.read())[-1].data
            assert json.loads(data) == {"finish_reason": "stop"}
