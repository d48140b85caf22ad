"""Streamed tool calls, read by the official openai and anthropic SDKs over a real server.

The server is ``replystream serve --engine simulated --reply-script FILE`` in a child
process; the relayed tests put a second one (``--engine upstream:URL``) in front of it. What
the SDKs assemble must equal the script byte for byte: names, ids, every arguments fragment.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from openai.types import Completion

from replystream.sse import EventParser
from tests.processes import replica

WEATHER_FRAGMENTS = ['{"city":', ' "Paris",', ' "unit": "C"}']
SCRIPT: list[dict[str, Any]] = [
    {"text": "Checking the weather. ", "delay_ms": 3},
    {"text": "One moment.", "delay_ms": 3},
    {
        "tool_call": {"name": "get_weather", "id": "call_W1", "arguments": WEATHER_FRAGMENTS},
        "delay_ms": 3,
    },
    {"tool_call": {"name": "get_time", "arguments": ['{"tz":', ' "CET"}']}, "delay_ms": 3},
]
TEXT = "Checking the weather. One moment."
WEATHER_ARGS = "".join(WEATHER_FRAGMENTS)
TIME_ARGS = '{"tz": "CET"}'
CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name[4:]}",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    for name in ("get_weather", "get_time")
]
RESPONSES_TOOLS: Any = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
ANTHROPIC_TOOLS: Any = [
    {
        "name": tool["function"]["name"],
        "description": tool["function"]["description"],
        "input_schema": tool["function"]["parameters"],
    }
    for tool in CHAT_TOOLS
]
USER: Any = [{"role": "user", "content": "weather in Paris?"}]


def script_file(tmp_path: Path, steps: list[dict[str, Any]]) -> str:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(steps))
    return str(path)


def scripted(tmp_path: Path, steps: list[dict[str, Any]] = SCRIPT) -> Any:
    return replica("--engine", "simulated", "--reply-script", script_file(tmp_path, steps))


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    async with scripted(tmp_path) as (_, url):
        yield url


# Typed Any: the scripted replies' shapes are what the assertions check, not the stubs'.
def oai(url: str) -> Any:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def claude(url: str) -> Any:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def body_of(error: pytest.ExceptionInfo[Any]) -> Any:
    """The error body an SDK's exception carries."""
    return error.value.body


async def chunks_of(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed chat chunks (``data:`` objects) of one request, read raw."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            events = EventParser().feed(await response.read())
    assert events[-1].data == "[DONE]"
    return [json.loads(event.data) for event in events[:-1]]


def tool_call_deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        call
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls", [])
    ]


async def test_chat_tool_call_deltas_are_shaped_as_openai_sends_them(server: str):
    body = {"messages": USER, "tools": CHAT_TOOLS, "stream": True}
    chunks = await chunks_of(server, body)
    deltas = tool_call_deltas(chunks)
    time_id = deltas[4]["id"]
    assert time_id.startswith("call_")
    assert deltas == [
        {
            "index": 0,
            "id": "call_W1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        *({"index": 0, "function": {"arguments": part}} for part in WEATHER_FRAGMENTS),
        {
            "index": 1,
            "id": time_id,
            "type": "function",
            "function": {"name": "get_time", "arguments": ""},
        },
        {"index": 1, "function": {"arguments": '{"tz":'}},
        {"index": 1, "function": {"arguments": ' "CET"}'}},
    ]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [reason for reason in finishes if reason] == ["tool_calls"]
    # Every text chunk comes before the first tool-call chunk.
    kinds = ["tool" if "tool_calls" in c["choices"][0]["delta"] else "other" for c in chunks]
    assert "other" not in kinds[kinds.index("tool") : -1]


async def test_openai_sdk_assembles_the_scripted_calls_on_chat_streamed_and_whole(server: str):
    async with oai(server) as client:
        async with client.chat.completions.stream(
            model="simulated",
            messages=USER,
            tools=CHAT_TOOLS,
            tool_choice="auto",
        ) as stream:
            argument_deltas = [
                event.arguments_delta
                async for event in stream
                if event.type == "tool_calls.function.arguments.delta"
            ]
            streamed = await stream.get_final_completion()
        whole = await client.chat.completions.create(
            model="simulated",
            messages=USER,
            tools=CHAT_TOOLS,
        )
    # The SDK reports the empty arguments of each call's naming delta too.
    assert argument_deltas == ["", *WEATHER_FRAGMENTS, "", '{"tz":', ' "CET"}']
    for completion in (streamed, whole):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == TEXT
        calls = choice.message.tool_calls or []
        assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
            ("call_W1", "get_weather", WEATHER_ARGS),
            (calls[1].id, "get_time", TIME_ARGS),
        ]
    assert streamed.choices[0].message.tool_calls[1].id == whole.choices[0].message.tool_calls[1].id


