"""``doctor --direct`` advises from what each path measured, through the real command.

Two real HTTP servers on loopback sockets stand for the two paths: one streams a reply
evenly, one holds it and writes it in bursts after silences, one answers 503. The command
runs as a subprocess, as a CI job runs it, and its comparison is read from ``--json``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from replystream.server import running

EVENTS = 40
ROUTE = "/v1/chat/completions"


def chunk(word: str) -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def stream_app(per_write: int, pause_s: float) -> web.Application:
    """An OpenAI-shaped stream of ``EVENTS`` events, ``per_write`` in each write, with
    ``pause_s`` between writes: 1 is a stream, 10 a hop that holds and releases."""

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, EVENTS, per_write):
            await response.write(b"".join(chunk(f"w{i} ") for i in range(start, start + per_write)))
            await asyncio.sleep(pause_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post(ROUTE, completions)
    return app


def unavailable_app() -> web.Application:
    async def unavailable(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    app = web.Application()
    app.router.add_post(ROUTE, unavailable)
    return app


@asynccontextmanager
async def paths(direct: web.Application, proxied: web.Application) -> AsyncIterator[list[str]]:
    async with running(direct) as direct_url, running(proxied) as proxied_url:
        yield [proxied_url + ROUTE, "--direct", direct_url + ROUTE]


async def doctor(argv: list[str]) -> tuple[int, dict[str, object]]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "replystream", "doctor", *argv, "--model", "m", "--json"),
        stdout=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    assert process.returncode is not None
    result: dict[str, object] = json.loads(out)
    return process.returncode, result


def streaming() -> web.Application:
    return stream_app(per_write=1, pause_s=0.003)


def bursty() -> web.Application:
    return stream_app(per_write=10, pause_s=0.05)


async def test_a_bursty_direct_path_is_not_blamed_on_the_app_when_the_proxied_path_streams():
    async with paths(direct=bursty(), proxied=streaming()) as argv:
        code, result = await doctor(argv)
    direct = result["direct"]
    assert isinstance(direct, dict)
    assert (result["verdict"], direct["verdict"]) == ("streaming", "bursty"), result
    assert code == 0
    comparison = str(result["comparison"])
    assert "fix the app" not in comparison, comparison
    assert comparison.startswith("the proxied path streams"), comparison


async def test_a_failed_direct_path_is_not_blamed_on_the_app_when_the_proxied_path_streams():
    async with paths(direct=unavailable_app(), proxied=streaming()) as argv:
        code, result = await doctor(argv)
    assert code == 0
    comparison = str(result["comparison"])
    assert "fix the app" not in comparison, comparison
    assert "the direct path failed (no complete reply: HTTP 503" in comparison, comparison


async def test_a_failed_proxied_path_is_not_said_to_hold_a_stream():
    async with paths(direct=streaming(), proxied=unavailable_app()) as argv:
        code, result = await doctor(argv)
    assert code == 1
    comparison = str(result["comparison"])
    assert "holds the stream" not in comparison, comparison
    assert "the app streams but the proxied path failed" in comparison, comparison


async def test_a_bursty_app_behind_a_bursty_proxy_is_the_app_to_fix():
    async with paths(direct=bursty(), proxied=bursty()) as argv:
        code, result = await doctor(argv)
    assert code == 1
    assert "the app itself is already bursty" in str(result["comparison"])


def rate_limited_app() -> web.Application:
    """Refuses every request as OpenAI's API does when a key is over its limit."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"message": "Rate limit reached", "type": "requests", "code": "rate_limit"}
        return web.json_response({"error": error}, status=429, headers={"Retry-After": "20"})

    app = web.Application()
    app.router.add_post(ROUTE, refuse)
    return app


async def test_a_refused_request_is_failed_with_the_wait_the_server_asked_for():
    async with running(rate_limited_app()) as url:
        code, result = await doctor([url + ROUTE])
    assert code == 1 and result["verdict"] == "failed"
    assert "HTTP 429: rate_limit: Rate limit reached" in str(result["reason"])
    headers = result["headers"]
    assert isinstance(headers, dict) and headers["retry-after"] == "20"
