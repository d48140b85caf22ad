"""The clients pointed at servers that are not replystream, each a real server on a loopback
socket that streams as a model server does: what they say of the reply must be what happened."""

from __future__ import annotations

import json

from aiohttp import web

from replystream.client import measure_reply
from replystream.server import running
from tests.chat_upstream import ChatUpstream
from tests.test_upstream_llama_cpp_errors import CONTEXT_ERROR, OldLlamaCppServer


def chat_chunk(text: str) -> bytes:
    choice = {"index": 0, "delta": {"content": text}}
    body = {"object": "chat.completion.chunk", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def test_llama_cpps_error_line_before_its_done_is_a_failed_reply_naming_the_error():
    async with running(OldLlamaCppServer("Hello", CONTEXT_ERROR).app()) as url:
        timing = await measure_reply(
            f"{url}/v1/chat/completions", method="POST", json_body={"model": "m"}
        )
    assert timing.text == "Hello"
    assert not timing.complete
    assert timing.error is not None
    assert "the request exceeds the available context size" in timing.error


class SteadyServer(ChatUpstream):
    """Three words of chat chunks, then ``[DONE]``: a whole reply, so an ``error`` line is
    read as one only where a stream has it."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("one ", "two ", "three"):
            await response.write(chat_chunk(word))
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_a_chat_stream_without_an_error_line_is_still_whole():
    async with running(SteadyServer().app()) as url:
        timing = await measure_reply(
            f"{url}/v1/chat/completions", method="POST", json_body={"model": "m"}
        )
    assert (timing.complete, timing.error, timing.text) == (True, None, "one two three")