def same_response(one: Any, other: Any) -> bool:
    """Two responses alike but for what names the reply (ids, the seconds it was made and
    completed) and what the SDK adds to a streamed one (``parsed``, ``parsed_arguments``:
    None here)."""

    def shape(value: Any) -> Any:
        if isinstance(value, dict):
            dropped = ("id", "created_at", "completed_at")
            return {k: shape(v) for k, v in value.items() if v is not None and k not in dropped}
        if isinstance(value, list):
            return [shape(v) for v in value]
        return value

    return bool(shape(one.model_dump()) == shape(other.model_dump()))


async def test_a_reply_of_tool_calls_only_in_every_dialect(tmp_path: Path):
    steps = [{"tool_call": {"name": "get_time", "id": "call_T", "arguments": "{}"}}]
    async with scripted(tmp_path, steps) as (_, url), oai(url) as client, claude(url) as other:
        whole = await client.chat.completions.create(
            model="simulated", messages=USER, tools=CHAT_TOOLS
        )
        async with other.messages.stream(**ANTHROPIC_ASK) as stream:
            streamed = await stream.get_final_message()
        message = await other.messages.create(**ANTHROPIC_ASK)
        ask: Any = {"model": "simulated", "input": "x", "tools": RESPONSES_TOOLS, "store": False}
        async with client.responses.stream(**ask) as response_stream:
            kinds = [event.type async for event in response_stream]
            streamed_response = await response_stream.get_final_response()
        response = await client.responses.create(**ask)
    chat_message = whole.choices[0].message
    assert chat_message.content is None
    assert [(c.id, c.function.arguments) for c in chat_message.tool_calls] == [("call_T", "{}")]
    # As Anthropic sends it: no empty text block before the call.
    assert [block.type for block in streamed.content] == ["tool_use"]
    assert streamed.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
    # Responses likewise: no empty message item, nothing about text at all.
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output[0].call_id == "call_T"
    assert not [kind for kind in kinds if "text" in kind or "content_part" in kind]
    assert same_response(streamed_response, response)


