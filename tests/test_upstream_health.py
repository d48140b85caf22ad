"""The relay as real processes: its health follows its upstream's, and an upstream that dies
mid-reply is reported in our words.

The relay is ``replystream serve --engine upstream:URL``; the upstream is
``replystream serve --engine simulated``, started (and killed) by the test.
"""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
from aiohttp import web

from replystream.server import running
from replystream.sse import Event, EventParser
from tests.processes import replica, start_server, stop
from tests.rawhttp import raw_request
from tests.services import free_port


async def health(url: str) -> tuple[int, dict[str, str]]:
    response = await raw_request(f"{url}/healthz")
    body: dict[str, str] = json.loads(await response.read_body())
    return response.status, body


async def test_healthz_is_503_with_the_reason_until_the_upstream_answers():
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    async with replica("--engine", f"upstream:{base}") as (_, relay):
        status, body = await health(relay)
        assert status == 503
        assert body == {
            "status": "unavailable",
            "engine": "upstream",
            "reason": f"cannot connect to the upstream at {base}: connection refused",
        }
        async with replica("--engine", "simulated", "--port", str(port)):
            # Asked again every few seconds: healthy soon after the upstream is.
            for _ in range(60):
                status, body = await health(relay)
                if status == 200:
                    break
                await asyncio.sleep(0.25)
            assert (status, body) == (200, {"status": "ok", "engine": "upstream"})


async def test_an_upstream_that_redirects_is_reported_with_where_it_points_not_followed():
    """An http:// upstream whose server sends every request to https:// (a common front):
    the relay follows no redirect (a 301 would lose a request's body, and another origin
    would be sent the upstream's key). Its probe once followed it, calling the upstream
    healthy while every request failed 'answered 301'; both now say where it points."""

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMovedPermanently(f"https://models.example{request.path}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    async with (
        running(app) as upstream,
        replica("--engine", f"upstream:{upstream}/v1") as (_, relay),
    ):
        status, body = await health(relay)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{relay}/v1/chat/completions", json=chat) as response,
        ):
            answer = (response.status, (await response.json())["error"])
    advice = "and the relay follows no redirect: configure the URL it points to"
    assert status == 503 and body["reason"] == (
        f"the upstream at {upstream}/v1 answered 301: it redirects to "
        f"https://models.example/v1/models, {advice}"
    ), body
    assert answer[0] == 502 and answer[1]["message"] == (
        f"the upstream at {upstream}/v1 answered 301: it redirects to "
        f"https://models.example/v1/chat/completions, {advice}"
    ), answer


async def test_an_upstream_killed_mid_reply_is_reported_in_our_words():
    upstream, upstream_url = await start_server(
        "--engine", "simulated", "--delay-ms", "50", "--tokens", "400"
    )
    try:
        async with (
            replica("--engine", f"upstream:{upstream_url}/v1") as (_, relay),
            aiohttp.ClientSession() as session,
        ):
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            parser = EventParser()
            events: list[Event] = []
            async with (
                asyncio.timeout(30),
                session.post(f"{relay}/v1/chat/completions", json=chat) as response,
            ):
                assert response.status == 200
                killed = False
                async for data in response.content.iter_any():
                    events += parser.feed(data)
                    # A few tokens relayed (one read may bring several): the reply is under way.
                    if len(events) >= 3 and not killed:
                        upstream.send_signal(signal.SIGKILL)
                        killed = True
            errors = [json.loads(e.data)["error"] for e in events if e.type == "error"]
            assert len(errors) == 1, events
            assert errors[0]["code"] == "upstream_disconnected"
            assert errors[0]["message"] == (
                f"the upstream at {upstream_url}/v1 closed the connection mid-reply"
            )
    finally:
        await stop(upstream)


async def test_probes_keep_one_connection_alive_of_their_own():
    """Probes go over the relay's own client on a connection of their own, kept alive from
    one probe to the next; the relay's connections (its metric) are its requests'."""
    peers: list[int] = []

    async def models(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with running(app) as upstream:
        args = ("--engine", f"upstream:{upstream}/v1", "--upstream-health-s", "0.2")
        async with replica(*args) as (_, relay):
            for _ in range(200):
                if len(peers) >= 9:
                    break
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{relay}/metrics") as response:
                    metrics = await response.text()
    # One connection, kept alive (a probe that timed out on a busy machine closes its own, so
    # a few may be).
    assert len(peers) >= 9 and len(set(peers)) * 3 <= len(peers), peers
    opened = f'replystream_upstream_connections_opened{{upstream="{upstream}/v1"}} 0.0'
    assert opened in metrics, [m for m in metrics.splitlines() if "opened" in m]


async def test_a_models_answer_cut_short_is_said_so():
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        writer.write(head + b'\r\n{"data": [')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    async with server, replica("--engine", f"upstream:{base}") as (_, relay):
        status, body = await health(relay)
    assert status == 503
    assert body["reason"] == f"the upstream at {base} closed the connection mid-answer", body


async def test_a_probe_path_the_upstream_lacks_is_told_as_the_flags_path_not_the_base():
    # The 404's advice was always "does the URL end in /v1?", though here the base URL is
    # right (requests are served) and the path, of the flag's own, is what is missing.
    async with (
        replica("--engine", "simulated") as (_, upstream),
        replica(
            "--engine",
            f"upstream:{upstream}/v1",
            "--upstream-health-path",
            "/healthz",
            "--upstream-health-s",
            "0.2",
        ) as (_, relay),
    ):
        for _ in range(40):
            status, body = await health(relay)
            if status == 503:
                break
            await asyncio.sleep(0.25)
    assert status == 503 and body["reason"] == (
        f"the upstream at {upstream}/v1 has no /healthz (404): the probe's path is asked "
        "after the base URL (--upstream-health-path)"
    ), body
