"""The prompt tokens an upstream served from its prefix cache (OpenAI's
``usage.prompt_tokens_details.cached_tokens``, which llama.cpp's server, vLLM and SGLang send
too), relayed in each dialect's own field: chat's, completions' and the native routes'
``prompt_tokens_details.cached_tokens``, the Responses ``input_tokens_details.cached_tokens``,
and Anthropic's ``cache_read_input_tokens`` (its ``input_tokens`` then the prompt's tokens not
read from the cache), streamed and whole. A count that is no count is left out.

The upstream is a small aiohttp app in this process (a real server on a loopback port), the
relay a replystream app serving an ``UpstreamEngine``; the clients are the official SDKs."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from replystream.server.server_config import ServerConfig
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

ASK = [{"role": "user", "content": "hi"}]  # the upstream counts 11 prompt tokens, 3 made


def cached(count: object) -> dict[str, Any]:
    """An upstream's usage fields naming ``count`` cached prompt tokens."""
    return {"prompt_tokens_details": {"cached_tokens": count}}


async def test_every_route_relays_the_upstreams_cached_prompt_tokens_streamed_or_whole():
    async with (
        relay([Upstream(["m"], usage=cached(8))]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        chat = await oai.chat.completions.create(model="m", messages=ASK)  # type: ignore[arg-type]
        chunks = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ASK, stream=True, stream_options={"include_usage": True}
        )
        streamed_chat = [c.usage async for c in chunks if c.usage is not None]
        text = await oai.completions.create(model="m", prompt="hi")
        pieces = await oai.completions.create(
            model="m", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
        streamed_text = [c.usage async for c in pieces if c.usage is not None]
        for usage in (chat.usage, *streamed_chat, text.usage, *streamed_text):
            assert usage is not None
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (11, 3, 14)
            assert usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == 8
        assert len(streamed_chat) == len(streamed_text) == 1

        response = await oai.responses.create(model="m", input="hi")
        stream = await oai.responses.create(model="m", input="hi", stream=True)
        completed = [e.response async for e in stream if e.type == "response.completed"]
        stored = await oai.responses.retrieve(completed[0].id)
        for got in (response, *completed, stored):
            assert got.usage is not None
            assert (got.usage.input_tokens, got.usage.output_tokens) == (11, 3)
            assert got.usage.input_tokens_details.cached_tokens == 8

        # Anthropic counts input_tokens apart from the tokens read from a cache.
        async with claude.messages.stream(model="m", max_tokens=9, messages=ASK) as messages:  # type: ignore[arg-type]
            events = [event async for event in messages]
            final = await messages.get_final_message()
        whole = await claude.messages.create(model="m", max_tokens=9, messages=ASK)  # type: ignore[arg-type]
        started = next(e for e in events if e.type == "message_start")
        assert started.message.usage.cache_read_input_tokens is None  # not known yet
        delta = next(e for e in events if e.type == "message_delta")
        for usage in (delta.usage, final.usage, whole.usage):
            assert (usage.input_tokens, usage.cache_read_input_tokens) == (3, 8)
            assert usage.output_tokens == 3

        native = await post_events(f"{url}/v1/replies", {"prompt": "hi"})
        native_whole = await post_events(f"{url}/v1/replies", {"prompt": "hi", "stream": False})
        for usage in (*native.of_type("usage"), json.loads(native_whole.raw)["usage"]):
            assert usage == {
                "prompt_tokens": 11,
                "completion_tokens": 3,
                "total_tokens": 14,
                "prompt_tokens_details": {"cached_tokens": 8},
            }
        assert len(native.of_type("usage")) == 1


async def test_several_choices_count_the_cached_prompt_tokens_once():
    async with (
        relay([Upstream(["m"], usage=cached(8))]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        whole = await oai.chat.completions.create(model="m", messages=ASK, n=2)  # type: ignore[arg-type]
        chunks = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
        )
        streamed = [c.usage async for c in chunks if c.usage is not None]
    for usage in (whole.usage, *streamed):
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (11, 6)
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 8
    assert len(streamed) == 1


@pytest.mark.parametrize("count", [0, 11])
async def test_none_or_all_of_the_prompt_cached_is_a_count(count: int):
    async with (
        relay([Upstream(["m"], usage=cached(count))]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        chat = await post_events(f"{url}/v1/chat/completions", {"messages": ASK, "stream": False})
        whole = await claude.messages.create(model="m", max_tokens=9, messages=ASK)  # type: ignore[arg-type]
    assert json.loads(chat.raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": count}
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (11 - count, count)


NO_COUNTS = [
    {},  # an upstream that counts no cache hits (or was not asked to)
    {"prompt_tokens_details": None},
    {"prompt_tokens_details": "8"},
    cached(None),
    cached("8"),
    cached(8.0),
    cached(True),
    cached(-1),
    cached(12),  # more than the prompt's 11
    cached(2**53),
    {"prompt_tokens": None, **cached(8)},  # no prompt count to be part of
]


@pytest.mark.parametrize("usage", NO_COUNTS, ids=[json.dumps(u) for u in NO_COUNTS])
async def test_a_cached_count_that_is_no_count_is_left_out(usage: dict[str, Any]):
    """The usage is as it was before any cache count was relayed: chat's has no details, the
    Responses one says 0 cached, Anthropic's all of the prompt in ``input_tokens``."""
    async with (
        relay([Upstream(["m"], usage=usage)]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        chat = await post_events(f"{url}/v1/chat/completions", {"messages": ASK, "stream": False})
        response = await oai.responses.create(model="m", input="hi")
        whole = await claude.messages.create(model="m", max_tokens=9, messages=ASK)  # type: ignore[arg-type]
    prompt = json.loads(chat.raw)["usage"]["prompt_tokens"]
    assert json.loads(chat.raw)["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 3,
        "total_tokens": prompt + 3,
    }
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert whole.usage.input_tokens == prompt
    assert whole.usage.cache_read_input_tokens is None
    assert "cache_read_input_tokens" not in whole.usage.model_fields_set


async def key_tokens(url: str, label: str, want: str) -> str:
    """The scrape of ``/metrics`` once it holds ``want`` (a reply is counted as it ends,
    which may be just after its client has read its last byte)."""
    async with asyncio.timeout(10), aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            if want in text:
                return text
            await asyncio.sleep(0.05)


async def test_the_cached_prompt_tokens_are_counted_per_key_once_per_reply():
    """``replystream_key_tokens_total{kind="cached_prompt"}``: of each reply's prompt tokens,
    those its upstream's cache held: a streamed reply, a whole one, and one of two choices
    (counted once, as its usage does)."""
    auth = {"Authorization": "Bearer k1"}
    async with relay(
        [Upstream(["m"], usage=cached(8))], server=ServerConfig(api_keys=("k1",))
    ) as url:
        chat = {"messages": ASK, "stream": True}
        await post_events(f"{url}/v1/chat/completions", chat, headers=auth)
        await post_events(f"{url}/v1/chat/completions", {**chat, "stream": False}, headers=auth)
        await post_events(f"{url}/v1/chat/completions", {**chat, "n": 2}, headers=auth)
        label = hashlib.sha256(b"k1").hexdigest()[:12]
        series = f'replystream_key_tokens_total{{key="{label}",kind="%s"}} %s'
        text = await key_tokens(url, label, series % ("cached_prompt", "24.0"))
    assert series % ("prompt", "33.0") in text  # 11 each: the cached 8 are among them
    assert series % ("completion", "12.0") in text


async def test_a_reply_with_nothing_cached_counts_none_cached():
    async with relay([Upstream(["m"])]) as url:
        await post_events(f"{url}/v1/chat/completions", {"messages": ASK, "stream": False})
        series = 'replystream_key_tokens_total{key="anonymous",kind="%s"} %s'
        text = await key_tokens(url, "anonymous", series % ("prompt", "11.0"))
    assert series % ("cached_prompt", "0.0") in text