async def test_text_after_a_call_opens_a_new_block_and_a_new_message_item(tmp_path: Path):
    steps: list[dict[str, Any]] = [
        {"text": "Before. "},
        {"tool_call": {"name": "get_time", "id": "call_T", "arguments": ['{"tz":', ' "CET"}']}},
        {"text": "After "},
        {"text": "it."},
    ]
    async with scripted(tmp_path, steps) as (_, url), oai(url) as client, claude(url) as other:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{url}/v1/messages", json={**ANTHROPIC_ASK, "stream": True}
            ) as raw:
                events = EventParser().feed(await raw.read())
        async with other.messages.stream(**ANTHROPIC_ASK) as stream:
            streamed = await stream.get_final_message()
        message = await other.messages.create(**ANTHROPIC_ASK)
        ask: Any = {"model": "simulated", "input": "x", "tools": RESPONSES_TOOLS, "store": False}
        async with client.responses.stream(**ask) as response_stream:
            added = [
                (event.output_index, event.item.type, event.item.id)
                async for event in response_stream
                if event.type == "response.output_item.added"
            ]
            streamed_response = await response_stream.get_final_response()
        response = await client.responses.create(**ask)
    # Anthropic: blocks in order, each started, filled and stopped under its own index.
    blocks = [
        (event.type, payload["index"])
        for event in events
        if event.type.startswith("content_block")
        for payload in [json.loads(event.data)]
    ]
    assert [index for kind, index in blocks if kind == "content_block_start"] == [0, 1, 2]
    assert [index for kind, index in blocks if kind == "content_block_stop"] == [0, 1, 2]
    assert blocks == sorted(blocks, key=lambda block: block[1])  # never back to a stopped one
    content = [
        (b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in message.content
    ]
    assert content == [("text", "Before. "), ("tool_use", {"tz": "CET"}), ("text", "After it.")]
    assert streamed.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
    # Responses: a message item, the call, then a new message item.
    assert [(index, kind) for index, kind, _ in added] == [
        (0, "message"),
        (1, "function_call"),
        (2, "message"),
    ]
    assert len({item_id for _, _, item_id in added}) == 3
    outputs = [item.type for item in response.output]
    assert outputs == ["message", "function_call", "message"]
    assert response.output_text == "Before. After it."
    assert same_response(streamed_response, response)


async def test_openai_sdk_assembles_function_call_items_on_responses(server: str):
    async with oai(server) as client:
        async with client.responses.stream(
            model="simulated",
            input="weather in Paris?",
            tools=RESPONSES_TOOLS,
            store=False,
        ) as stream:
            events = [event async for event in stream]
            streamed = await stream.get_final_response()
        whole = await client.responses.create(
            model="simulated",
            input="weather in Paris?",
            tools=RESPONSES_TOOLS,
            store=False,
        )
    kinds = [event.type for event in events]
    first_call = kinds.index("response.function_call_arguments.delta") - 1
    assert kinds[first_call - 3 : first_call + 1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    added = events[first_call]
    assert added.item.type == "function_call"
    assert (added.item.call_id, added.item.name, added.item.arguments) == (
        "call_W1",
        "get_weather",
        "",
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == [*WEATHER_FRAGMENTS, '{"tz":', ' "CET"}']
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [WEATHER_ARGS, TIME_ARGS]
    for response in (streamed, whole):
        assert response.output_text == TEXT
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.call_id, c.name, c.arguments) for c in calls] == [
            ("call_W1", "get_weather", WEATHER_ARGS),
            (calls[1].call_id, "get_time", TIME_ARGS),
        ]
        assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]


