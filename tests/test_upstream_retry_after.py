"""``Retry-After`` through the relay: an upstream's wait keeps it out, the relay's own 503
says when an upstream may take a request again, and a caller's own rate limit passes its
wait on.

The upstreams are small aiohttp apps in this process on a loopback port (one app, each
upstream a path prefix), answering from a script: a 429 or 503 with a ``Retry-After`` of the
script's choosing, or a reply. The relay is ``create_app(UpstreamEngine(...))`` on another
loopback port, read by clients over real sockets. Both run in this process, so the time an
upstream saw a request and the relay's circuits read the same monotonic clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# An answer in a script: (status, Retry-After or None); a status of 200 streams a reply,
# "error" streams an error before any text.
Answer = tuple[int | str, str | None]
REPLY: Answer = (200, None)


def chunk(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ScriptedUpstream:
    """One upstream: its answers in order (then replies), and when each request came."""

    def __init__(self, name: str, *answers: Answer) -> None:
        self.name = name
        self.answers = list(answers)
        self.came: list[float] = []  # time.monotonic() of each chat request
        self.keys: list[str | None] = []  # the Authorization of each

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.came.append(time.monotonic())
        self.keys.append(request.headers.get("Authorization"))
        status, retry_after = self.answers.pop(0) if self.answers else REPLY
        if isinstance(status, int) and status != 200:
            headers = {} if retry_after is None else {"Retry-After": retry_after}
            error = {"error": {"message": "busy", "type": "server_error"}}
            return web.json_response(error, status=status, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if status == "error":  # before any text: the relay fails over
            await response.write(chunk({"error": {"message": "out of memory"}}))
            return response
        delta = {"index": 0, "delta": {"content": "hello"}, "finish_reason": None}
        done = {"index": 0, "delta": {}, "finish_reason": "stop"}
        await response.write(chunk({"choices": [delta]}) + chunk({"choices": [done]}))
        await response.write(b"data: [DONE]\n\n")
        return response


@asynccontextmanager
async def upstreams(*scripted: ScriptedUpstream) -> AsyncIterator[str]:
    """Serve every scripted upstream on one loopback port; yield its root URL."""
    by_name = {u.name: u for u in scripted}

    async def chat(request: web.Request) -> web.StreamResponse:
        return await by_name[request.match_info["name"]].chat(request)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/{name}/v1/chat/completions", chat)
    app.router.add_get("/{name}/v1/models", models)
    async with running(app) as url:
        yield url


@asynccontextmanager
async def relay(*scripted: ScriptedUpstream, **config: Any) -> AsyncIterator[str]:
    """The relay in front of ``scripted`` (in that order); yield its base URL."""
    async with upstreams(*scripted) as root:
        targets = tuple(
            UpstreamTarget(f"{root}/{u.name}/v1", **config.pop(u.name, {})) for u in scripted
        )
        engine = UpstreamEngine(UpstreamConfig(targets, **config))
        try:
            async with running(create_app(engine)) as url:
                yield url
        finally:
            await engine.aclose()


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None = None
) -> tuple[int, str | None, dict[str, Any]]:
    """Status, ``Retry-After`` and JSON body of one request (a streamed 200 read whole)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with session.post(url, json=body, headers=headers) as response:
        raw = await response.read()
        payload = json.loads(raw) if response.content_type == "application/json" else {}
        return response.status, response.headers.get("Retry-After"), payload


