"""An upstream that thinks before it answers, streaming as vLLM's reasoning parsers and
DeepSeek's API do, and a relay in front of it (both on loopback sockets).

The mode is the first path segment of its base URL: ``deepseek`` (``reasoning_content``,
content null beside it), ``vllm`` (``reasoning``), ``both`` (both spellings of one thought),
``cut`` (the connection breaks after the thinking, before any text), ``quiet`` (as ``vllm``,
but no usage: llama-cpp-python's server sends none), ``counted`` (as ``vllm``, its usage
naming the thinking's tokens, more than its pieces, as DeepSeek's API and OpenRouter send it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig

THOUGHTS = ["Two and ", "two ", "make four."]
# After each thought: in all, longer than TTFT_S. Each gap is under half the limit, and the
# first thought comes with the head, so a busy machine's pause does not cut the thinking short
# (at 0.2 s and 0.45 s, a reply beside the whole suite once passed the limit before its text).
THINK_S = 0.4
TTFT_S = 0.9
ANSWER = ["The answer ", "is 4."]
USAGE: dict[str, Any] = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
# The ``counted`` mode's: each thought two tokens, each answer piece one.
COUNTED_THOUGHT_TOKENS = 2 * len(THOUGHTS)
COUNTED_USAGE: dict[str, Any] = {
    "prompt_tokens": 7,
    "completion_tokens": COUNTED_THOUGHT_TOKENS + len(ANSWER),
    "total_tokens": 7 + COUNTED_THOUGHT_TOKENS + len(ANSWER),
    "completion_tokens_details": {"reasoning_tokens": COUNTED_THOUGHT_TOKENS},
}


def _event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"object": "chat.completion.chunk", "model": "m", "choices": [choice], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ThinkingUpstream:
    """Thinks (spelt as the mode says), then answers; remembers how many requests came."""

    def __init__(self) -> None:
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.bodies.append(await request.json())
        mode = request.match_info["mode"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_event({"role": "assistant", "content": ""}))
        answer = ANSWER
        if mode == "interleaved":  # some text, then the thinking, then the rest of the text
            await response.write(_event({"content": ANSWER[0]}))
            answer = ANSWER[1:]
        for thought in THOUGHTS:
            if mode == "deepseek":  # DeepSeek's API, SGLang, llama.cpp: content null beside it
                delta: dict[str, Any] = {"content": None, "reasoning_content": thought}
            elif mode in ("vllm", "interleaved", "quiet", "counted"):  # newer vLLM, OpenRouter
                delta = {"reasoning": thought}
            else:  # both spellings of one thought in one delta
                delta = {"reasoning": thought, "reasoning_content": thought}
            await response.write(_event(delta))
            await asyncio.sleep(THINK_S)
        if mode == "cut":  # breaks after thinking, before any text
            assert request.transport is not None
            request.transport.abort()
            return response
        for piece in answer:
            await response.write(_event({"content": piece}))
        await response.write(_event({}, "stop"))
        if mode == "quiet":
            await response.write(b"data: [DONE]\n\n")
            return response
        counts = COUNTED_USAGE if mode == "counted" else USAGE
        usage = {"object": "chat.completion.chunk", "model": "m", "choices": [], "usage": counts}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


@asynccontextmanager
async def relay(
    mode: str, config: ServerConfig | None = None, *, targets: int = 1
) -> AsyncIterator[tuple[str, ThinkingUpstream]]:
    """A relay (its TTFT limit shorter than the thinking, its gaps well within it) in front
    of ``targets`` copies of the thinking upstream's ``mode``."""
    upstream = ThinkingUpstream()
    app = web.Application()
    app.router.add_post("/{mode}/{copy}/v1/chat/completions", upstream.chat)
    app.router.add_get("/{mode}/{copy}/v1/models", _models)
    async with running(app) as root:
        urls = tuple(UpstreamTarget(f"{root}/{mode}/{i}/v1") for i in range(targets))
        engine = UpstreamEngine(UpstreamConfig(urls, model="m", ttft_s=TTFT_S, stall_s=5.0))
        async with running(create_app(engine, config)) as url:
            yield url, upstream
