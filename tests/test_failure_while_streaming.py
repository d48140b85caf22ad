"""Failures after a response began: each client is told in-band and its body (or socket) is
ended properly, over real sockets, real processes and a real Redis killed mid-reply."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replystream.delivery.replay import MemoryReplayStore, ReadResult
from replystream.server import create_app, serving
from tests.conftest import fast_engine
from tests.processes import replica, start_server
from tests.rawhttp import raw_request
from tests.redis_server import redis_server


async def test_a_handler_failing_after_its_response_began_gets_no_second_response():
    async def half_sent(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"partial\n")
        raise RuntimeError("injected")

    app = create_app(fast_engine())
    app.router.add_get("/half-sent", half_sent)
    async with serving(app) as server:
        response = await raw_request(f"{server.url}/half-sent")
        async with asyncio.timeout(10):
            rest = await response.reader.read()
        await response.aclose()
    assert response.status == 200
    assert b"HTTP/1.1" not in rest and b"internal_error" not in rest
    assert rest.startswith(b"8\r\npartial\n\r\n") and not rest.endswith(b"0\r\n\r\n")


async def test_a_failing_handlers_path_cannot_forge_log_lines(caplog: pytest.LogCaptureFixture):
    """A path's ``%0A`` and ``%0D`` are line breaks once decoded: the error line naming a
    failed request quotes its path, so no client can write a line of its own into the log."""

    async def failing(request: web.Request) -> web.StreamResponse:
        raise RuntimeError("injected")

    async def half_sent(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        raise RuntimeError("injected")

    forged = "%0D%0A2026-01-01%2000:00:00,000%20CRITICAL%20replystream.server%20forged"
    app = create_app(fast_engine())
    app.router.add_get("/failing/{tail:[\\s\\S]*}", failing)
    app.router.add_get("/half-sent/{tail:[\\s\\S]*}", half_sent)
    caplog.set_level(logging.ERROR, logger="replystream.server")
    async with serving(app) as server:
        for route in ("failing", "half-sent"):
            response = await raw_request(f"{server.url}/{route}/x{forged}")
            async with asyncio.timeout(10):
                await response.reader.read()
            await response.aclose()
    said = [r.getMessage() for r in caplog.records if r.name == "replystream.server"]
    assert len(said) == 2 and all("forged" in line for line in said), said
    assert not any("\n" in line or "\r" in line for line in said), said


async def ws_messages_until_closed(ws: aiohttp.ClientWebSocketResponse) -> list[Any]:
    """Every message until the server closes the socket."""
    messages = []
    async with asyncio.timeout(30):
        async for msg in ws:
            messages.append(json.loads(msg.data))
    return messages


async def test_sigterm_tells_each_websocket_reply_then_closes_with_1001_within_the_grace():
    grace_s = 1.0
    process, url = await start_server(
        *("--engine", "simulated", "--tokens", "1000", "--delay-ms", "30", "--jitter-ms", "0"),
        *("--shutdown-grace-s", str(grace_s)),
    )
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(f"{url}/v1/ws") as busy,
            http.ws_connect(f"{url}/v1/ws") as idle,
        ):
            for tag in ("a", "b"):
                await busy.send_json({"type": "reply", "id": tag, "prompt": "x"})
            while (await busy.receive_json())["type"] != "token":
                pass
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)  # within the grace: new replies are refused
            await idle.send_json({"type": "reply", "id": "late", "prompt": "x"})
            busy_messages, idle_messages = await asyncio.gather(
                ws_messages_until_closed(busy), ws_messages_until_closed(idle)
            )
            await asyncio.wait_for(process.wait(), 30)
            exited_after = time.monotonic() - signalled
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    for tag in ("a", "b"):
        last = [m for m in busy_messages if m["id"] == tag][-1]
        assert last["type"] == "error" and last["data"]["error"]["code"] == "shutdown"
    assert [m["data"]["error"]["code"] for m in idle_messages] == ["shutdown"]
    assert busy.close_code == 1001 and idle.close_code == 1001
    assert process.returncode == 0
    assert exited_after < grace_s + 4.0, exited_after  # not another grace, nor a close timeout


def last_event(body: bytes) -> Any:
    event = [e for e in body.split(b"\n\n") if e][-1]
    assert event.startswith(b"event: error\n"), event
    return json.loads(event.split(b"data: ", 1)[1])["error"]


async def test_redis_killed_mid_reply_ends_every_reader_on_both_replicas_in_band(tmp_path: Path):
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "400")
    with redis_server(tmp_path) as redis:
        args = (*slow, "--redis-url", redis.url, "--redis-failover-s", "1")
        async with (
            replica(*args) as (_, a_url),
            replica(*args) as (_, b_url),
            aiohttp.ClientSession() as http,
            http.ws_connect(f"{a_url}/v1/ws") as ws,
        ):
            body = b'{"prompt": "x", "resumable": true}'
            on_producer = await raw_request(f"{a_url}/v1/replies", "POST", body)
            reply_id = on_producer.headers["x-reply-id"]
            await ws.send_json({"type": "reply", "id": "w", "prompt": "x", "resumable": True})
            elsewhere = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
            # Every body is read to its end: a body cut without its last chunk fails here.
            bodies = asyncio.gather(on_producer.read_body(), elsewhere.read_body())
            await asyncio.sleep(1.0)  # both readers are following the live tail now
            assert redis.process is not None
            redis.process.kill()
            producer_body, remote_body = await asyncio.wait_for(bodies, 30)
            async with asyncio.timeout(30):
                ws_messages = [m async for m in ws_replies(ws)]
    for body in (producer_body, remote_body):
        assert body.count(b"event: token") >= 5
        error = last_event(body)
        assert error["code"] == "replay_store_unavailable"
        assert error["message"].startswith("the reply store is unavailable")
    assert ws_messages[-1]["type"] == "error"
    assert ws_messages[-1]["data"]["error"]["code"] == "replay_store_unavailable"


async def ws_replies(ws: aiohttp.ClientWebSocketResponse):
    """Messages of the socket's one reply, to its last."""
    while True:
        message = await ws.receive_json()
        yield message
        if message["type"] in ("done", "error", "moderated"):
            return


