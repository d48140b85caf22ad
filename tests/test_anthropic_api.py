"""``POST /v1/messages`` with the official anthropic SDK, unchanged, and over raw SSE."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import anthropic
import pytest
from anthropic.types import ThreadUnsupportedRequestError

from replystream.delivery.anthropic_format import ReaderNotices
from replystream.delivery.error_types import anthropic_error_type
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, wait_for
from tests.stalling_proxy import (
    host_port,
    proxy_stalling_its_first_connection,
    server_cutting_stalled_readers,
)

REPLY = "one two three four five six seven eight nine ten"
ASK = {
    "model": "simulated",
    "max_tokens": 64,
    "system": "be brief",
    "messages": [{"role": "user", "content": "count"}],
}


def sdk(url: str, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def test_the_stream_and_its_final_message_equal_the_whole_message():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.messages.create(**ASK)  # type: ignore[call-overload]
        async with client.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert whole.content[0].type == "text"
    assert whole.content[0].text == text == REPLY + " "
    assert (whole.stop_reason, final.stop_reason) == ("end_turn", "end_turn")
    assert [block.text for block in final.content if block.type == "text"] == [text]
    input_tokens = engine.count_tokens("system: be brief\nuser: count")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (input_tokens, 10)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (input_tokens, 10)


async def test_events_come_in_anthropic_order_each_with_an_id_to_resume_from():
    engine = fast_engine(reply_text=REPLY)
    body = {**ASK, "max_tokens": 3, "stream": True}
    app = create_app(engine, ServerConfig(resumable_by_default=True))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages", json=body) as response:
            reply_id = response.headers["X-Reply-Id"]
            events = EventParser().feed(await response.read())
        headers = {"Last-Event-ID": "3"}
        async with http.get(f"{url}/v1/replies/{reply_id}/stream", headers=headers) as again:
            rest = EventParser().feed(await again.read())
    kinds = [event.type for event in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for event in events:
        assert json.loads(event.data)["type"] == event.type
    start = json.loads(events[0].data)["message"]
    assert start["usage"]["input_tokens"] > 0 and start["content"] == []
    delta = json.loads(events[-2].data)
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 3
    assert [int(e.id or 0) for e in events] == list(range(1, len(events) + 1))
    assert [(e.type, e.data) for e in rest] == [(e.type, e.data) for e in events[3:]]


async def test_a_message_asked_resumable_is_resumed_by_its_event_ids():
    # On a server without --resumable-by-default, as chat's ``resumable`` asks it there.
    engine = fast_engine(reply_text=REPLY)
    body = {**ASK, "max_tokens": 6, "stream": True}
    asked = {**body, "replystream": {"resumable": True}}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        rests = []
        for ask in (asked, body):
            async with http.post(f"{url}/v1/messages", json=ask) as response:
                reply_id = response.headers["X-Reply-Id"]
                head = b""
                while head.count(b"\n\n") < 3:  # message_start, the block's start, a delta
                    head += await response.content.readany()
            headers = {"Last-Event-ID": "3"}
            stream = f"{url}/v1/replies/{reply_id}/stream"
            async with http.get(stream, headers=headers) as again:
                rests.append((again.status, await again.read()))
        whole = {**ASK, "stream": False, "replystream": {"resumable": True}}
        async with http.post(f"{url}/v1/messages", json=whole) as response:
            refused = (response.status, (await response.json())["error"]["param"])
    (status, rest), (not_kept, _) = rests
    events = EventParser().feed(rest)
    assert status == 200 and not_kept == 404
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    texts = [json.loads(e.data)["delta"]["text"] for e in events if e.type == "content_block_delta"]
    assert "".join(texts) == "two three four five six "  # after the delta holding "one "
    assert refused == (400, "replystream.resumable")


async def test_an_engine_failure_mid_stream_is_anthropics_error_event():
    engine = fast_engine(reply_text=REPLY, fail_after=3)
    async with running(create_app(engine)) as url, sdk(url) as client:
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with client.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
                async for _ in stream:
                    pass
    assert "generation_failed" in str(raised.value.body) or "failed" in str(raised.value)


async def test_an_idle_stream_is_kept_alive_with_ping_events_after_message_start():
    # Idle before the first token (message_start waits for it) and between the two tokens:
    # comments keep the stream open before message_start, which Anthropic sends first; pings
    # after it.
    engine = fast_engine(reply_text=REPLY, first_token_ms=700.0, delay_ms=600.0, jitter_ms=0.0)
    policy = DeliveryPolicy(keepalive_s=0.2)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        async with aiohttp.ClientSession() as http:
            body = {**ASK, "max_tokens": 2, "stream": True}
            async with http.post(f"{url}/v1/messages", json=body) as response:
                raw = await response.read()
        async with sdk(url) as client:
            whole = await client.messages.create(**{**ASK, "max_tokens": 2})  # type: ignore[call-overload]
    events = EventParser().feed(raw)
    assert raw.startswith(b": keep-alive\n\n")
    assert events[0].type == "message_start"
    pings = [e for e in events if e.type == "ping"]
    assert pings and all(json.loads(e.data) == {"type": "ping"} for e in pings)
    assert events[-1].type == "message_stop"
    assert whole.content[0].type == "text"


async def test_keys_are_read_from_x_api_key_and_errors_are_the_sdks_own_classes():
    app = create_app(fast_engine(reply_text=REPLY), ServerConfig(api_keys=("key-a",)))
    async with running(app) as url:
        async with sdk(url, "key-a") as good, sdk(url, "wrong") as bad:
            assert (await good.messages.create(**ASK)).stop_reason == "end_turn"  # type: ignore[call-overload]
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(**ASK)  # type: ignore[call-overload]
            with pytest.raises(anthropic.NotFoundError) as missing:
                await good.messages.create(**{**ASK, "model": "other"})  # type: ignore[call-overload]
            with pytest.raises(anthropic.BadRequestError) as refused:
                await good.messages.create(  # type: ignore[call-overload]
                    **ASK, tools=[{"name": "f", "input_schema": {"type": "string"}}]
                )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    error = refused.value.body["error"]  # type: ignore[index]
    assert (error["type"], error["param"]) == ("invalid_request_error", "tools[0].input_schema")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "simulated", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({**ASK, "messages": []}, "messages"),
        ({**ASK, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({**ASK, "temperature": 1.5}, "temperature"),
        ({**ASK, "stop_sequences": [""]}, "stop_sequences[0]"),
        ({**ASK, "stop_sequences": ["end", "\n\t "]}, "stop_sequences[1]"),
        ({**ASK, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, None),
        ({**ASK, "service_tier": "priority"}, "service_tier"),
        # Anthropic's tool_choice none is its type alone: no tool is called, none in parallel.
        (
            {**ASK, "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
            "tool_choice.disable_parallel_tool_use",
        ),
        # The API's own fields under their extension names too: one of the two would be
        # ignored.
        (
            {**ASK, "stop_sequences": ["four"], "replystream": {"stop": "two"}},
            "replystream.stop",
        ),
        ({**ASK, "top_k": 1, "replystream": {"top_k": 5}}, "replystream.top_k"),
        # A server tool has no input_schema: it is refused by its type.
        (
            {**ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0].type",
        ),
    ],
)
async def test_bad_requests_are_400s_in_anthropics_shape_naming_the_field(body, param):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages", json=body) as response:
            answer = await response.json()
            assert response.status == 400, answer
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert answer["error"]["param"] == param


THINKING = {**ASK, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
ADAPTIVE = {**ASK, "thinking": {"type": "adaptive"}}
FORCED = {"type": "tool", "name": "f"}
TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
PREFILL = {"role": "assistant", "content": "I"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**THINKING, "temperature": 0.5}, "temperature"),
        ({**ADAPTIVE, "temperature": 0}, "temperature"),
        ({**THINKING, "top_p": 0.9}, "top_p"),
        ({**THINKING, "top_k": 5}, "top_k"),
        ({**THINKING, "replystream": {"top_k": 5}}, "replystream.top_k"),
        ({**THINKING, "tools": TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({**ADAPTIVE, "tools": TOOLS, "tool_choice": FORCED}, "tool_choice"),
        (
            {**THINKING, "messages": [{"role": "user", "content": "count"}, PREFILL]},
            "messages[1]",
        ),
        (
            {**ASK, "thinking": {"type": "adaptive", "budget_tokens": 1024}},
            "thinking.budget_tokens",
        ),
        ({**ASK, "thinking": {"type": "disabled", "display": "omitted"}}, "thinking.display"),
        ({**ADAPTIVE, "thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
    ],
)
async def test_what_anthropic_refuses_with_thinking_on_is_refused(body, param):
    """Thinking on (``enabled`` or ``adaptive``), Anthropic's API takes the model's own
    sampling only (temperature 1, top_p from 0.95, no top_k), no forced tool use, and no
    reply begun for it."""
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages", json=body) as response:
            answer = await response.json()
            assert response.status == 400, answer
    assert (answer["error"]["type"], answer["error"]["param"]) == ("invalid_request_error", param)


async def test_thinking_on_takes_what_anthropic_allows_with_it():
    allowed = [
        {**THINKING, "temperature": 1, "top_p": 0.95},
        {**ADAPTIVE, "tools": TOOLS, "tool_choice": {"type": "auto"}},
        {**THINKING, "thinking": {"type": "disabled"}, "temperature": 0.5, "top_k": 5},
        {**ADAPTIVE, "thinking": {"type": "adaptive", "display": "summarized"}},
        {**THINKING, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": None}},
    ]
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for body in allowed:
            async with http.post(f"{url}/v1/messages", json=body) as response:
                message = await response.json()
                assert response.status == 200, (body, message)
            assert message["stop_reason"] == "end_turn", body


async def test_automatic_prompt_caching_is_taken_as_the_hint_it_is():
    """Anthropic's request-wide ``cache_control`` was an unknown field, where a block's own
    was taken: the SDK sends either."""
    hint = {"cache_control": {"type": "ephemeral"}}
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        message = await client.messages.create(**ASK, extra_body=hint)  # type: ignore[call-overload]
        count = await client.messages.count_tokens(
            model="simulated", messages=[{"role": "user", "content": "count"}], extra_body=hint
        )
    assert message.stop_reason == "end_turn" and count.input_tokens > 0


async def test_stop_sequences_and_top_k_are_a_reply_not_a_500():
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        message = await client.messages.create(  # type: ignore[call-overload]
            **ASK, stop_sequences=["four"], extra_body={"top_k": 5}
        )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "four")
    assert message.content[0].type == "text" and message.content[0].text == "one two three "


async def test_a_slow_client_cut_is_anthropics_error_event(caplog):
    # The reader decides this ending alone (it is not in the log): it is still spelt as the
    # producer's errors are, Anthropic's error object with our code beside its type.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    app = server_cutting_stalled_readers()
    release = asyncio.Event()
    async with running(app) as url:
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            async with sdk(proxied) as client:

                async def read() -> list[str]:
                    ask = {**ASK, "max_tokens": 1000}
                    async with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
                        return [event.type async for event in stream]

                reading = asyncio.ensure_future(read())
                await wait_for(
                    lambda: any("cut: socket" in r.getMessage() for r in caplog.records),
                    timeout_s=30,
                )
                release.set()
                with pytest.raises(anthropic.APIStatusError) as raised:
                    async with asyncio.timeout(30):
                        await reading
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert (body["error"]["type"], body["error"]["code"]) == ("api_error", "slow_client")
    assert "did not drain" in body["error"]["message"]


async def test_either_service_tier_is_served_by_the_one_capacity_there_is():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        for tier in ("auto", "standard_only"):
            message = await client.messages.create(**ASK, service_tier=tier)  # type: ignore[call-overload]
            async with client.messages.stream(**ASK, service_tier=tier) as stream:  # type: ignore[arg-type]
                streamed = await stream.get_final_message()
            assert message.stop_reason == streamed.stop_reason == "end_turn"
            assert message.model_dump(exclude={"id"}) == streamed.model_dump(exclude={"id"})


async def test_a_final_assistant_message_is_prefilled_text_the_reply_goes_on_from():
    """Anthropic's prefill: the reply continues the final assistant message; it does not
    start over (the simulated engine goes on from as many words in)."""
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        prefilled = await client.messages.create(
            model="simulated",
            max_tokens=3,
            messages=[
                {"role": "user", "content": "count"},
                {"role": "assistant", "content": "one two three four"},
            ],
        )
    assert [b.text for b in prefilled.content if b.type == "text"] == ["five six seven "]


async def test_a_received_message_saved_whole_goes_back_as_history():
    """A client that keeps the SDK's message as JSON (``model_dump``) sends its text blocks
    back with every field the API gave them, ``citations: null`` among them."""
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        first = await client.messages.create(**ASK)  # type: ignore[call-overload]
        saved = [block.model_dump() for block in first.content]
        assert "citations" in saved[0]
        history = [*ASK["messages"], {"role": "assistant", "content": saved}]  # type: ignore[misc]
        after = await client.messages.create(  # type: ignore[call-overload]
            **{**ASK, "messages": [*history, {"role": "user", "content": "again"}]}
        )
    assert after.content[0].type == "text"


async def test_the_request_id_is_where_the_sdk_reads_it_and_a_large_body_is_its_413():
    app = create_app(fast_engine(reply_text=REPLY), ServerConfig(max_body_bytes=4096))
    async with running(app) as url, sdk(url) as client:
        raw = await client.messages.with_raw_response.create(**ASK)  # type: ignore[call-overload]
        message = await raw.parse()
        with pytest.raises(anthropic.RequestTooLargeError) as too_large:
            await client.messages.create(  # type: ignore[call-overload]
                **{**ASK, "messages": [{"role": "user", "content": "x" * 5000}]}
            )
    assert message._request_id == raw.headers["X-Request-Id"]
    body = too_large.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "request_too_large"
    assert too_large.value.request_id == body["request_id"] is not None


WEATHER_CALL = [
    {"text": "Checking. "},
    {"tool_call": {"name": "get_weather", "id": "toolu_1", "arguments": ['{"city":', ' "Paris"}']}},
]


async def test_the_sdks_tool_runner_runs_its_loop_without_a_thread_this_server_cannot_hold():
    """The SDK's tool loop (``beta.messages.tool_runner``) asks the server to hold the
    conversation (``thread``) unless told not to. Refused as Anthropic's API refuses a request
    it cannot thread (``details.error_code: thread_unsupported_request``), the SDK goes on
    without one, sending the whole history each turn; refused as an unknown field, its loop
    failed on its first request."""
    script = parse_reply_script(WEATHER_CALL)
    engine = simulated_engine(SimulatedConfig(delay_ms=2.0, jitter_ms=1.0, script=script))
    asked: list[str] = []

    @anthropic.beta_async_tool
    async def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    async with running(create_app(engine)) as url, sdk(url) as client:
        runner = client.beta.messages.tool_runner(
            model="simulated",
            max_tokens=64,
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=[get_weather],
            max_iterations=2,
        )
        replies = [message async for message in runner]
        # Asked for a thread directly, the SDK's own error class says why there is none.
        with pytest.raises(ThreadUnsupportedRequestError) as refused:
            await client.beta.messages.create(  # type: ignore[call-overload]
                **ASK, thread={"type": "create"}
            )
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    assert asked == ["Paris", "Paris"]
    assert refused.value.status_code == 400
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["details"] == {"error_code": "thread_unsupported_request"}
    assert error["param"] == "thread"


def test_a_store_out_of_reach_is_overloaded_mid_stream_as_its_503_is_before_one():
    # A reader that cannot reach the reply store (Redis down) ends its stream in-band; asked
    # before a stream, the same failure is a 503, Anthropic's 529: one type either way, so a
    # client retries it as it retries an overload.
    lost = {"message": "the reply store is unavailable", "code": "replay_store_unavailable"}
    [(kind, data)] = ReaderNotices()("error", json.dumps({"error": lost}), 4)
    assert kind == "error"
    error = json.loads(data)["error"]
    assert (error["type"], error["code"]) == ("overloaded_error", "replay_store_unavailable")
    assert anthropic_error_type(503) == error["type"]
