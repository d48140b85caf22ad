"""``POST /v1/messages/count_tokens`` through the official anthropic SDK, on a real server.

The count is the prompt's size as the message with the same input would report it in its
``message_start`` (``usage.input_tokens``): on every engine that can count a prompt before
answering it, for text, a system prompt, tools, a tool-use history and a prefill. A count is
no reply: nothing is admitted into the engine, nothing counted in the reply metrics. Bad
input is refused as ``/v1/messages`` refuses it, in Anthropic's shape; a relay, which cannot
know its upstream's count before the upstream answers, refuses to guess.
"""

from __future__ import annotations

import json
import logging

import aiohttp
import anthropic
import pytest
from anthropic.types import MessageTokensCount

from replystream.engine.gguf_engine import load_gguf_engine
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.anthropic_counts import (
    ANSWERED,
    CALLED,
    INPUTS,
    TOOLS,
    USER,
    assert_agree,
    counts_and_starts,
    sdk,
)
from tests.chat_upstream import CountingUpstream
from tests.conftest import fast_engine
from tests.services import require_smollm2
from tests.templated_tiny import TEMPLATE_RENDERING, tiny_with_template


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(fast_engine, id="simulated"),
        pytest.param(load_default_engine, id="tiny"),
        pytest.param(tiny_with_template, id="tiny-with-chat-template"),
    ],
)
async def test_the_count_is_what_message_start_reports_for_the_same_input(engine):
    engine = engine()
    found = await counts_and_starts(engine)
    assert_agree(found)
    if isinstance(engine, TinyEngine):
        # Offered tools are not part of these models' prompts (they make no calls): the
        # count holds what the model reads, no more.
        assert found["tools"][0] == found["text"][0]
    assert engine.stats().started == len(INPUTS)  # the messages: no count started one


async def test_the_tiny_engines_count_is_its_chat_templates_tokens_not_the_texts():
    engine = tiny_with_template()
    async with running(create_app(engine)) as url, sdk(url) as client:
        counted = await client.messages.count_tokens(model="tiny", messages=[USER])
    # The template's system prompt and role markers are tokens the model reads.
    rendered = TEMPLATE_RENDERING.format(text=USER["content"])
    assert counted.input_tokens == len(engine.tokenizer.encode(rendered))
    assert counted.input_tokens > engine.count_tokens(f"user: {USER['content']}") + 5


async def test_smollm2_counts_what_its_message_start_reports():
    engine, _ = load_gguf_engine(require_smollm2(), TinyEngineConfig(num_blocks=64), "smollm2")
    found = await counts_and_starts(engine)
    assert_agree(found)
    # Its chat template's markers and default system prompt are counted too.
    assert found["text"][0] > engine.count_tokens(str(USER["content"])) + 5


async def test_a_count_admits_nothing_and_is_no_reply_in_metrics_or_the_access_log(caplog):
    caplog.set_level(logging.INFO, logger="replystream.access")
    engine = fast_engine()
    async with running(create_app(engine)) as url, sdk(url) as client:
        for ask in INPUTS.values():
            await client.messages.count_tokens(model="simulated", **ask)
        assert engine.stats().started == 0
        # One message beside them: the one reply the metrics count.
        await client.messages.create(model="simulated", max_tokens=2, messages=[USER])
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            metrics = await response.text()
    assert engine.stats().started == 1
    assert "count_tokens" not in metrics
    replies = [
        line for line in metrics.splitlines() if line.startswith("replystream_replies_total")
    ]
    assert replies == ['replystream_replies_total{endpoint="/v1/messages",outcome="finished"} 1.0']
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    counted = [line for line in lines if line["path"] == "/v1/messages/count_tokens"]
    assert len(counted) == len(INPUTS)
    assert all(line["status"] == 200 and line["reply_id"] is None for line in counted)


async def test_the_answer_is_anthropics_object_and_nothing_else():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        body = {"model": "simulated", "system": "be brief", "messages": [USER]}
        async with http.post(f"{url}/v1/messages/count_tokens", json=body) as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            answer = await response.json()
    assert answer == {
        "input_tokens": len("system: be brief\nuser: What is the weather in Paris?".split())
    }


async def test_keys_are_checked_as_on_messages():
    app = create_app(fast_engine(), ServerConfig(api_keys=("key-a",)))
    async with running(app) as url, sdk(url, "key-a") as good, sdk(url, "wrong") as bad:
        assert (await good.messages.count_tokens(model="simulated", messages=[USER])).input_tokens
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await bad.messages.count_tokens(model="simulated", messages=[USER])
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": refused.value.body["error"]["message"],  # type: ignore[index]
            "code": "invalid_api_key",
            "param": None,
        },
        "request_id": refused.value.request_id,
    }