async def test_an_upstream_that_asked_for_time_gets_no_request_before_it_and_one_after():
    # Three failures in a row would open its circuit; one 503 with a wait does, for 2 s.
    busy, idle = ScriptedUpstream("busy", (503, "2")), ScriptedUpstream("idle")
    async with relay(busy, idle, failures=3) as url, aiohttp.ClientSession() as session:
        for _ in range(6):  # alternating between the two, but for the wait
            status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
            assert status == 200, body
            await asyncio.sleep(0.1)
        asked_until = busy.came[0] + 2.0
        await asyncio.sleep(max(0.0, asked_until - time.monotonic()))
        # The relay's wait runs from when it read the 503, a little after the upstream sent
        # it (more on a busy machine): requests until one goes there again.
        async with asyncio.timeout(10):
            while len(busy.came) < 2:
                status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
                assert status == 200, body
                await asyncio.sleep(0.05)
    # However long the first requests took on a busy machine: none went there inside the
    # wait, and one did after it.
    assert len(busy.came) >= 2 and all(t >= asked_until for t in busy.came[1:]), busy.came
    assert len(idle.came) >= 6


# Each dialect's route, and the body that asks it for a reply (streamed and buffered).
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
    ("/v1/messages", {**CHAT, "max_tokens": 10, "stream": True}),
    ("/v1/messages", {**CHAT, "max_tokens": 10}),
    ("/v1/replies", {"prompt": "hi"}),
]


async def test_the_relays_own_503_says_when_the_soonest_upstream_may_take_a_request():
    first, second = ScriptedUpstream("a", (503, "2")), ScriptedUpstream("b", (429, "5"))
    async with relay(first, second) as url, aiohttp.ClientSession() as session:
        status, retry_after, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        # Both were busy: the last one's 503, with the sooner of their waits.
        assert status == 503 and body["error"]["code"] == "upstream_overloaded", body
        assert retry_after == "2"
        for route, request in ROUTES:
            status, retry_after, body = await post(session, url + route, request)
            told_at = time.monotonic()
            # Anthropic's API says it with its own status, which its SDKs raise as
            # OverloadedError.
            assert status == (529 if route == "/v1/messages" else 503), (route, body)
            error = body["error"]
            assert error["code"] == "upstream_unavailable", (route, body)
            if route == "/v1/messages":
                assert body["type"] == "error" and error["type"] == "overloaded_error"
            assert retry_after in ("1", "2"), route  # what is left of the 2 s, not the 5
        assert len(first.came) == len(second.came) == 1
        await asyncio.sleep(max(0.0, told_at + int(retry_after) - time.monotonic()))
        status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 200, body  # told to wait so long, no longer: it was enough
    assert len(first.came) == 2


async def test_a_websocket_reply_refused_for_busy_upstreams_says_when_to_come_back():
    first, second = ScriptedUpstream("a", (503, "3")), ScriptedUpstream("b", (429, "9"))
    async with relay(first, second) as url, aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "r1", "prompt": "hi"})
            message = await ws.receive_json(timeout=10)
            assert message["type"] == "error" and message["id"] == "r1", message
            assert message["data"]["error"]["code"] == "upstream_overloaded", message
            assert message["data"]["retry_after"] == 3, message  # the sooner wait, as HTTP's
            await ws.send_json({"type": "reply", "id": "r2", "prompt": "hi"})
            message = await ws.receive_json(timeout=10)  # both out now: the relay's own 503
            assert message["data"]["error"]["code"] == "upstream_unavailable", message
            assert message["data"]["retry_after"] in (1, 2, 3), message
            await ws.send_json({"type": "reply", "id": "bad", "prompt": 5})
            message = await ws.receive_json(timeout=10)  # a refusal with no wait has none
            assert message["type"] == "error" and "retry_after" not in message["data"], message


async def test_a_wait_given_as_an_http_date_is_a_wait_too():
    then = datetime.now(UTC) + timedelta(seconds=3)
    busy = ScriptedUpstream("a", (503, format_datetime(then, usegmt=True)))
    async with relay(busy) as url, aiohttp.ClientSession() as session:
        status, retry_after, _ = await post(session, f"{url}/v1/chat/completions", CHAT)
        # A date names a whole second: the wait is 2 to 3 s.
        assert status == 503 and retry_after in ("2", "3")
        status, retry_after, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 503 and body["error"]["code"] == "upstream_unavailable"
        assert retry_after in ("1", "2", "3") and len(busy.came) == 1
        await asyncio.sleep(then.timestamp() - time.time())
        status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 200, body
    assert len(busy.came) == 2