async def test_a_cut_responses_items_have_the_statuses_their_done_events_gave(server: str):
    # Four tokens: the two texts, the call's name, its first fragment.
    ask: Any = {
        "model": "simulated",
        "input": "x",
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": 4,
    }
    async with oai(server) as client:
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        stored = await client.responses.create(**ask)
        retrieved = await client.responses.retrieve(stored.id)
        whole = await client.responses.create(**ask, store=False)
    done = [(e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"]
    # The text ended when the call began; the limit cut the call.
    assert done == [("message", "completed"), ("function_call", "incomplete")]
    assert events[-1].type == "response.incomplete"
    for response in (events[-1].response, stored, retrieved, whole):
        assert response.status == "incomplete"
        assert [(item.type, item.status) for item in response.output] == done


ANTHROPIC_ASK: dict[str, Any] = {
    "model": "simulated",
    "max_tokens": 100,
    "messages": USER,
    "tools": ANTHROPIC_TOOLS,
}


async def test_anthropic_sdk_streams_tool_use_blocks_equal_to_the_whole_message(server: str):
    async with claude(server) as client:
        async with client.messages.stream(**ANTHROPIC_ASK) as stream:
            partials = [event.partial_json async for event in stream if event.type == "input_json"]
            streamed = await stream.get_final_message()
        whole = await client.messages.create(**ANTHROPIC_ASK)
    assert partials == [*WEATHER_FRAGMENTS, '{"tz":', ' "CET"}']
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    uses = [block for block in streamed.content if block.type == "tool_use"]
    assert [(u.id, u.name, u.input) for u in uses] == [
        ("call_W1", "get_weather", json.loads(WEATHER_ARGS)),
        (uses[1].id, "get_time", json.loads(TIME_ARGS)),
    ]
    assert [b.text for b in streamed.content if b.type == "text"] == [TEXT]
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


async def test_a_call_the_token_limit_cuts_has_the_input_the_anthropic_sdk_assembles(
    server: str,
):
    # Two text steps, the call's name, then two of its three fragments: '{"city": "Paris",'.
    ask = {**ANTHROPIC_ASK, "max_tokens": 5}
    async with claude(server) as client:
        async with client.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server}/v1/messages", json=ask) as response:
            whole = await response.json()
    assert whole["stop_reason"] == "max_tokens"
    assert whole["content"][-1]["input"] == {"city": "Paris"}  # an object, as the API's is
    anthropic.types.Message.model_validate(whole)
    assert streamed.model_dump(exclude={"id"}) == anthropic.types.Message.model_validate(
        whole
    ).model_dump(exclude={"id"})


async def test_tool_messages_in_the_input_are_accepted_by_every_api(server: str):
    async with oai(server) as client, claude(server) as anthropic_client:
        history: list[dict[str, Any]] = [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_W1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_W1", "content": "18 C, clear"},
        ]
        chat = await client.chat.completions.create(
            model="simulated",
            messages=history,
            tools=CHAT_TOOLS,
        )
        assert chat.usage is not None and chat.usage.prompt_tokens > 3
        response = await client.responses.create(
            model="simulated",
            input=[
                {"role": "user", "content": "weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "call_W1",
                    "name": "get_weather",
                    "arguments": WEATHER_ARGS,
                },
                {"type": "function_call_output", "call_id": "call_W1", "output": "18 C"},
            ],
            tools=RESPONSES_TOOLS,
            store=False,
        )
        assert response.status == "completed"
        message = await anthropic_client.messages.create(
            model="simulated",
            max_tokens=100,
            tools=ANTHROPIC_TOOLS,
            messages=[
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
        )
        assert message.stop_reason == "tool_use"


async def test_previous_response_id_carries_the_calls_to_the_next_response(server: str):
    async with oai(server) as client:
        first = await client.responses.create(
            model="simulated",
            input="weather in Paris?",
            tools=RESPONSES_TOOLS,
        )
        outputs = [
            {"type": "function_call_output", "call_id": item.call_id, "output": "18 C"}
            for item in first.output
            if item.type == "function_call"
        ]
        assert len(outputs) == 2  # the script makes two calls: each is answered
        second = await client.responses.create(
            model="simulated", previous_response_id=first.id, input=outputs, tools=RESPONSES_TOOLS
        )
    assert second.status == "completed"
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def _answers(response: Any) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": "18 C"}
        for item in response.output
        if item.type == "function_call"
    ]


async def test_a_chain_of_calls_goes_on_past_its_second_response(tmp_path: Path):
    # Each response's stored conversation holds the history it continued, an assistant turn
    # of calls without text included: the third response reads the second's history back.
    calls_alone = [step for step in SCRIPT if "tool_call" in step]
    async with scripted(tmp_path, calls_alone) as (_, server), oai(server) as client:
        made = await client.responses.create(
            model="simulated", input="weather in Paris?", tools=RESPONSES_TOOLS
        )
        usages = [made.usage.input_tokens]
        for _ in range(3):
            count = await client.responses.input_tokens.count(
                model="simulated",
                previous_response_id=made.id,
                input=_answers(made),
                tools=RESPONSES_TOOLS,
            )
            made = await client.responses.create(
                model="simulated",
                previous_response_id=made.id,
                input=_answers(made),
                tools=RESPONSES_TOOLS,
            )
            assert made.status == "completed"
            assert count.input_tokens == made.usage.input_tokens
            usages.append(made.usage.input_tokens)
            items = await client.responses.input_items.list(made.id, order="asc")
            assert [item.type for item in items.data] == ["function_call_output"] * 2
    assert usages == sorted(usages) and len(set(usages)) == 4


async def test_a_previous_responses_calls_left_unanswered_are_a_400(server: str):
    async with oai(server) as client:
        first = await client.responses.create(
            model="simulated", input="weather in Paris?", tools=RESPONSES_TOOLS
        )
        made = [item.call_id for item in first.output if item.type == "function_call"]
        one = [{"type": "function_call_output", "call_id": made[0], "output": "18 C"}]
        # A new question with no output at all, and an output for one of the two calls.
        for given, unanswered in (("thanks", made[0]), (one, made[1])):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    model="simulated",
                    previous_response_id=first.id,
                    input=given,
                    tools=RESPONSES_TOOLS,
                )
            error = refused.value
            assert (error.code, error.param) == ("invalid_value", "previous_response_id")
            assert f"function call {unanswered!r} has no function_call_output" in error.message


