"""A stop string split across a continuation's seam, with the relay as a real
``replystream serve --engine upstream:...`` process in front of two aiohttp upstreams on
loopback sockets: the text before the seam ends with the stop string's start, the continued
upstream's text begins with its rest. The reply ends at the stop string as it would without
the seam: no character of it is shown, and it is named where the dialect names one."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replystream.server import running
from tests.processes import replica
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, chunk

pytestmark = pytest.mark.slow


class CrashesThenContinues(Upstream):
    """Asked afresh: ``first`` (chunks), then the connection closes (a crash). Asked to
    continue (a final assistant message): ``rest`` (chunks ending with a finish), and
    ``[DONE]``; unless ``answer_instead`` answers the request instead."""

    def __init__(self, first: bytes, rest: bytes) -> None:
        super().__init__(["m"])
        self.first, self.rest = first, rest

    def answer_instead(self, body: dict[str, Any]) -> web.Response | None:
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        self.bodies.append(body)
        refused = self.answer_instead(body)
        if refused is not None:
            return refused
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if not body.get("continue_final_message"):
            await response.write(self.first)
            await response.drain()
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write(self.rest)
        await response.write(b"data: [DONE]\n\n")
        return response


def splits_the_stop() -> CrashesThenContinues:
    """``hello `` and ``ST`` before the crash; ``OP`` and `` world`` after it."""
    before = chunk("hello ") + chunk("ST")
    return CrashesThenContinues(before, chunk("OP") + chunk(" world") + chunk(None, "stop"))


async def test_a_stop_string_split_across_a_seam_ends_the_reply_before_it():
    upstreams = [splits_the_stop(), splits_the_stop()]
    async with running(upstreams[0].app()) as one, running(upstreams[1].app()) as two:
        relay_args = (f"--engine=upstream:{one}/v1", f"--engine=upstream:{two}/v1")
        async with replica(*relay_args, "--upstream-continue") as (_, relay):
            native = await post_events(f"{relay}/v1/replies", {"prompt": "hi", "stop": ["STOP"]})
            ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            chat = await post_events(
                f"{relay}/v1/chat/completions", {**ask, "stream": True, "stop": ["STOP"]}
            )
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"{relay}/v1/replies", json={"prompt": "hi", "stop": ["STOP"], "stream": False}
                ) as r,
            ):
                whole = await r.json()
    continued = [b for u in upstreams for b in u.bodies if b.get("continue_final_message")]
    assert len(continued) == 3  # every reply went on at the other upstream
    assert all(b["messages"][-1] == {"role": "assistant", "content": "hello ST"} for b in continued)
    # Only chat's attempts carry the stop string: the native route names it, so the relay
    # cuts it itself, across the seam too.
    assert [b.get("stop") for u in upstreams for b in u.bodies].count(["STOP"]) == 2
    assert native.types.count("continued") == 1
    assert native.text == "hello "
    assert native.of_type("done") == [{"finish_reason": "stop", "stop_sequence": "STOP"}]
    assert chat.chat_text == "hello "
    [finish] = [
        json.loads(e.data)["choices"][0]["finish_reason"]
        for e in chat.events
        if e.data != "[DONE]" and json.loads(e.data)["choices"][0]["finish_reason"]
    ]
    assert finish == "stop"
    assert (whole["text"], whole["stop_sequence"]) == ("hello ", "STOP")