@pytest.mark.parametrize(
    "value", ["soon", "-5", "1.5", "0", "Sun, 06 Nov 1994 08:49:37 GMT", "Sun, 32 Nov"]
)
async def test_a_wait_that_is_not_one_is_ignored(value: str):
    busy = ScriptedUpstream("a", (503, value), (503, value))
    async with relay(busy, failures=3) as url, aiohttp.ClientSession() as session:
        for _ in range(2):
            status, retry_after, body = await post(session, f"{url}/v1/chat/completions", CHAT)
            # Nothing keeps it out: it is asked again at once, and may be asked again now.
            assert status == 503 and body["error"]["code"] == "upstream_overloaded"
            assert retry_after == "1"
        status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 200, body
    assert len(busy.came) == 3


async def test_a_wait_longer_than_the_cooldown_keeps_the_upstream_out_for_the_cooldown():
    busy = ScriptedUpstream("a", (503, "86400"))
    async with relay(busy, cooldown_s=1.0) as url, aiohttp.ClientSession() as session:
        status, retry_after, _ = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 503 and retry_after == "1"
        await asyncio.sleep(1.0)
        status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 200, body
    assert len(busy.came) == 2


async def test_a_buffered_reply_whose_last_upstream_was_busy_says_when_to_come_back():
    # The first upstream answered, then failed before any text; the next one was busy. One
    # failure opens a circuit here: both are out for the 4 s cool-down, and the buffered
    # reply's 503 (its head sent after the first upstream's) says so.
    broken, busy = ScriptedUpstream("a", ("error", None)), ScriptedUpstream("b", (503, None))
    async with (
        relay(broken, busy, failures=1, cooldown_s=4.0) as url,
        aiohttp.ClientSession() as session,
    ):
        status, retry_after, body = await post(session, f"{url}/v1/chat/completions", CHAT)
    assert status == 503 and body["error"]["code"] == "upstream_overloaded", body
    assert retry_after == "4"
    assert len(broken.came) == len(busy.came) == 1


async def test_a_429_for_the_callers_own_key_passes_the_upstreams_wait_on_to_it():
    hosted = ScriptedUpstream("a", (429, "30"), (429, "Sun, 06 Nov 1994 08:49:37 GMT"))
    async with (
        relay(hosted, a={"pass_client_key": True}, failures=1) as url,
        aiohttp.ClientSession() as session,
    ):
        status, retry_after, body = await post(
            session, f"{url}/v1/chat/completions", CHAT, key="mallory"
        )
        assert status == 429 and body["error"]["code"] == "upstream_rate_limited", body
        assert retry_after == "30"
        status, retry_after, body = await post(
            session, f"{url}/v1/chat/completions", CHAT, key="mallory"
        )
        assert status == 429 and retry_after is None  # a date long past asks for no wait
        # Another caller's key is not that caller's quota: the upstream is not held out.
        status, _, body = await post(session, f"{url}/v1/chat/completions", CHAT, key="alice")
        assert status == 200, body
    assert hosted.keys == ["Bearer mallory", "Bearer mallory", "Bearer alice"]


async def test_healthz_says_when_the_first_circuit_lets_a_request_through():
    # The only upstream asked for 30 s (capped at the 20 s cool-down): /healthz is not
    # ready, and says so for about that long rather than a fixed guess.
    busy = ScriptedUpstream("busy", (503, "30"))
    async with relay(busy, cooldown_s=20.0) as url, aiohttp.ClientSession() as session:
        status, _, _ = await post(session, f"{url}/v1/chat/completions", CHAT)
        assert status == 503
        async with session.get(f"{url}/healthz") as response:
            assert response.status == 503
            wait = int(response.headers["Retry-After"])
    assert 15 <= wait <= 20
