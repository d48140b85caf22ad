"""A stand-in OpenAI-compatible upstream on aiohttp, for relay tests in this process: it lists
one model and answers ``POST /v1/chat/completions`` as its subclass's ``chat`` says."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running


async def reply_with(
    request: web.Request, text: str, finish_reason: str = "stop"
) -> web.StreamResponse:
    """Stream ``text`` as one chat chunk, then the finish and ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for body in (
        {"choices": [{"index": 0, "delta": {"content": text}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]},
    ):
        await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


class ChatUpstream:
    """Serves ``GET /v1/models`` (the model ``m``) and a subclass's ``chat``."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


class CountingUpstream(ChatUpstream):
    """Answers every chat with one word, counting the chats it was asked for."""

    def __init__(self) -> None:
        self.chats = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.chats += 1
        return await reply_with(request, "sunny")


class RecordingUpstream(ChatUpstream):
    """Answers every chat with ``text`` ending as ``finish_reason``, keeping each body asked."""

    def __init__(self, text: str = "sunny", finish_reason: str = "stop") -> None:
        self.text, self.finish_reason = text, finish_reason
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await reply_with(request, self.text, self.finish_reason)


@asynccontextmanager
async def relaying_to(upstream: ChatUpstream) -> AsyncIterator[str]:
    """The URL of a server relaying to ``upstream`` (both on loopback ports)."""
    async with running(upstream.app()) as upstream_url:
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), health_s=600.0)
        )
        try:
            async with running(create_app(engine)) as url:
                yield url
        finally:
            await engine.aclose()