class StoreFailingOnRead(MemoryReplayStore):
    """A store with a bug: every read fails with something that is not StoreUnavailable."""

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        raise RuntimeError("injected")


async def test_a_reader_whose_store_fails_unexpectedly_ends_its_body_with_an_error_event():
    app = create_app(fast_engine(), store=StoreFailingOnRead())
    async with serving(app) as server:
        body = b'{"prompt": "x", "resumable": true}'
        response = await raw_request(f"{server.url}/v1/replies", "POST", body)
        async with asyncio.timeout(10):
            whole = await response.read_body()  # fails unless the body's last chunk came
    assert response.status == 200
    assert last_event(whole)["code"] == "internal_error"


async def test_a_redis_that_stops_answering_ends_every_reader_in_band_too(tmp_path: Path):
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "600")
    with redis_server(tmp_path) as redis:
        args = (*slow, "--redis-url", redis.url, "--redis-failover-s", "1")
        assert redis.process is not None
        async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
            body = b'{"prompt": "x", "resumable": true}'
            on_producer = await raw_request(f"{a_url}/v1/replies", "POST", body)
            reply_id = on_producer.headers["x-reply-id"]
            elsewhere = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
            bodies = asyncio.gather(on_producer.read_body(), elsewhere.read_body())
            await asyncio.sleep(1.0)
            redis.process.send_signal(signal.SIGSTOP)  # alive, connected, silent
            try:
                producer_body, remote_body = await asyncio.wait_for(bodies, 30)
            finally:
                redis.process.send_signal(signal.SIGCONT)
    for body in (producer_body, remote_body):
        assert body.count(b"event: token") >= 5
        assert last_event(body)["code"] == "replay_store_unavailable"
