"""``POST /v1/responses/input_tokens`` through the official openai SDK, on a real server.

The count is the prompt's size as the response to the same request reports it in its
``usage.input_tokens``: on every engine that can count a prompt before answering it, for
string and item input, instructions, tools, a function call history and a
``previous_response_id``. A count is no reply: nothing is admitted into the engine, nothing
counted in the reply metrics. Bad input is refused as ``POST /v1/responses`` refuses it, in
OpenAI's shape; a relay, which cannot know its upstream's count before the upstream answers,
refuses to guess.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import InputTokenCountResponse, Response

from replystream.engine.base import Engine
from replystream.engine.gguf_engine import load_gguf_engine
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.chat_upstream import CountingUpstream
from tests.conftest import fast_engine
from tests.services import require_smollm2
from tests.templated_tiny import tiny_with_template

QUESTION = "What is the weather in Paris?"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
ASKED = {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
CALLED = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
ANSWERED = {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}
# Each a request's prompt, as both routes take it (a response adds what shapes the reply).
INPUTS: dict[str, dict[str, Any]] = {
    "text": {"input": QUESTION},
    "items": {"input": [ASKED]},
    "instructions": {"instructions": "You are brief.", "input": QUESTION},
    "tools": {"input": QUESTION, "tools": TOOLS, "tool_choice": "auto"},
    "call history": {
        "instructions": "You are brief.",
        "input": [ASKED, CALLED, ANSWERED, {"role": "user", "content": "And tomorrow?"}],
        "tools": TOOLS,
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "truncation": "disabled",
    },
}
FOLLOW_UP: dict[str, Any] = {"instructions": "Answer in French.", "input": "And tomorrow?"}


def sdk(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def reported_input_tokens(client: openai.AsyncOpenAI, ask: dict[str, Any]) -> int:
    """The ``usage.input_tokens`` of the response to ``ask`` (kept out of the store)."""
    response: Response = await client.responses.create(**ask, max_output_tokens=2, store=False)
    assert response.usage is not None
    return response.usage.input_tokens


async def counts_and_usages(engine: Engine) -> dict[str, tuple[int, int]]:
    """Per input of ``INPUTS`` and for a follow-up of a stored response: its count, and its
    response's ``usage.input_tokens``."""
    found = {}
    async with running(create_app(engine)) as url, sdk(url) as client:
        for name, ask in INPUTS.items():
            ask = {**ask, "model": engine.name}
            counted = await client.responses.input_tokens.count(**ask)
            assert counted.object == "response.input_tokens"
            found[name] = (counted.input_tokens, await reported_input_tokens(client, ask))
        first = await client.responses.create(
            model=engine.name, instructions="You are brief.", input=QUESTION, max_output_tokens=3
        )
        follow_up = {**FOLLOW_UP, "model": engine.name, "previous_response_id": first.id}
        counted = await client.responses.input_tokens.count(**follow_up)
        found["previous response"] = (
            counted.input_tokens,
            await reported_input_tokens(client, follow_up),
        )
        # Without input: where the conversation is (its history, and these instructions),
        # which no response can report (a response needs input): less than with the input.
        alone = await client.responses.input_tokens.count(
            model=engine.name,
            previous_response_id=first.id,
            instructions=FOLLOW_UP["instructions"],
        )
        assert 0 < alone.input_tokens < counted.input_tokens
    return found


def assert_agree(found: dict[str, tuple[int, int]]) -> None:
    for name, (counted, reported) in found.items():
        assert counted == reported > 0, name
    counts = {name: counted for name, (counted, _) in found.items()}
    # Each part of the prompt is in the count: instructions (in place of a template's default
    # system prompt, which may be longer), the history, the previous response's turn.
    assert counts["instructions"] != counts["text"]
    assert counts["call history"] > counts["instructions"]
    assert counts["previous response"] > counts["instructions"]


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(fast_engine, id="simulated"),
        pytest.param(load_default_engine, id="tiny"),
        pytest.param(tiny_with_template, id="tiny-with-chat-template"),
    ],
)
async def test_the_count_is_the_input_tokens_the_same_requests_response_reports(engine):
    engine = engine()
    found = await counts_and_usages(engine)
    assert_agree(found)
    counts = {name: counted for name, (counted, _) in found.items()}
    assert counts["items"] == counts["text"]  # one message, written two ways
    if isinstance(engine, TinyEngine):
        # Offered tools are not part of these models' prompts (they make no calls): the
        # count holds what the model reads, no more.
        assert counts["tools"] == counts["text"]
    # The responses (one per input, the stored one and its follow-up): no count started one.
    assert engine.stats().started == len(INPUTS) + 2


