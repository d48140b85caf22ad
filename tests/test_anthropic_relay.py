"""``POST /v1/messages`` relayed to an OpenAI-compatible upstream, through the anthropic SDK:
how the upstream's ending and the request's tool results cross between the two dialects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, cast

import anthropic
import openai
import pytest
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream, RecordingUpstream, relaying_to

USER: Any = {"role": "user", "content": "What is the weather in Paris?"}


@asynccontextmanager
async def relayed(upstream: ChatUpstream) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """An SDK client of a server relaying to ``upstream``."""
    async with (
        relaying_to(upstream) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        yield client


@pytest.fixture
async def filtering() -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with relayed(RecordingUpstream("I can", finish_reason="content_filter")) as client:
        yield client


async def test_an_upstreams_filtered_reply_is_a_refusal_streamed_and_whole(
    filtering: anthropic.AsyncAnthropic,
):
    ask: Any = {"model": "m", "max_tokens": 5, "messages": [USER]}
    whole = await filtering.messages.create(**ask)
    async with filtering.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "refusal"
        assert [block.type for block in message.content] == ["text"]


async def test_a_failed_tools_result_reaches_the_upstream_marked_as_an_error():
    upstream = RecordingUpstream()
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timed out"}
    history: Any = [USER, {"role": "assistant", "content": [call]}]
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    async with relayed(upstream) as client:
        for is_error in (True, False):
            answer: Any = [{**result, "is_error": is_error}]
            await client.messages.create(
                model="m",
                max_tokens=5,
                tools=tools,
                messages=[*history, {"role": "user", "content": answer}],
            )
    told = [body["messages"][-1] for body in upstream.bodies]
    assert told == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timed out"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "timed out"},
    ]


class DeepCallUpstream(ChatUpstream):
    """Answers with one tool call whose arguments nest past the interpreter's recursion limit
    (as a model may write them: brackets until its token limit), closed or not."""

    def __init__(self, arguments: str) -> None:
        self.arguments = arguments

    async def chat(self, request: web.Request) -> web.StreamResponse:
        function = {"name": "get_weather", "arguments": self.arguments}
        call = {"index": 0, "id": "call_1", "type": "function", "function": function}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for body in (
            {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        ):
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.mark.parametrize("arguments", ["[" * 5000 + "]" * 5000, "[" * 5000], ids=["closed", "cut"])
async def test_tool_arguments_nested_past_the_recursion_limit_are_kept_as_their_text(
    arguments: str,
):
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    ask: Any = {"model": "m", "max_tokens": 50, "tools": tools, "messages": [USER]}
    async with relayed(DeepCallUpstream(arguments)) as client:
        whole = await client.messages.create(**ask)
    assert whole.stop_reason == "tool_use"
    assert [(block.type, getattr(block, "input", None)) for block in whole.content] == [
        ("tool_use", arguments)
    ]


async def test_a_tools_eager_input_streaming_is_taken_beside_strict_and_not_relayed():
    # Anthropic's tool definition has it (fine-grained tool streaming), and Vercel's AI SDK
    # sends it on every tool of a streamed request, with strict where the tool asks.
    upstream = RecordingUpstream()
    tools: Any = [
        {
            "name": "get_weather",
            "input_schema": {"type": "object"},
            "strict": True,
            "eager_input_streaming": True,
        },
        {"name": "get_time", "input_schema": {"type": "object"}, "eager_input_streaming": False},
    ]
    async with relayed(upstream) as client:
        ask: Any = {"model": "m", "max_tokens": 5, "tools": tools, "messages": [USER]}
        async with client.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
        whole = await client.messages.create(**ask)
    assert [block.text for block in (*streamed.content, *whole.content)] == ["sunny"] * 2
    relayed_tools = [
        {"name": "get_weather", "parameters": {"type": "object"}, "strict": True},
        {"name": "get_time", "parameters": {"type": "object"}},
    ]
    for body in upstream.bodies:  # the streamed message's, then the whole one's
        assert [tool["function"] for tool in body["tools"]] == relayed_tools
    assert len(upstream.bodies) == 2


class StallingUpstream(ChatUpstream):
    """Streams one piece of text, then nothing (a stalled model server)."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        piece = {"choices": [{"index": 0, "delta": {"content": "partial "}}]}
        await response.write(b"data: " + json.dumps(piece).encode() + b"\n\n")
        await asyncio.sleep(30)  # cut when the relay gives up on it
        return response