async def test_bad_tools_are_400s_in_each_apis_own_shape(server: str):
    async with oai(server) as client, claude(server) as anthropic_client:
        bad_schema = [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
        ]
        with pytest.raises(openai.BadRequestError) as chat_schema:
            await client.chat.completions.create(
                model="simulated",
                messages=USER,
                tools=bad_schema,
            )
        with pytest.raises(openai.BadRequestError) as chat_choice:
            await client.chat.completions.create(
                model="simulated",
                messages=USER,
                tools=CHAT_TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_stock"}},
            )
        with pytest.raises(openai.BadRequestError) as chat_orphan:
            await client.chat.completions.create(
                model="simulated",
                messages=[*USER, {"role": "tool", "tool_call_id": "call_X", "content": "1"}],
            )
        with pytest.raises(openai.BadRequestError) as responses_choice:
            await client.responses.create(
                model="simulated",
                input="x",
                tools=RESPONSES_TOOLS,
                tool_choice={"type": "function", "name": "get_stock"},
                store=False,
            )
        with pytest.raises(openai.BadRequestError) as responses_required:
            await client.responses.create(
                model="simulated", input="x", tool_choice="required", store=False
            )
        with pytest.raises(anthropic.BadRequestError) as claude_schema:
            await anthropic_client.messages.create(
                model="simulated",
                max_tokens=10,
                messages=USER,
                tools=[{"name": "f", "input_schema": {"type": "object", "required": "city"}}],
            )
        with pytest.raises(anthropic.BadRequestError) as claude_choice:
            await anthropic_client.messages.create(
                model="simulated",
                max_tokens=10,
                messages=USER,
                tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "tool", "name": "get_stock"},
            )
    params = [
        body_of(error)["param"]
        for error in (chat_schema, chat_choice, chat_orphan, responses_choice, responses_required)
    ]
    assert params == [
        "tools[0].function.parameters",
        "tool_choice",
        "messages[1]",
        "tool_choice",
        "tool_choice",
    ]
    assert "get_stock" in chat_choice.value.message
    for error in (claude_schema, claude_choice):
        body = body_of(error)["error"]
        assert body["type"] == "invalid_request_error"
    assert body_of(claude_schema)["error"]["param"] == "tools[0].input_schema"
    assert body_of(claude_choice)["error"]["param"] == "tool_choice"


async def test_native_route_names_tool_call_events_and_lists_the_calls_whole(server: str):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server}/v1/replies", json={"prompt": "x"}) as response:
            events = EventParser().feed(await response.read())
        async with http.post(f"{server}/v1/replies", json={"prompt": "x", "stream": False}) as r:
            whole = await r.json()
    pieces = [json.loads(e.data) for e in events if e.type == "tool_call"]
    assert pieces[0] == {"index": 0, "id": "call_W1", "name": "get_weather", "arguments": ""}
    assert [p["arguments"] for p in pieces if p["index"] == 0] == ["", *WEATHER_FRAGMENTS]
    assert json.loads(events[-1].data) == {"finish_reason": "tool_calls"}
    assert whole["finish_reason"] == "tool_calls"
    assert [c["function"]["arguments"] for c in whole["tool_calls"]] == [WEATHER_ARGS, TIME_ARGS]


