"""``item_reference`` input items on ``POST /v1/responses``, with the official openai SDK: a
stored response's items sent back by id, as Vercel's AI SDK sends every earlier assistant
message of a conversation (its default, ``store: true``)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.processes import replica
from tests.redis_server import redis_server

SCRIPT = [
    {"text": "Let me look that up."},
    {"tool_call": {"name": "weather", "id": "call_1", "arguments": '{"city": "Paris"}'}},
]
TOOLS: Any = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
USER: Any = {"role": "user", "content": "weather in Paris?"}
RESULT: Any = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}


def sdk(url: str, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.fixture
async def url() -> AsyncIterator[str]:
    config = SimulatedConfig(delay_ms=1.0, jitter_ms=0.0, script=parse_reply_script(SCRIPT))
    app = create_app(simulated_engine(config), ServerConfig(api_keys=("key-a", "key-b")))
    async with running(app) as base:
        yield base


def sent_back(item: Any) -> dict[str, Any]:
    """An output item as a client sends it back whole."""
    shown: dict[str, Any] = item.model_dump(exclude_none=True)
    return shown


async def test_a_turn_referring_to_the_last_ones_items_is_made_from_those_items(url: str):
    async with sdk(url) as client:
        first = await client.responses.create(model="simulated", input=[USER], tools=TOOLS)
        message, call = first.output
        assert (message.type, call.type) == ("message", "function_call")
        # As Vercel's AI SDK sends a tool loop's next step: the message by reference.
        ask: Any = {"model": "simulated", "tools": TOOLS, "tool_choice": "none"}
        referred = [USER, {"type": "item_reference", "id": message.id}, sent_back(call), RESULT]
        by_reference = await client.responses.create(input=referred, **ask)
        whole = [USER, sent_back(message), sent_back(call), RESULT]
        by_value = await client.responses.create(input=whole, **ask)
        # The call too, and a reference without its type, which OpenAI's spec allows.
        both = [USER, {"id": message.id}, {"type": "item_reference", "id": call.id}, RESULT]
        all_referred = await client.responses.create(input=both, **ask)
        listed = await client.responses.input_items.list(all_referred.id, order="asc")
    assert by_reference.status == by_value.status == all_referred.status == "completed"
    assert by_reference.output_text == "Let me look that up."
    assert by_reference.usage is not None and by_value.usage is not None
    assert all_referred.usage is not None
    # The same prompt: the referenced items themselves, not their ids.
    assert by_reference.usage.input_tokens == by_value.usage.input_tokens
    assert all_referred.usage.input_tokens == by_value.usage.input_tokens
    # The response keeps the items it was made from, under their own ids.
    assert [item.id for item in listed.data][1:3] == [message.id, call.id]
    assert listed.data[2].model_dump(include={"call_id", "name", "arguments"}) == {
        "call_id": "call_1",
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }


async def test_an_input_item_of_a_stored_response_can_be_referred_to(url: str):
    async with sdk(url) as client:
        first = await client.responses.create(model="simulated", input="weather in Paris?")
        [asked] = (await client.responses.input_items.list(first.id)).data
        again = await client.responses.create(
            model="simulated",
            input=[{"type": "item_reference", "id": asked.id}],
            tool_choice="none",
        )
    assert again.usage is not None and first.usage is not None
    assert again.usage.input_tokens == first.usage.input_tokens


async def test_an_item_not_kept_or_not_the_callers_is_a_404_naming_the_reference(url: str):
    async with sdk(url) as client, sdk(url, "key-b") as other:
        kept: Any = await client.responses.create(model="simulated", input=[USER])
        unkept: Any = await client.responses.create(model="simulated", input=[USER], store=False)
        theirs: Any = await other.responses.create(model="simulated", input=[USER])
        for item_id in (
            unkept.output[0].id,  # made with store: false
            theirs.output[0].id,  # another key's
            f"{kept.output[0].id}_9",  # no such place in a response that exists
            "msg_mine",  # an id of no form of ours
        ):
            referred: Any = [USER, {"type": "item_reference", "id": item_id}]
            with pytest.raises(openai.NotFoundError) as refused:
                await client.responses.create(model="simulated", input=referred)
            assert refused.value.body == {
                "message": refused.value.body["message"],  # type: ignore[index]
                "type": "invalid_request_error",
                "param": "input[1]",
                "code": "item_not_found",
            }
            assert repr(item_id) in refused.value.message


async def test_an_item_still_being_made_is_a_400_naming_the_reference():
    slow = [{"text": "Let me look", "delay_ms": 1}, {"text": " that up.", "delay_ms": 60_000}]
    config = SimulatedConfig(delay_ms=1.0, jitter_ms=0.0, script=parse_reply_script(slow))
    async with running(create_app(simulated_engine(config))) as base, sdk(base) as client:
        stream = await client.responses.create(
            model="simulated", input="hi", background=True, stream=True
        )
        message_id = ""
        async for event in stream:
            if event.type == "response.output_text.delta":  # its message has begun
                message_id = event.item_id
                break
        await stream.close()
        referred: Any = [{"type": "item_reference", "id": message_id}]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="simulated", input=referred)
        # Its input is whole from the start: an item of it is taken while the response runs.
        running_id = message_id.replace("msg_", "resp_", 1)
        [asked] = (await client.responses.input_items.list(running_id)).data
        taken = await client.responses.create(
            model="simulated",
            input=[{"type": "item_reference", "id": asked.id}],
            max_output_tokens=1,  # its script's second step waits a minute
        )
        await client.responses.cancel(running_id)
    assert (refused.value.code, refused.value.param) == ("invalid_value", "input[0]")
    assert refused.value.body["message"] == f"item {message_id} (input[0]) is still being made"  # type: ignore[index]
    assert taken.status == "incomplete"


async def test_one_long_message_referred_to_thousands_of_times_is_refused_before_it_is_copied():
    # A reference of 60 bytes stands for a message of any length: a body of 1 MB once made
    # a prompt of 750 million characters (1.5 GB, 1.3 s of the loop) only to refuse it.
    config = SimulatedConfig(delay_ms=0.0, jitter_ms=0.0, reply_text="x" * 20_000)
    app = create_app(simulated_engine(config), ServerConfig(api_keys=("key-a",)))
    async with running(app) as base, sdk(base) as client:
        first = await client.responses.create(model="simulated", input="hi")
        reference: Any = {"type": "item_reference", "id": first.output[0].id}
        tracemalloc.start()
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="simulated", input=[reference] * 2_000)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "input"
    # The request's own bytes and their parsing, not 2,000 copies of 20,000 characters.
    assert peak < 20_000_000, peak


async def test_a_referenced_reasoning_items_thinking_is_not_counted_against_the_prompt_limit():
    # A reasoning item is left out of the prompt: the request with it by reference must be
    # taken as the same request with it whole is, however long the thinking it keeps.
    config = SimulatedConfig(delay_ms=0.0, jitter_ms=0.0)
    app = create_app(simulated_engine(config), ServerConfig(max_prompt_chars=1_000))
    async with running(app) as base, sdk(base) as client:
        thought: Any = {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "t" * 5_000}],
        }
        whole: Any = [USER, thought, {"role": "user", "content": "and tomorrow?"}]
        first = await client.responses.create(model="simulated", input=whole)
        listed = await client.responses.input_items.list(first.id, order="asc")
        referred: Any = [{"type": "item_reference", "id": item.id} for item in listed.data]
        again = await client.responses.create(model="simulated", input=referred)
    assert [item.type for item in listed.data] == ["message", "reasoning", "message"]
    assert again.usage is not None and first.usage is not None
    assert again.usage.input_tokens == first.usage.input_tokens


async def test_items_one_replica_stored_are_taken_by_reference_on_the_other(tmp_path: Path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with redis_server(tmp_path) as redis:
        args = ("--engine", "simulated", "--reply-script", str(script), "--redis-url", redis.url)
        keys = ("--api-key", "key-a", "--api-key", "key-b")
        async with (
            replica(*args, *keys) as (_, a_url),
            replica(*args, *keys) as (_, b_url),
            sdk(a_url) as on_a,
            sdk(b_url) as on_b,
            sdk(b_url, "key-b") as other_on_b,
        ):
            first = await on_b.responses.create(model="simulated", input=[USER], tools=TOOLS)
            [asked] = (await on_b.responses.input_items.list(first.id)).data
            ids = [asked.id, *(item.id for item in first.output)]  # input, message, call
            referred: Any = [*({"type": "item_reference", "id": i} for i in ids), RESULT]
            ask: Any = {"model": "simulated", "tools": TOOLS, "tool_choice": "none"}
            second = await on_a.responses.create(input=referred, **ask)
            listed = [
                [item.id for item in (await c.responses.input_items.list(second.id)).data]
                for c in (on_a, on_b)
            ]
            with pytest.raises(openai.NotFoundError) as theirs:
                await other_on_b.responses.create(input=referred, **ask)
            await on_a.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError) as deleted:
                await on_b.responses.create(input=referred, **ask)
    assert second.status == "completed"
    # Both replicas list the items themselves, under their own ids, never the references.
    assert listed[0] == listed[1] and listed[0][::-1][:3] == ids
    assert (theirs.value.code, deleted.value.code) == ("item_not_found", "item_not_found")