async def failed_whole_and_streamed(
    client: anthropic.AsyncAnthropic,
) -> tuple[anthropic.APIStatusError, anthropic.APIStatusError, list[str]]:
    """One message asked whole, then streamed, each failing: the two errors raised, and the
    text the stream relayed before its error."""
    ask: Any = {"model": "m", "max_tokens": 50, "messages": [USER]}
    with pytest.raises(anthropic.APIStatusError) as whole:
        await client.messages.create(**ask)
    texts: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as streamed:
        async with client.messages.stream(**ask) as stream:
            async for text in stream.text_stream:
                texts.append(text)
    return whole.value, streamed.value, texts


async def test_a_stalled_upstream_is_a_timeout_error_streamed_and_whole():
    """A relay's upstream that stalls mid-reply is Anthropic's ``timeout_error`` in the
    stream's ``error`` event, as the whole message's 504 is: one failure, one type."""
    upstream = StallingUpstream()
    async with running(upstream.app()) as upstream_url:
        config = UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), stall_s=0.3)
        engine = UpstreamEngine(config)
        try:
            async with (
                running(create_app(engine)) as url,
                anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client,
            ):
                whole, streamed, texts = await failed_whole_and_streamed(client)
        finally:
            await engine.aclose()
    assert whole.status_code == 504
    assert texts == ["partial "]  # the text before the stall was relayed
    for raised in (whole, streamed):
        error = cast(dict[str, Any], raised.body)["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "upstream_stalled")


class LimitsTheContinuation(StallingUpstream):
    """Streams one piece of a fresh reply, then stalls; rate-limits the key of a continued
    one (``continue_final_message``): a hosted API whose quota the reply's seam used up."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("continue_final_message"):
            error = {"message": "Rate limit reached for requests", "type": "requests"}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "7"})
        return await super().chat(request)


async def test_a_continued_reply_rate_limited_has_one_error_type_streamed_and_whole():
    """A relayed reply continued at another upstream after a stall, which rate-limits the
    caller's own key there: streamed, its in-band error has the type its whole reply's 429
    has (Anthropic's ``rate_limit_error``, OpenAI's ``requests``), not a server failure's."""
    upstreams = [LimitsTheContinuation(), LimitsTheContinuation()]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = tuple(UpstreamTarget(f"{u}/v1", pass_client_key=True) for u in urls)
        config = UpstreamConfig(targets, stall_s=0.3, continuation=True, failures=100)
        engine = UpstreamEngine(config)
        stack.push_async_callback(engine.aclose)
        url = await stack.enter_async_context(running(create_app(engine)))
        client = await stack.enter_async_context(
            anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        )
        whole, streamed, texts = await failed_whole_and_streamed(client)
        chat = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        )
        chat_ask: Any = {"model": "m", "messages": [USER]}
        with pytest.raises(openai.RateLimitError) as chat_whole:
            await chat.chat.completions.create(**chat_ask)
        with pytest.raises(openai.APIError) as chat_streamed:
            async for _ in await chat.chat.completions.create(**chat_ask, stream=True):
                pass
    assert isinstance(whole, anthropic.RateLimitError)
    assert texts == ["partial "]  # the text before the stall was relayed
    for raised in (whole, streamed):
        error = cast(dict[str, Any], raised.body)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "upstream_rate_limited")
    for chat_raised in (chat_whole.value, chat_streamed.value):
        assert (chat_raised.type, chat_raised.code) == ("requests", "upstream_rate_limited")