async def test_a_legacy_completion_shows_no_calls_and_finishes_stop_streamed_or_whole(
    server: str,
):
    # Its finish reasons are stop, length and content_filter: the calls it does not show
    # cannot be its ending either.
    ask: Any = {"model": "simulated", "prompt": "x"}
    async with oai(server) as client:
        whole = await client.completions.create(**ask)
        stream = await client.completions.create(**ask, n=2, stream=True)
        chunks = [chunk async for chunk in stream]
    Completion.model_validate(whole.model_dump())
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (TEXT, "stop")
    finishes = [(c.index, c.finish_reason) for k in chunks for c in k.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]


async def test_resuming_mid_arguments_gives_the_exact_remaining_bytes(server: str):
    body = {"messages": USER, "tools": CHAT_TOOLS, "stream": True, "resumable": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server}/v1/chat/completions", json=body) as response:
            reply_id = response.headers["X-Reply-Id"]
            whole = await response.read()
        events = EventParser().feed(whole)
        # The event carrying the second fragment of the first call's arguments.
        middle = next(e for e in events if WEATHER_FRAGMENTS[1].replace('"', '\\"') in e.data)
        headers = {"Last-Event-ID": str(middle.id)}
        url = f"{server}/v1/replies/{reply_id}/stream"
        async with http.get(url, headers=headers) as again:
            rest = await again.read()
    assert whole.endswith(rest)
    assert whole[: len(whole) - len(rest)].endswith(
        f"id: {middle.id}\n".encode() + b"data: " + middle.data.encode() + b"\n\n"
    )


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    async with (
        scripted(tmp_path) as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1", "--model-name", "simulated") as (_, front),
    ):
        yield upstream, front