ONE_CALL_ANSWERED_TWICE = [
    USER,
    CALLED,
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rainy"},
        ],
    },
]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "simulated"}, 400, "missing_required_parameter", "messages"),
        ({"messages": [USER]}, 400, "missing_required_parameter", "model"),
        ({"model": "simulated", "messages": []}, 400, "invalid_value", "messages"),
        (
            {"model": "simulated", "messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_value",
            "messages[0].role",
        ),
        (
            {"model": "simulated", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "invalid_value",
            "messages[0].content[0]",
        ),
        (
            {
                "model": "simulated",
                "messages": [{"role": "user", "content": [CALLED["content"][2]]}],
            },
            400,
            "invalid_value",
            "messages[0].content",
        ),
        (
            {"model": "simulated", "messages": [ANSWERED]},
            400,
            "invalid_value",
            "messages[0].content[0]",
        ),
        (
            {"model": "simulated", "messages": ONE_CALL_ANSWERED_TWICE},
            400,
            "invalid_value",
            "messages[2].content[1]",
        ),
        (
            {
                "model": "simulated",
                "messages": [USER],
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
            },
            400,
            "invalid_value",
            "tools[0].input_schema",
        ),
        (
            {
                "model": "simulated",
                "messages": [USER],
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "other"},
            },
            400,
            "invalid_value",
            "tool_choice",
        ),
        # This engine makes no tool calls: a forced one is refused, not counted.
        (
            {
                "model": "simulated",
                "messages": [USER],
                "tools": TOOLS,
                "tool_choice": {"type": "any"},
            },
            400,
            "unsupported_parameter",
            "tool_choice",
        ),
        (
            {
                "model": "simulated",
                "messages": [USER],
                "thinking": {"type": "enabled", "budget_tokens": 100},
            },
            400,
            "invalid_value",
            "thinking.budget_tokens",
        ),
        # What Anthropic refuses with thinking on that is the input's own: a forced call, a
        # reply begun for the model (a count was taken where the message was refused).
        (
            {
                "model": "simulated",
                "messages": [USER],
                "tools": TOOLS,
                "tool_choice": {"type": "any"},
                "thinking": {"type": "adaptive"},
            },
            400,
            "invalid_value",
            "tool_choice",
        ),
        (
            {
                "model": "simulated",
                "messages": [USER, {"role": "assistant", "content": "It is"}],
                "thinking": {"type": "adaptive"},
            },
            400,
            "invalid_value",
            "messages[1]",
        ),
        (
            {"model": "simulated", "messages": [{"role": "user", "content": "x" * 200}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
        ({"model": "other", "messages": [USER]}, 404, "model_not_found", "model"),
    ],
)
async def test_bad_input_is_refused_as_messages_refuses_it_in_anthropics_shape(
    body, status, code, param
):
    app = create_app(fast_engine(), ServerConfig(max_prompt_chars=100))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages/count_tokens", json=body) as response:
            assert response.status == status
            counted = await response.json()
            assert counted.pop("request_id") == response.headers["request-id"]
        async with http.post(f"{url}/v1/messages", json={**body, "max_tokens": 5}) as response:
            assert response.status == status
            messaged = await response.json()
            assert messaged.pop("request_id") == response.headers["request-id"]
        async with sdk(url) as client:
            with pytest.raises(anthropic.APIStatusError) as raised:
                # The SDK's own request (``count_tokens`` checks its arguments first).
                await client.post(
                    "/v1/messages/count_tokens", cast_to=MessageTokensCount, body=body
                )
    assert counted == messaged  # the same refusal, word for word
    assert counted["type"] == "error"
    error = counted["error"]
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert (error["type"], error["code"], error["param"]) == (kind, code, param)
    assert raised.value.status_code == status
    assert raised.value.body == {**counted, "request_id": raised.value.request_id}


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 5), ("stream", True), ("temperature", 0.5), ("stop_sequences", ["x"])],
)
async def test_a_field_that_shapes_only_the_reply_is_refused_as_anthropic_refuses_it(field, value):
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.messages.count_tokens(
                model="simulated",
                messages=[USER],
                extra_body={field: value},
            )
    error = raised.value.body["error"]  # type: ignore[index]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "unknown_parameter",
        field,
    )


async def test_thinking_is_taken_without_max_tokens_and_leaves_the_prompt_as_it_is():
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        plain = await client.messages.count_tokens(model="simulated", messages=[USER])
        thinking = await client.messages.count_tokens(
            model="simulated",
            messages=[USER],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert thinking.input_tokens == plain.input_tokens


async def test_a_relay_refuses_to_guess_its_upstreams_count():
    upstream = CountingUpstream()
    async with running(upstream.app()) as upstream_url:
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), health_s=600.0)
        )
        try:
            async with running(create_app(engine)) as url, sdk(url) as client:
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await client.messages.count_tokens(model="m", messages=[USER])
                assert upstream.chats == 0
                message = await client.messages.create(model="m", max_tokens=5, messages=[USER])
        finally:
            await engine.aclose()
    error = refused.value.body["error"]  # type: ignore[index]
    assert (error["type"], error["code"]) == ("invalid_request_error", "count_unavailable")
    assert "estimate" in error["message"]
    assert engine.stats().started == 1 and upstream.chats == 1
    assert message.content[0].type == "text" and message.content[0].text == "sunny"
