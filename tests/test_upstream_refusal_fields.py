"""An upstream's refusal, relayed, names the field the client sent, in its own API's words.

The relay is sent chat but for a legacy completion (sent as one, with the client's own
fields): an upstream that refuses names chat's fields (``messages``, ``max_tokens``,
``max_completion_tokens``). A client of the Responses or Messages API, or of the native
routes, sent others: it is told its own (``input``, ``max_output_tokens``, ``prompt``), and
a field it has no name for (a place in chat's ``messages``) is left out.
The upstream is a small aiohttp app in this process on a loopback port; the relay is
replystream's server on another, read with the official SDKs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream
from tests.nginx import proxy_config, running_nginx
from tests.processes import replica
from tests.services import free_port


class RefusingUpstream(ChatUpstream):
    """Refuses every chat with a 400 naming ``param``, as OpenAI's API words one."""

    param = "messages"

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/completions", self.chat)  # legacy completions alike
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        error = {
            "message": "this model's context cannot hold that",
            "type": "invalid_request_error",
            "param": self.param,
            "code": "context_length_exceeded",
        }
        return web.json_response({"error": error}, status=400)


@asynccontextmanager
async def relay() -> AsyncIterator[tuple[RefusingUpstream, str]]:
    upstream = RefusingUpstream()
    async with running(upstream.app()) as base:
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{base}/v1"),)))
        async with running(create_app(engine)) as url:
            yield upstream, url


def openai_sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    ("upstream_param", "client_param"),
    [
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("messages[0].content", None),  # not a place in the client's input
        ("logprobs", None),  # the client asked with an include, not a field of this name
        ("service_tier", "service_tier"),  # sent on as given
        ("reasoning_effort", "reasoning.effort"),
    ],
)
async def test_a_responses_client_is_told_its_own_field(
    upstream_param: str, client_param: str | None
) -> None:
    async with relay() as (upstream, url), openai_sdk(url) as client:
        upstream.param = upstream_param
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    model="m", input="hi", max_output_tokens=50, stream=stream
                )
            error = refused.value
            assert (error.param, error.code) == (client_param, "context_length_exceeded")
            assert error.type == "invalid_request_error"
            assert "this model's context cannot hold that" in error.message