async def test_relayed_chat_tool_call_deltas_are_exactly_the_upstreams(relay: tuple[str, str]):
    upstream, front = relay
    body = {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": "required", "stream": True}
    direct = tool_call_deltas(await chunks_of(upstream, body))
    relayed_chunks = await chunks_of(front, body)
    assert tool_call_deltas(relayed_chunks) == direct
    assert relayed_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_relayed_calls_are_translated_for_responses_and_anthropic(relay: tuple[str, str]):
    upstream, front = relay
    results = []
    for url in (upstream, front):
        async with oai(url) as client, claude(url) as anthropic_client:
            async with client.responses.stream(
                model="simulated",
                input="weather in Paris?",
                tools=RESPONSES_TOOLS,
                tool_choice="required",  # the upstream refuses it unless the tools reach it
                store=False,
            ) as stream:
                deltas = [
                    e.delta
                    async for e in stream
                    if e.type == "response.function_call_arguments.delta"
                ]
                response = await stream.get_final_response()
            forced = {**ANTHROPIC_ASK, "tool_choice": {"type": "any"}}  # "required" upstream
            async with anthropic_client.messages.stream(**forced) as claude_stream:
                partials = [e.partial_json async for e in claude_stream if e.type == "input_json"]
                message = await claude_stream.get_final_message()
        calls = [
            (c.call_id, c.name, c.arguments) for c in response.output if c.type == "function_call"
        ]
        uses = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
        results.append((deltas, calls, partials, uses, message.stop_reason))
    assert results[0] == results[1]
    deltas, calls, _, _, stop_reason = results[1]
    assert deltas == [*WEATHER_FRAGMENTS, '{"tz":', ' "CET"}']
    assert calls[0] == ("call_W1", "get_weather", WEATHER_ARGS)
    assert stop_reason == "tool_use"


async def test_websocket_messages_carry_tool_call_pieces(server: str):
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{server}/v1/ws") as ws:
        await ws.send_json({"type": "reply", "id": "t", "prompt": "x"})
        messages: list[Any] = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(await ws.receive_json(timeout=30))
    pieces = [m["data"] for m in messages if m["type"] == "tool_call"]
    assert all(m["id"] == "t" for m in messages)
    assert "".join(p["arguments"] for p in pieces if p["index"] == 0) == WEATHER_ARGS
    assert messages[-1]["data"] == {"finish_reason": "tool_calls"}


async def test_a_stop_string_after_calls_ends_the_message_as_tool_use(tmp_path: Path):
    # The text after the calls meets a stop sequence: the message still ends as tool use,
    # since agents run the calls on the stop reason alone; before, it ended "stop_sequence"
    # and an agent loop took the message for its answer. (Chat: test_tool_calls_with_options.)
    steps = [*SCRIPT, {"text": "Done END after", "delay_ms": 3}]
    ask = {**ANTHROPIC_ASK, "stop_sequences": ["END"]}
    async with scripted(tmp_path, steps) as (_, url):
        async with claude(url) as client:
            async with client.messages.stream(**ask) as stream:
                streamed = await stream.get_final_message()
            whole = await client.messages.create(**ask)
    for message in (streamed, whole):
        assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
        kinds = [block.type for block in message.content]
        assert kinds == ["text", "tool_use", "tool_use", "text"]
        assert message.content[-1].text == "Done "  # cut before the stop sequence


async def test_a_stop_string_before_any_call_still_ends_the_reply_at_it(tmp_path: Path):
    steps = [{"text": "Let me END check. ", "delay_ms": 3}, *SCRIPT[2:]]
    async with scripted(tmp_path, steps) as (_, url):
        async with claude(url) as client:
            message = await client.messages.create(**ANTHROPIC_ASK, stop_sequences=["END"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert [block.type for block in message.content] == ["text"]


async def test_a_moderated_reply_whole_keeps_the_calls_and_logprobs_its_stream_sent(
    tmp_path: Path,
):
    """A check stops the reply after a call: the whole body holds what the stream sent (the
    released text, the call before the match, their tokens' log probabilities), in every
    dialect, as a stored response already did."""
    steps: list[dict[str, Any]] = [
        {"text": "Checking. "},
        {"tool_call": {"name": "get_weather", "id": "call_W", "arguments": '{"city": "Paris"}'}},
        {"text": "the password is "},
        {"text": "hunter2 "},
        {"text": "ok."},
    ]
    path = script_file(tmp_path, steps)
    serve = ("--engine", "simulated", "--reply-script", path, "--ban", "hunter2")
    chat: Any = {"model": "simulated", "messages": USER, "tools": CHAT_TOOLS, "logprobs": True}
    asked: Any = {"model": "simulated", "input": "x", "tools": RESPONSES_TOOLS, "store": False}
    asked["include"] = ["message.output_text.logprobs"]
    async with replica(*serve) as (_, url), oai(url) as client, claude(url) as other:
        whole = (await client.chat.completions.create(**chat)).choices[0]
        # Read raw: the SDK's stream helper raises at a content_filter finish.
        chunks = await chunks_of(url, {**chat, "stream": True})
        async with other.messages.stream(**ANTHROPIC_ASK) as stream:
            streamed_message = await stream.get_final_message()
        message = await other.messages.create(**ANTHROPIC_ASK)
        response = await client.responses.create(**asked)
        async with aiohttp.ClientSession() as http:
            # Read raw: the SDK's stream helper wants a response.completed, not incomplete.
            async with http.post(f"{url}/v1/responses", json={**asked, "stream": True}) as raw:
                events = EventParser().feed(await raw.read())
            native = {"prompt": "x", "stream": False}
            async with http.post(f"{url}/v1/replies", json=native) as raw:
                native_whole = await raw.json()
    assert whole.finish_reason == "content_filter"
    deltas = [choice for chunk in chunks for choice in chunk["choices"]]
    streamed_text = "".join(d["delta"].get("content") or "" for d in deltas)
    assert whole.message.content == streamed_text == "Checking. the password is "
    calls = [(c.id, c.function.arguments) for c in whole.message.tool_calls]
    assert calls == [("call_W", '{"city": "Paris"}')]
    pieces = tool_call_deltas(chunks)
    streamed_args = "".join(c["function"]["arguments"] for c in pieces)
    assert calls == [(pieces[0]["id"], streamed_args)]
    tokens = [t.token for t in whole.logprobs.content]
    assert "".join(tokens) == whole.message.content
    assert tokens == [t["token"] for d in deltas for t in (d["logprobs"] or {}).get("content", [])]
    assert message.stop_reason == "refusal"
    assert [b.type for b in message.content] == ["text", "tool_use", "text"]
    assert streamed_message.model_dump(exclude={"id"}) == message.model_dump(
        exclude={"id", "replystream_moderation"}
    )
    assert [item.type for item in response.output] == ["message", "function_call", "message"]
    assert response.incomplete_details.reason == "content_filter"
    ended = json.loads(events[-1].data)
    assert ended["type"] == "response.incomplete"
    dumped = response.model_dump(exclude_none=True)
    assert dumped["incomplete_details"] == ended["response"]["incomplete_details"]
    assert dumped["usage"] == ended["response"]["usage"]

    def items(output: list[dict[str, Any]]) -> list[Any]:
        """Each item's kind, text or arguments, and tokens (ids and draws differ per reply)."""
        return [
            (item["type"], part.get("text"), [t["token"] for t in part.get("logprobs", [])])
            if item["type"] == "message"
            else (item["type"], item["call_id"], item["arguments"])
            for item in output
            for part in item.get("content", [item])
        ]

    assert items(dumped["output"]) == items(ended["response"]["output"])
    assert items(dumped["output"])[0] == ("message", "Checking. ", ["Checking. "])
    assert native_whole["finish_reason"] == "moderated"
    assert [c["id"] for c in native_whole["tool_calls"]] == ["call_W"]


async def test_a_function_output_given_as_text_parts_is_its_text(server: str):
    """OpenAI's ``function_call_output.output`` is a string or a list of parts; a list was a
    400. Its text parts are the result's text; an image part is refused by its type, as a
    message's is (this server reads text only)."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather"}
    call["arguments"] = WEATHER_ARGS
    ask = {"role": "user", "content": "weather in Paris?"}
    parts = [{"type": "input_text", "text": "18 "}, {"type": "input_text", "text": "C"}]
    as_text = {"type": "function_call_output", "call_id": "c1", "output": "18 C"}
    as_parts = {**as_text, "output": parts}
    image = {**as_text, "output": [{"type": "input_image", "image_url": "https://x/y.png"}]}
    async with aiohttp.ClientSession() as http:
        counts = []
        for output in (as_text, as_parts):
            body = {"model": "simulated", "input": [ask, call, output], "tools": RESPONSES_TOOLS}
            async with http.post(f"{server}/v1/responses/input_tokens", json=body) as counted:
                assert counted.status == 200, await counted.text()
                counts.append((await counted.json())["input_tokens"])
        body = {**body, "store": True}
        async with http.post(f"{server}/v1/responses", json=body) as made:
            response_id = (await made.json())["id"]
        async with http.get(f"{server}/v1/responses/{response_id}/input_items") as listed:
            items = (await listed.json())["data"]
        body = {**body, "input": [ask, call, image]}
        async with http.post(f"{server}/v1/responses", json=body) as refused:
            error = (await refused.json())["error"]
            status = refused.status
    assert counts[0] == counts[1]
    assert items[0]["output"] == parts  # listed as given, newest first
    assert status == 400 and error["param"] == "input[2].output[0].type"
