"""What the official ``openai`` and ``anthropic`` SDKs do with our refusals, left at their
defaults (two retries): they retry a 408, 409, 429 and every 5xx unless ``X-Should-Retry:
false`` says not to, and sleep for as long as ``Retry-After`` says first. The servers are real
ones on loopback; what they were asked is counted where the request ends (an upstream's own
log, the relay's metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import openai
from aiohttp import web
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running

HI: list[MessageParam] = [{"role": "user", "content": "hi"}]
CHAT_HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


class QuotaSpent:
    """A hosted API that takes each caller's own key, whose quota is spent until ``wait``
    (its ``Retry-After``): every chat request is a 429."""

    def __init__(self, wait: str) -> None:
        self.wait = wait
        self.asked = 0  # chat requests that reached it

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "open"}]})

    async def chat(self, _: web.Request) -> web.Response:
        self.asked += 1
        error = {"message": "You exceeded your current quota.", "type": "insufficient_quota"}
        return web.json_response({"error": error}, status=429, headers={"Retry-After": self.wait})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


@asynccontextmanager
async def relay_to(upstream: QuotaSpent) -> AsyncIterator[str]:
    """A relay passing each caller's key on to ``upstream``; yields its base URL."""
    async with running(upstream.app()) as upstream_url:
        target = UpstreamTarget(f"{upstream_url}/v1", pass_client_key=True, models=("open",))
        engine = UpstreamEngine(UpstreamConfig((target,)))
        try:
            async with running(create_app(engine)) as url:
                yield url
        finally:
            await engine.aclose()


async def test_a_wait_of_an_hour_is_not_slept_through_by_either_sdk():
    """An upstream that says the caller's quota returns in an hour: the anthropic SDK sleeps
    for whatever ``Retry-After`` says (it has no bound), twice, and so would hang its caller
    for two hours; the openai SDK gives up on a wait past two minutes by itself. Each gets
    the 429 at once, with the wait, and the upstream is asked once."""
    upstream = QuotaSpent(wait="3600")
    async with relay_to(upstream) as url, asyncio.timeout(30):
        async with anthropic.AsyncAnthropic(base_url=url, api_key="alice") as claude:
            try:
                await claude.messages.create(model="open", max_tokens=5, messages=HI)
            except anthropic.RateLimitError as exc:
                assert exc.response.headers["Retry-After"] == "3600"
                assert exc.response.headers["X-Should-Retry"] == "false"
            else:
                raise AssertionError("the quota's 429 was not the caller's")
        assert upstream.asked == 1
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="alice") as gpt:
            try:
                await gpt.chat.completions.create(model="open", messages=CHAT_HI)
            except openai.RateLimitError as exc:
                assert exc.response.headers["Retry-After"] == "3600"
            else:
                raise AssertionError("the quota's 429 was not the caller's")
        assert upstream.asked == 2


async def test_a_short_wait_is_waited_and_retried():
    """A wait the SDKs may sleep through is theirs to: no ``X-Should-Retry``, and the
    anthropic SDK asks again after ``Retry-After`` (1 s), twice."""
    upstream = QuotaSpent(wait="1")
    async with relay_to(upstream) as url, asyncio.timeout(30):
        async with anthropic.AsyncAnthropic(base_url=url, api_key="alice") as claude:
            started = asyncio.get_running_loop().time()
            try:
                await claude.messages.create(model="open", max_tokens=5, messages=HI)
            except anthropic.RateLimitError as exc:
                assert "X-Should-Retry" not in exc.response.headers
            else:
                raise AssertionError("the quota's 429 was not the caller's")
            waited = asyncio.get_running_loop().time() - started
    assert upstream.asked == 3
    assert 2.0 <= waited < 20.0
