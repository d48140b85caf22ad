"""A reasoning model's thinking through the relay: shown in the dialects that have a place
for it, in order and counted; kept out of the others and away from moderation checks, where it
still counts as the upstream's progress; and, once shown, the reply's commit point.

The upstream is a small aiohttp app streaming as vLLM's reasoning parsers and DeepSeek's API
do; the mode is the first path segment of its base URL. Clients are the official SDKs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import openai
from aiohttp import web

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.upstream import UpstreamConfig, UpstreamEngine, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.context import ServerConfig
from tests.sse_client import post_events

THOUGHTS = ["Two and ", "two ", "make four."]
ANSWER = ["The answer ", "is 4."]
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def _event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"object": "chat.completion.chunk", "model": "m", "choices": [choice], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ThinkingUpstream:
    """Thinks (spelt as the mode says), then answers; remembers how many requests came."""

    def __init__(self) -> None:
        self.requests = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        mode = request.match_info["mode"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_event({"role": "assistant", "content": ""}))
        for thought in THOUGHTS:
            if mode == "deepseek":  # DeepSeek's API, SGLang, llama.cpp: content null beside it
                delta: dict[str, Any] = {"content": None, "reasoning_content": thought}
            elif mode == "vllm":  # newer vLLM, OpenRouter
                delta = {"reasoning": thought}
            else:  # both spellings of one thought in one delta
                delta = {"reasoning": thought, "reasoning_content": thought}
            await response.write(_event(delta))
            await asyncio.sleep(0.15)  # longer than the relay's TTFT limit, in all
        if mode == "cut":  # breaks after thinking, before any text
            assert request.transport is not None
            request.transport.abort()
            return response
        for piece in ANSWER:
            await response.write(_event({"content": piece}))
        await response.write(_event({}, "stop"))
        usage = {"object": "chat.completion.chunk", "model": "m", "choices": [], "usage": USAGE}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


@asynccontextmanager
async def relay(
    mode: str, config: ServerConfig | None = None, *, targets: int = 1
) -> AsyncIterator[tuple[str, ThinkingUpstream]]:
    """A relay (TTFT limit 0.3 s, shorter than the thinking) in front of ``targets`` copies
    of the thinking upstream's ``mode``."""
    upstream = ThinkingUpstream()
    app = web.Application()
    app.router.add_post("/{mode}/{copy}/v1/chat/completions", upstream.chat)
    app.router.add_get("/{mode}/{copy}/v1/models", _models)
    async with running(app) as root:
        urls = tuple(UpstreamTarget(f"{root}/{mode}/{i}/v1") for i in range(targets))
        engine = UpstreamEngine(UpstreamConfig(urls, model="m", ttft_s=0.3, stall_s=0.3))
        async with running(create_app(engine, config)) as url:
            yield url, upstream


ASK: Any = [{"role": "user", "content": "What is 2 + 2?"}]


async def test_chat_streams_the_thinking_as_reasoning_content_before_the_answer():
    for mode in ("deepseek", "vllm", "both"):
        async with (
            relay(mode) as (url, _),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
        ):
            stream = await client.chat.completions.create(
                model="m", messages=ASK, stream=True, stream_options={"include_usage": True}
            )
            pieces: list[tuple[str, str]] = []
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    extra = choice.delta.model_extra or {}
                    if extra.get("reasoning_content"):
                        pieces.append(("thought", extra["reasoning_content"]))
                    if choice.delta.content:
                        pieces.append(("text", choice.delta.content))
        # Every thought once, in order, before the answer; none of it in the content.
        assert pieces == [("thought", t) for t in THOUGHTS] + [("text", a) for a in ANSWER], mode
        assert usage is not None and usage.completion_tokens == 5, mode
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.reasoning_tokens == len(THOUGHTS), mode


async def test_a_whole_chat_completion_holds_the_thinking_beside_the_content():
    async with (
        relay("deepseek") as (url, _),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        completion = await client.chat.completions.create(model="m", messages=ASK)
    message = completion.choices[0].message
    assert message.content == "".join(ANSWER)
    assert (message.model_extra or {})["reasoning_content"] == "".join(THOUGHTS)
    assert completion.usage is not None and completion.usage.completion_tokens_details
    assert completion.usage.completion_tokens_details.reasoning_tokens == len(THOUGHTS)


async def test_native_replies_name_the_thinking_in_their_own_events():
    async with relay("vllm") as (url, _):
        got = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
        whole = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": False})
    kinds = [t for t in got.types if t in ("thinking", "token")]
    assert kinds == ["thinking"] * len(THOUGHTS) + ["token"] * len(ANSWER)
    assert [e["text"] for e in got.of_type("thinking")] == THOUGHTS
    assert got.text == "".join(ANSWER)
    body = json.loads(whole.raw)
    assert body["thinking"] == "".join(THOUGHTS) and body["text"] == "".join(ANSWER)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHTS)}


async def test_where_the_thinking_is_not_shown_it_still_keeps_the_attempt_alive():
    # Under moderation checks (they read the answer alone) and in Anthropic's dialect (no
    # thinking blocks asked for), the thinking is not relayed; it is still the upstream's
    # progress, so the TTFT limit (0.3 s, less than the 0.45 s of thinking) does not cut it.
    checks = ServerConfig(policy=DeliveryPolicy(checks=(BannedPhrases(["forbidden"]),)))
    async with relay("deepseek", checks, targets=2) as (url, upstream):
        got = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
            message = await client.messages.create(model="m", max_tokens=50, messages=ASK)
    assert not got.of_type("thinking") and not got.of_type("error"), got.raw
    assert got.text == "".join(ANSWER)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "".join(ANSWER)  # type: ignore[union-attr]
    assert upstream.requests == 2  # one each: no attempt timed out and moved on


async def test_shown_thinking_commits_the_reply_to_its_upstream():
    # Thinking the client has read cannot be taken back: an upstream that breaks after it
    # ends the reply with an in-band error (continuation off), not an invisible failover.
    async with relay("cut", targets=2) as (url, upstream):
        got = await post_events(
            f"{url}/v1/chat/completions", {"model": "m", "messages": ASK, "stream": True}
        )
    assert got.status == 200
    thoughts = [
        c["delta"]["reasoning_content"]
        for e in got.events
        if e.type == "message" and e.data != "[DONE]"
        for c in json.loads(e.data)["choices"]
        if "reasoning_content" in c["delta"]
    ]
    assert thoughts == THOUGHTS
    [error] = got.of_type("error")
    assert error["error"]["code"] == "upstream_disconnected"
    assert upstream.requests == 1