async def test_smollm2_counts_the_input_tokens_its_responses_report():
    engine, _ = load_gguf_engine(require_smollm2(), TinyEngineConfig(num_blocks=64), "smollm2")
    found = await counts_and_usages(engine)
    assert_agree(found)
    # Its chat template's markers and default system prompt are counted too.
    assert found["text"][0] > engine.count_tokens(QUESTION) + 5


async def test_the_answer_is_openais_object_and_nothing_else():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        body = {"model": "simulated", "instructions": "be brief", "input": QUESTION}
        async with http.post(f"{url}/v1/responses/input_tokens", json=body) as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            assert "X-Reply-Id" not in response.headers
            answer = await response.json()
    words = len(f"system: be brief\nuser: {QUESTION}".split())  # the simulator's tokens
    assert answer == {"object": "response.input_tokens", "input_tokens": words}


async def test_a_count_admits_nothing_and_is_no_reply_in_metrics_or_the_access_log(caplog):
    caplog.set_level(logging.INFO, logger="replystream.access")
    engine = fast_engine()
    async with running(create_app(engine)) as url, sdk(url) as client:
        for ask in INPUTS.values():
            await client.responses.input_tokens.count(model="simulated", **ask)
        assert engine.stats().started == 0
        # One response beside them: the one reply the metrics count.
        await client.responses.create(model="simulated", input=QUESTION, max_output_tokens=2)
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            metrics = await response.text()
    assert engine.stats().started == 1
    assert "input_tokens" not in metrics
    replies = [
        line for line in metrics.splitlines() if line.startswith("replystream_replies_total")
    ]
    assert replies == ['replystream_replies_total{endpoint="/v1/responses",outcome="finished"} 1.0']
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    counted = [line for line in lines if line["path"] == "/v1/responses/input_tokens"]
    assert len(counted) == len(INPUTS)
    assert all(line["status"] == 200 and line["reply_id"] is None for line in counted)


async def test_keys_are_checked_as_on_responses():
    app = create_app(fast_engine(), ServerConfig(api_keys=("key-a",)))
    async with running(app) as url, sdk(url, "key-a") as good, sdk(url, "wrong") as bad:
        assert (await good.responses.input_tokens.count(input=QUESTION)).input_tokens > 0
        with pytest.raises(openai.AuthenticationError) as refused:
            await bad.responses.input_tokens.count(input=QUESTION)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


async def test_another_callers_response_is_not_continued_in_a_count():
    app = create_app(fast_engine(), ServerConfig(api_keys=("key-a", "key-b")))
    async with running(app) as url, sdk(url, "key-a") as owner, sdk(url, "key-b") as other:
        first = await owner.responses.create(input=QUESTION, max_output_tokens=2)
        counted = await owner.responses.input_tokens.count(previous_response_id=first.id)
        assert counted.input_tokens > 0
        with pytest.raises(openai.BadRequestError) as refused:
            await other.responses.input_tokens.count(previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError) as created:
            await other.responses.create(
                input="x", previous_response_id=first.id, max_output_tokens=2
            )
    assert refused.value.body == created.value.body
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "previous_response_id"


async def test_an_unfinished_previous_response_is_refused_as_create_refuses_it():
    engine = fast_engine(delay_ms=1000.0, jitter_ms=0.0)  # still making its first tokens
    async with running(create_app(engine)) as url, sdk(url) as client:
        running_one = await client.responses.create(
            input=QUESTION, background=True, max_output_tokens=50
        )
        follow_up: dict[str, Any] = {
            "input": "And tomorrow?",
            "previous_response_id": running_one.id,
        }
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_tokens.count(**follow_up)
        with pytest.raises(openai.BadRequestError) as created:
            await client.responses.create(**follow_up, max_output_tokens=2)
        await client.responses.cancel(running_one.id)
    assert refused.value.body == created.value.body
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("invalid_value", "previous_response_id")
    assert "not finished" in error["message"]


