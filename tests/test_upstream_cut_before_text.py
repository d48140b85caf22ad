"""An upstream that answers a stream's head and a keep-alive comment, then closes the connection,
over real aiohttp upstreams on loopback sockets and an ``UpstreamEngine`` served by
replystream: nothing of the reply came, so the words say so (not "mid-reply"), and the
request moves to the next upstream as any failure before the first text does."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


class HangsUpAfterKeepAlive(Upstream):
    """Sends a stream's head and one keep-alive comment, then closes the connection."""

    def __init__(self) -> None:
        super().__init__(["m"])
        self.base_url = ""  # as the relay names it: the host it asked for, and /v1

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.base_url = f"http://{request.host}/v1"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        await asyncio.sleep(0.05)  # the comment arrives on its own, before the close
        assert request.transport is not None
        request.transport.close()
        return response


async def test_a_hang_up_after_a_keep_alive_alone_says_no_reply_came():
    upstream = HangsUpAfterKeepAlive()
    async with relay([upstream]) as url:
        chat = await post_events(f"{url}/v1/chat/completions", CHAT)
        native = await post_events(f"{url}/v1/replies", {"prompt": "hi"})
    # The head had come: the chat route's error is in-band, after no text at all.
    [error] = [json.loads(e.data)["error"] for e in native.events if e.type == "error"]
    assert native.text == ""
    assert error["code"] == "upstream_disconnected"
    assert error["message"] == (
        f"the upstream at {upstream.base_url} closed the connection before sending any of the reply"
    )
    assert b"mid-reply" not in chat.raw and b"before sending any of the reply" in chat.raw


async def test_a_hang_up_after_a_keep_alive_alone_fails_over_to_the_next_upstream():
    hangs_up, steady = HangsUpAfterKeepAlive(), Upstream(["m"])
    async with relay([hangs_up, steady]) as url:
        # Enough requests that the first one tried is the one that hangs up (round robin).
        for _ in range(4):
            got = await post_events(f"{url}/v1/chat/completions", CHAT)
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
            assert b"error" not in got.raw
    assert len(hangs_up.bodies) >= 1 and len(steady.bodies) == 4
