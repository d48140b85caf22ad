"""The official openai SDK, unchanged, against the real server on a loopback socket."""

import asyncio
import json
import logging

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.stalling_proxy import (
    host_port,
    proxy_stalling_its_first_connection,
    server_cutting_stalled_readers,
)

REPLY = "one two three four five six seven eight nine ten"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "count"},
]


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sync_sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_async_chat_streamed_text_equals_whole_text_and_usage_matches():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.chat.completions.create(
            model="simulated", messages=MESSAGES, seed=3, max_tokens=7
        )
        stream = await client.chat.completions.create(
            model="simulated",
            messages=MESSAGES,
            seed=3,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert whole.object == "chat.completion"
    assert whole.model == "simulated"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == "one two three four five six seven "
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 7)
    # First the role, then text, then the finish reason, then the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].id.startswith("chatcmpl-")


async def test_sync_chat_and_legacy_completions_work_unchanged():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url:

        def calls() -> tuple[str, str, str, str, list[str]]:
            with sync_sdk(url) as client:
                chat = client.chat.completions.create(model="simulated", messages=MESSAGES, seed=1)
                streamed = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in client.chat.completions.create(
                        model="simulated", messages=MESSAGES, seed=1, stream=True
                    )
                    if chunk.choices
                )
                legacy = client.completions.create(model="simulated", prompt="count", max_tokens=4)
                legacy_chunks = list(
                    client.completions.create(
                        model="simulated", prompt="count", max_tokens=4, stream=True
                    )
                )
                models = [m.id for m in client.models.list()]
            assert chat.choices[0].message.content is not None
            assert legacy.object == "text_completion"
            assert legacy.choices[0].finish_reason == "length"
            legacy_text = "".join(c.choices[0].text for c in legacy_chunks)
            return (
                chat.choices[0].message.content,
                streamed,
                legacy.choices[0].text,
                legacy_text,
                models,
            )

        chat, streamed, legacy, legacy_streamed, models = await asyncio.to_thread(calls)
    assert chat == streamed == REPLY + " "
    assert legacy == legacy_streamed == "one two three four "
    assert models == ["simulated"]