LONG = "x" * 200


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"input": []}, 400, "invalid_value", "input"),
        ({"input": 5}, 400, "invalid_value", "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "invalid_value",
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "invalid_value", "input[0].role"),
        ({"input": [ASKED, ANSWERED]}, 400, "invalid_value", "input[1]"),
        ({"input": QUESTION, "instructions": 5}, 400, "invalid_value", "instructions"),
        (
            {"input": QUESTION, "tools": [{"type": "function", "name": "a b"}]},
            400,
            "invalid_value",
            "tools[0].name",
        ),
        (
            {
                "input": QUESTION,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "name": "other"},
            },
            400,
            "invalid_value",
            "tool_choice",
        ),
        # This engine makes no tool calls: a forced one is refused, not counted.
        (
            {"input": QUESTION, "tools": TOOLS, "tool_choice": "required"},
            400,
            "unsupported_parameter",
            "tool_choice",
        ),
        # Nor JSON: it samples freely (a relay passes the format on).
        (
            {"input": QUESTION, "text": {"format": {"type": "json_object"}}},
            400,
            "unsupported_parameter",
            "text.format",
        ),
        ({"input": QUESTION, "truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
        ({"input": LONG}, 400, "context_length_exceeded", "input"),
        ({"input": "hi", "instructions": LONG}, 400, "context_length_exceeded", "input"),
        (
            {"input": QUESTION, "previous_response_id": "resp_nope"},
            400,
            "previous_response_not_found",
            "previous_response_id",
        ),
        ({"input": QUESTION, "model": "other"}, 404, "model_not_found", "model"),
    ],
)
async def test_bad_input_is_refused_as_create_refuses_it_in_openais_shape(
    body, status, code, param
):
    app = create_app(fast_engine(), ServerConfig(max_prompt_chars=100))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses/input_tokens", json=body) as response:
            assert response.status == status
            counted = await response.json()
        created_body = {**body, "max_output_tokens": 2}
        async with http.post(f"{url}/v1/responses", json=created_body) as response:
            assert response.status == status
            created = await response.json()
        async with sdk(url) as client:
            with pytest.raises(openai.APIStatusError) as raised:
                # The SDK's own request, as its ``count`` would send the body.
                await client.post(
                    "/responses/input_tokens", cast_to=InputTokenCountResponse, body=body
                )
    assert counted == created  # the same refusal, word for word
    error = counted["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert raised.value.status_code == status and raised.value.body == error


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({}, "missing_required_parameter", "input"),
        ({"instructions": "You are brief."}, "missing_required_parameter", "input"),
        ({"input": QUESTION, "conversation": "conv_1"}, "unsupported_parameter", "conversation"),
        (
            {"input": QUESTION, "conversation": {"id": "conv_1"}},
            "unsupported_parameter",
            "conversation",
        ),
        ({"input": QUESTION, "personality": "friendly"}, "unsupported_parameter", "personality"),
        # Fields that shape only the reply are no part of the count's spec.
        ({"input": QUESTION, "max_output_tokens": 5}, "unknown_parameter", "max_output_tokens"),
        ({"input": QUESTION, "stream": True}, "unknown_parameter", "stream"),
        ({"input": QUESTION, "temperature": 0.5}, "unknown_parameter", "temperature"),
        ({"input": QUESTION, "store": False}, "unknown_parameter", "store"),
        ({"input": QUESTION, "background": True}, "unknown_parameter", "background"),
        ({"input": QUESTION, "include": []}, "unknown_parameter", "include"),
        ({"input": QUESTION, "replystream": {"seed": 1}}, "unknown_parameter", "replystream"),
    ],
)
async def test_what_the_count_alone_refuses_names_its_field(body, code, param):
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.post("/responses/input_tokens", cast_to=InputTokenCountResponse, body=body)
    error = raised.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)


async def test_a_relay_refuses_to_guess_its_upstreams_count():
    upstream = CountingUpstream()
    async with running(upstream.app()) as upstream_url:
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), health_s=600.0)
        )
        try:
            async with running(create_app(engine)) as url, sdk(url) as client:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.responses.input_tokens.count(model="m", input=QUESTION)
                assert upstream.chats == 0
                response = await client.responses.create(
                    model="m", input=QUESTION, max_output_tokens=5, store=False
                )
        finally:
            await engine.aclose()
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "count_unavailable",
        None,
    )
    assert "estimate" in error["message"]
    assert engine.stats().started == 1 and upstream.chats == 1
    assert response.output_text == "sunny"
