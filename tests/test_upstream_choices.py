"""Several choices (``n > 1``) through the relay: each choice is its own relayed reply, so a
choice whose upstream stalls mid-reply goes on at another upstream by itself, with its own
text so far as the assistant's prefix, and the client reads each choice as one uninterrupted
text under its own index. Usage counts the upstream's prompt once and sums the choices.

The upstreams are small aiohttp apps in this process (real servers on loopback ports), the
relay a replystream app serving an ``UpstreamEngine``; the client is the official openai SDK.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import openai
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream, reply_with
from tests.sse_client import post_events

PROMPT_TOKENS = 11  # what every upstream reports: more than our estimate of "hi"


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class StallsOnce(ChatUpstream):
    """An upstream that stalls every fresh reply after three words (keep-alives only), and
    finishes a continued one (``continue_final_message``) with two more. Its words name the
    request's seed, so each choice's text is its own."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        seed = body.get("seed")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("", role="assistant"))
        if not body.get("continue_final_message"):
            for i in range(3):
                await response.write(chunk(f"s{seed}w{i} "))
            for _ in range(300):  # the relay gives up on this attempt long before
                await response.write(b": keep-alive\n\n")
                await asyncio.sleep(0.05)
            return response
        for i in range(2):
            await response.write(chunk(f"s{seed}c{i} "))
        await response.write(chunk(None, "stop"))
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": 13}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response


@asynccontextmanager
async def relay(upstreams: Sequence[ChatUpstream]) -> AsyncIterator[str]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = tuple(UpstreamTarget(f"{u}/v1") for u in urls)
        engine = UpstreamEngine(UpstreamConfig(targets, stall_s=0.4, continuation=True))
        yield await stack.enter_async_context(running(create_app(engine)))


def expected_text(seed: int) -> str:
    return "".join(f"s{seed}w{i} " for i in range(3)) + "".join(f"s{seed}c{i} " for i in range(2))


ASK: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "n": 2,
    "seed": 0,
}


async def test_each_choice_continues_on_its_own_after_a_stall_streamed_and_whole():
    upstreams = [StallsOnce(), StallsOnce()]
    async with (
        relay(upstreams) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            **ASK, stream=True, stream_options={"include_usage": True}
        )
        texts = ["", ""]
        finishes: list[tuple[int, str]] = []
        usage = []
        async for got in stream:
            for choice in got.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finishes.append((choice.index, choice.finish_reason))
            if got.usage is not None:
                usage.append((got.usage.prompt_tokens, got.usage.completion_tokens))
        whole = await client.chat.completions.create(**ASK)
    assert texts == [expected_text(0), expected_text(1)]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]
    assert usage == [(PROMPT_TOKENS, 10)]  # the prompt once; five tokens per choice
    assert [c.message.content for c in whole.choices] == texts
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (PROMPT_TOKENS, 10)
    # Each continuation carried its own choice's text so far, and its seed.
    continued = [b for u in upstreams for b in u.bodies if b.get("continue_final_message")]
    assert sorted((b["seed"], b["messages"][-1]["content"]) for b in continued) == [
        (seed, f"s{seed}w0 s{seed}w1 s{seed}w2 ") for seed in (0, 1) for _ in range(2)
    ]


async def test_a_reply_without_a_generation_prompt_is_not_continued_as_an_assistant_message():
    """With ``add_generation_prompt: false`` the upstream writes on from the conversation
    with no assistant turn opened; its text so far is not an assistant message, so after a
    stall it is not sent upstream as one: the reply ends with the stall's error instead."""
    upstreams = [StallsOnce(), StallsOnce()]
    async with relay(upstreams) as url:
        body = {**ASK, "n": 1, "stream": True, "add_generation_prompt": False}
        got = await post_events(f"{url}/v1/chat/completions", body)
    assert got.chat_text == expected_text(0)[: len("s0w0 s0w1 s0w2 ")]
    assert [e["error"]["code"] for e in got.of_type("error")] == ["upstream_stalled"]
    assert not [b for u in upstreams for b in u.bodies if b.get("continue_final_message")]


class NamesItsSeed(ChatUpstream):
    """Answers every request at once with the seed it was sent (``-``: none), and keeps the
    bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        return await reply_with(request, f"seed {body.get('seed', '-')}")


async def test_the_relay_sends_a_seed_only_when_the_client_gave_one_for_every_choice():
    """A client without a seed leaves the draws to the upstream, one per choice, each its own
    (a seed the relay made up would repeat the same choices for every such request); a
    client's seed goes up as ``seed + i`` for choice ``i``."""
    upstream = NamesItsSeed()
    async with (
        relay([upstream]) as url,
        aiohttp.ClientSession() as http,
    ):
        texts = []
        for extra in ({"n": 1}, {"n": 2}, {"n": 2, "seed": 5}):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                choices = (await response.json())["choices"]
            texts.append(sorted(c["message"]["content"] for c in choices))
    assert texts == [["seed -"], ["seed -", "seed -"], ["seed 5", "seed 6"]]
    assert sum("seed" in body for body in upstream.bodies) == 2