async def test_async_legacy_completion_defaults_to_16_tokens_and_streams_usage():
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        whole = await client.completions.create(model="simulated", prompt="hi there", seed=2)
        stream = await client.completions.create(
            model="simulated",
            prompt="hi there",
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage


async def test_model_is_named_by_the_server_option():
    config = ServerConfig(model_name="replystream-small")
    async with running(create_app(fast_engine(), config)) as url, sdk(url) as client:
        models = [m.id async for m in client.models.list()]
        one = await client.models.retrieve("replystream-small")
        reply = await client.chat.completions.create(
            model="replystream-small", messages=MESSAGES, max_tokens=2
        )
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert models == ["replystream-small"] and one.id == "replystream-small"
    assert reply.model == "replystream-small"
    assert missing.value.code == "model_not_found"


async def test_error_mid_stream_raises_in_the_sdk_and_the_stream_has_no_done():
    engine = fast_engine(fail_after=3)
    async with running(create_app(engine)) as url:
        async with sdk(url) as client:
            stream = await client.chat.completions.create(
                model="simulated", messages=MESSAGES, stream=True
            )
            got: list[str] = []
            with pytest.raises(openai.APIError, match="simulated failure"):
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
        assert "".join(got) == "A language model "
        async with aiohttp.ClientSession() as http:
            body = {"model": "simulated", "messages": MESSAGES, "stream": True}
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                raw = await response.text()
    assert "[DONE]" not in raw
    last = raw.strip().split("\n")[-1]
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["code"] == "generation_failed" and error["type"] == "server_error"


async def test_moderated_reply_ends_with_content_filter():
    policy = DeliveryPolicy(holdback_tokens=3, checks=(BannedPhrases(["five six"]),))
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url, sdk(url) as client:
        stream = await client.chat.completions.create(
            model="simulated", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in stream]
        whole = await client.chat.completions.create(model="simulated", messages=MESSAGES)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "five" not in text and text.startswith("one two")
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert chunks[-1].model_dump()["replystream_moderation"]["check"] == "banned_phrase"
    assert whole.model_dump()["replystream_moderation"]["check"] == "banned_phrase"
    assert whole.choices[0].finish_reason == "content_filter"
    assert "six" not in (whole.choices[0].message.content or "")


async def test_keepalive_comments_do_not_break_the_sdk():
    policy = DeliveryPolicy(keepalive_s=0.02)
    engine = fast_engine(reply_text=REPLY, delay_ms=60, jitter_ms=0)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url, sdk(url) as client:
        stream = await client.chat.completions.create(
            model="simulated", messages=MESSAGES, stream=True, max_tokens=4
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "one two three four "


async def test_streamed_reply_is_named_for_resume_and_cancel():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        body = {"messages": MESSAGES, "stream": True, "max_tokens": 2, "batch_tokens": 2}
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            reply_id = response.headers["X-Reply-Id"]
            raw = await response.text()
        first = json.loads(raw.split("data: ", 1)[1].split("\n", 1)[0])
        assert first["id"] == f"chatcmpl-{reply_id}"
        # Two tokens in one batch: role, one text chunk, finish, [DONE].
        assert raw.count("data: ") == 4 and raw.rstrip().endswith("data: [DONE]")
        async with http.post(f"{url}/v1/chat/completions", json={**body, "stream": False}) as got:
            assert got.headers["X-Reply-Id"]


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_slow_client_cut_is_the_same_error_object_as_an_engine_failure(route, caplog):
    # The reader decides this ending alone (it is not in the log); the SDK's APIError still
    # has the type and the code an engine failure's has.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    app = server_cutting_stalled_readers()
    release = asyncio.Event()
    async with running(app) as url:
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            async with sdk(proxied) as client:

                async def read() -> None:
                    if route == "chat":
                        chunks = await client.chat.completions.create(
                            model="simulated", messages=MESSAGES, stream=True
                        )
                    else:
                        chunks = await client.completions.create(  # type: ignore[assignment]
                            model="simulated", prompt="count", max_tokens=1000, stream=True
                        )
                    async for _ in chunks:
                        pass

                reading = asyncio.ensure_future(read())
                await wait_for(
                    lambda: any("cut: socket" in r.getMessage() for r in caplog.records),
                    timeout_s=30,
                )
                release.set()
                with pytest.raises(openai.APIError) as raised:
                    async with asyncio.timeout(30):
                        await reading
    error = raised.value
    assert (error.type, error.code, error.param) == ("server_error", "slow_client", None)
    assert error.body == {
        "message": error.message,
        "type": "server_error",
        "param": None,
        "code": "slow_client",
    }


WEATHER_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


async def test_the_sdk_helpers_messages_go_back_as_history_unchanged():
    """The tool loop as the SDK's helpers make it: the message ``stream(...)``'s final
    completion and ``parse(...)`` return is appended to the messages as it is, with the
    fields the SDK adds (``annotations``, ``audio``, ``function_call``, ``parsed``, and
    ``parsed_arguments`` on each call), and the next request is answered."""
    script = [
        {"text": "Checking. "},
        {"tool_call": {"name": "get_weather", "id": "call_1", "arguments": '{"city": "Paris"}'}},
    ]
    engine = simulated_engine(
        SimulatedConfig(delay_ms=5.0, jitter_ms=1.0, script=parse_reply_script(script))
    )
    async with running(create_app(engine)) as url, sdk(url) as client:
        async with client.chat.completions.stream(
            model="simulated", messages=MESSAGES, tools=[WEATHER_TOOL]
        ) as stream:
            streamed = (await stream.get_final_completion()).choices[0].message
        parsed = (
            (await client.chat.completions.parse(model="simulated", messages=MESSAGES))
            .choices[0]
            .message
        )
        assert streamed.tool_calls and streamed.tool_calls[0].id == "call_1"
        answer: ChatCompletionMessageParam = {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "sunny",
        }
        again: ChatCompletionMessageParam = {"role": "user", "content": "and?"}
        # parse(...)'s reply made the script's call too: answered, as chat requires.
        sent = [*MESSAGES, streamed, answer, again, parsed, answer, again]
        after = await client.chat.completions.create(
            model="simulated",
            messages=sent,  # type: ignore[arg-type]  # the SDK's own message objects among them
            tools=[WEATHER_TOOL],
            max_tokens=2,
        )
    assert after.choices[0].finish_reason in ("length", "tool_calls", "stop")


async def test_a_route_this_server_lacks_is_named_in_the_sdks_error():
    # OpenAI answers "Invalid URL (POST /v1/x)"; a bare "Not Found" left a client guessing
    # which of its calls the server lacks.
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.moderations.create(input="x")
        with pytest.raises(openai.APIStatusError) as wrong_method:
            await client.get("/chat/completions", cast_to=object)
    assert missing.value.body == {
        "message": "Not Found: POST /v1/moderations is not a route of this server",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    assert wrong_method.value.status_code == 405
    assert wrong_method.value.body["message"] == (  # type: ignore[index]
        "Method Not Allowed: /v1/chat/completions takes POST, not GET"
    )