@pytest.mark.parametrize(
    ("upstream_param", "client_param"),
    [
        ("messages", "messages"),
        ("max_tokens", "max_tokens"),
        ("max_completion_tokens", "max_tokens"),
        ("messages[1].content", None),  # chat's list holds the system prompt first
        ("stop", None),  # stop_sequences, or replystream's stop: not known which
        ("user", "metadata.user_id"),  # sent on as chat's user
    ],
)
async def test_a_messages_client_is_told_its_own_field(
    upstream_param: str, client_param: str | None
) -> None:
    ask: dict[str, Any] = {
        "model": "m",
        "system": "Be brief.",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with (
        relay() as (upstream, url),
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        upstream.param = upstream_param
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(**ask, stream=stream)
            body: Any = refused.value.body
            assert body["type"] == "error"
            error = body["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", client_param)


@pytest.mark.parametrize(
    ("upstream_param", "legacy_param", "chat_param"),
    [
        # A legacy completion goes up as one (``/completions``): its fields are the client's.
        ("prompt", "prompt", "messages"),  # (a chat request has no prompt: its messages)
        ("max_tokens", "max_tokens", "max_tokens"),
        ("logprobs", "logprobs", "logprobs"),
        ("messages", None, "messages"),  # not a field a legacy completion has
        ("max_completion_tokens", None, "max_tokens"),  # the limit as it was sent
        ("messages[0].content", None, "messages[0].content"),  # chat's list is chat's own
        ("tools", None, "tools"),
        ("user", "user", "user"),  # sent on as given
    ],
)
async def test_an_openai_client_is_told_its_own_field(
    upstream_param: str, legacy_param: str | None, chat_param: str
) -> None:
    async with relay() as (upstream, url), openai_sdk(url) as client:
        upstream.param = upstream_param
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as legacy:
                await client.completions.create(model="m", prompt="hi", stream=stream)
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=50,
                    stream=stream,
                )
            assert (legacy.value.param, chat.value.param) == (legacy_param, chat_param)


@pytest.mark.parametrize(
    ("upstream_param", "from_prompt", "from_messages"),
    [
        ("messages", "prompt", "messages"),
        ("max_completion_tokens", "max_tokens", "max_tokens"),
        ("top_p", "top_p", "top_p"),
        ("messages[0].content", None, None),  # the relay's list, not the client's
        ("tools", None, None),  # a field the native request does not have
    ],
)
async def test_a_native_client_is_told_its_own_field(
    upstream_param: str, from_prompt: str | None, from_messages: str | None
) -> None:
    asks: list[tuple[dict[str, Any], str | None]] = [
        ({"prompt": "hi"}, from_prompt),
        ({"messages": [{"role": "user", "content": "hi"}]}, from_messages),
    ]
    async with relay() as (upstream, url), aiohttp.ClientSession() as http:
        upstream.param = upstream_param
        for ask, expected in asks:
            for stream in (False, True):
                async with http.post(f"{url}/v1/replies", json={**ask, "stream": stream}) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == expected
            async with http.ws_connect(f"{url}/v1/ws") as ws:
                await ws.send_json({"type": "reply", "id": "t", **ask})
                error = await ws.receive_json()
            assert error["type"] == "error" and error["id"] == "t"
            assert error["data"]["error"]["param"] == expected


async def test_a_request_too_large_for_one_upstream_goes_to_another_and_alone_is_a_413(tmp_path):
    """nginx in front of a model server takes 1 MB of body unless told otherwise, and refuses
    more with a 413 page of its own, which the relay does not quote. That limit is the
    upstream's, not the request's fault nor its health: another upstream is tried (nothing
    counted on the front's circuit), and with none left the client gets a 413 saying what
    the status means."""
    schedule = ("--engine", "simulated", "--delay-ms", "0", "--jitter-ms", "0", "--tokens", "3")
    async with replica(*schedule) as (_, app_url):
        port = free_port()
        config = proxy_config(app_url.removeprefix("http://"), port, "client_max_body_size 2k;")
        front = f"http://127.0.0.1:{port}/v1"
        large = {"messages": [{"role": "user", "content": "hi " * 2000}]}
        async with running_nginx(config, port, tmp_path / "nginx"):
            alone = UpstreamEngine(UpstreamConfig((UpstreamTarget(front),), failures=1))
            async with running(create_app(alone)) as relay, aiohttp.ClientSession() as session:
                async with session.post(f"{relay}/v1/chat/completions", json=large) as refused:
                    status, error = refused.status, (await refused.json())["error"]
                small = {"messages": [{"role": "user", "content": "hi"}]}
                async with session.post(f"{relay}/v1/chat/completions", json=small) as after:
                    # One failure would open its circuit: the 413 was not counted as one.
                    assert after.status == 200, await after.text()
            both = (UpstreamTarget(front), UpstreamTarget(f"{app_url}/v1"))
            relayed = UpstreamEngine(UpstreamConfig(both))
            async with running(create_app(relayed)) as relay, aiohttp.ClientSession() as session:
                answers = []
                for _ in range(4):  # ties go round robin: the front goes first every other time
                    async with session.post(f"{relay}/v1/chat/completions", json=large) as got:
                        answers.append(got.status)
                stats = relayed.stats().backends
    assert status == 413 and error["type"] == "invalid_request_error", error
    assert error["code"] == "request_too_large", error
    assert error["message"] == (
        f"the upstream at {front} answered 413: the request is larger than it takes (its own "
        "limit, or a proxy's)"
    ), error
    assert answers == [200] * 4, answers
    too_large = {b.name: dict(b.attempts).get("too_large", 0) for b in stats}
    assert too_large[front] >= 1 and too_large[f"{app_url}/v1"] == 0, too_large
