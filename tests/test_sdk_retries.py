"""What the official ``openai`` and ``anthropic`` SDKs do with our refusals, left at their
defaults (two retries): they retry a 408, 409, 429 and every 5xx unless ``X-Should-Retry:
false`` says not to, and sleep for as long as ``Retry-After`` says first. The servers are real
ones on loopback; what they were asked is counted where the request ends (an upstream's own
log, the relay's metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import openai
from aiohttp import web
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.services import free_port

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
async def relay_in_front(
    upstream: web.Application, *more: UpstreamTarget, **first: Any
) -> AsyncIterator[str]:
    """A relay to ``upstream`` (its target's fields ``first``), then ``more``; yields its
    base URL."""
    async with running(upstream) as upstream_url:
        targets = (UpstreamTarget(f"{upstream_url}/v1", **first), *more)
        engine = UpstreamEngine(UpstreamConfig(targets))
        try:
            async with running(create_app(engine)) as url:
                yield url
        finally:
            await engine.aclose()


def relay_to(upstream: QuotaSpent) -> AbstractAsyncContextManager[str]:
    """A relay passing each caller's key on to ``upstream``; yields its base URL."""
    return relay_in_front(upstream.app(), pass_client_key=True, models=("open",))


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


class Refusing:
    """An upstream that refuses every request with ``status`` (401: the relay was given no
    key for it; 500: a fault of its own, which may pass)."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.asked = 0  # chat requests that reached it

    async def refuse(self, request: web.Request) -> web.Response:
        self.asked += request.path.endswith("/chat/completions")
        error = {"message": "no", "type": "invalid_request_error"}
        return web.json_response({"error": error}, status=self.status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.refuse)
        return app


def relay_keyless(upstream: Refusing, *more: UpstreamTarget) -> AbstractAsyncContextManager[str]:
    """A relay to ``upstream`` (then ``more``) with no key of its own for it; yields its
    base URL."""
    return relay_in_front(upstream.app(), *more)


async def test_a_relay_refused_for_its_own_configuration_is_not_retried():
    """The upstream wants a key the relay was not given: every attempt fails so until an
    operator gives it one. The SDKs retried that 502 as any 5xx, and once the circuit opened,
    its 503 after sleeping its ``Retry-After`` (the cool-down), twice: each call hung about
    11 s before its caller saw the error. Now each is told at once, and not asked again."""
    upstream = Refusing(401)
    async with relay_keyless(upstream) as url, asyncio.timeout(60):
        loop = asyncio.get_running_loop()
        started = loop.time()
        statuses = []
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k") as gpt:
            for _ in range(4):  # past the circuit's row of failures: then it is open
                try:
                    await gpt.chat.completions.create(model="m", messages=CHAT_HI, stream=True)
                except openai.APIStatusError as exc:
                    assert exc.response.headers["X-Should-Retry"] == "false", exc
                    assert "none is configured for it" in exc.message, exc.message
                    statuses.append(exc.status_code)
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k") as claude:
            try:
                await claude.messages.create(model="m", max_tokens=5, messages=HI)
            except anthropic.APIStatusError as exc:
                assert exc.response.headers["X-Should-Retry"] == "false", exc
                statuses.append(exc.status_code)
        waited = loop.time() - started
    assert statuses[0] == 502 and statuses[-2:] == [503, 529], statuses
    assert upstream.asked <= 3, upstream.asked  # once per call until the circuit opened
    assert waited < 8.0, waited


async def test_a_fault_of_the_upstreams_own_is_retried():
    """A 500 of the upstream's may pass: the relay's 502 says nothing against a retry, and
    the SDK asks twice more."""
    upstream = Refusing(500)
    async with relay_keyless(upstream) as url, asyncio.timeout(60):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k") as gpt:
            try:
                await gpt.chat.completions.create(model="m", messages=CHAT_HI)
            except openai.APIStatusError as exc:
                assert exc.status_code == 502, exc
                assert "X-Should-Retry" not in exc.response.headers
            else:
                raise AssertionError("the upstream's 500 was not told")
    assert upstream.asked == 3


async def test_a_refusal_for_configuration_beside_a_fault_that_may_pass_is_retried():
    """One upstream wants a key the relay lacks, the other is down (it may come back): the
    relay's answer says nothing against a retry."""
    down = UpstreamTarget(f"http://127.0.0.1:{free_port()}/v1")
    async with relay_keyless(Refusing(401), down) as url, asyncio.timeout(60):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as gpt:
            try:
                await gpt.chat.completions.create(model="m", messages=CHAT_HI)
            except openai.APIStatusError as exc:
                assert exc.status_code == 502, exc
                assert "X-Should-Retry" not in exc.response.headers, exc
            else:
                raise AssertionError("no upstream could answer")


async def test_a_rates_short_wait_is_slept_as_it_is_not_rounded_up_to_a_second():
    """At 300 requests a minute a spent rate has room again within 0.2 s; ``Retry-After``
    can say no less than 1 s, which the SDKs slept. ``retry-after-ms``, read first, says it
    to the millisecond."""
    config = ServerConfig(guard=GuardConfig(per_minute=300))
    async with running(create_app(fast_engine(), config)) as url, asyncio.timeout(60):
        async with aiohttp.ClientSession() as http:
            while True:  # the rate spent
                async with http.get(f"{url}/v1/models") as response:
                    if response.status == 429:
                        headers = response.headers
                        break
        assert headers["Retry-After"] == "1"
        assert 1 <= int(headers["retry-after-ms"]) <= 200, headers
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k") as gpt:
            loop = asyncio.get_running_loop()
            started = loop.time()
            for _ in range(3):  # each spends the room the last wait gave, and waits again
                await gpt.models.list()
            waited = loop.time() - started
    assert waited < 2.0, waited  # three waits of 1 s each before: 3 s
