"""The relay in front of an aiohttp upstream on a loopback socket that streams tool calls as
Gemini's OpenAI-compatible API does where it departs from OpenAI's: no ``index`` on a
``tool_calls`` entry (each call whole, several in one chunk, or a call's arguments over
several entries), and a ``finish_reason`` of ``stop``; and one that gives a call no id."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai

from tests.test_upstream_routing import Scripted, chunk, relay

TOOLS: Any = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
ASK: Any = {
    "model": "m",
    "max_tokens": 24,
    "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
    "tools": TOOLS,
}


def calls_chunk(*calls: dict[str, Any]) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"tool_calls": list(calls)}, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def call(arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def unnumbered(pieces: tuple[bytes, ...]) -> Scripted:
    """Tool calls with no ``index`` (``pieces``), between a role chunk and a finish: two calls,
    the first whole beside the second's start in one chunk, the second's arguments in a later
    entry (id and name empty, as Gemini leaves them)."""
    return Scripted((chunk(None, role="assistant"), *pieces, chunk(None, "stop")))


GEMINI = (
    calls_chunk(
        call('{"city": "Paris"}', "function-call-1", "get_weather"),
        call('{"zone":', "function-call-2", "get_time"),
    ),
    calls_chunk(call(' "CET"}')),
)


async def test_calls_without_an_index_stay_apart_for_every_client():
    async with (
        relay([unnumbered(GEMINI)]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as claude,
    ):
        async with client.chat.completions.stream(**ASK) as stream:
            final = await stream.get_final_completion()
        whole = await client.chat.completions.create(**ASK)
        async with claude.messages.stream(
            model="m",
            max_tokens=24,
            messages=ASK["messages"],
            tools=[
                {"name": t["function"]["name"], "input_schema": {"type": "object"}} for t in TOOLS
            ],
        ) as messages:
            message = await messages.get_final_message()
    expected = [
        ("function-call-1", "get_weather", '{"city": "Paris"}'),
        ("function-call-2", "get_time", '{"zone": "CET"}'),
    ]
    for choice in (final.choices[0], whole.choices[0]):
        assert choice.finish_reason == "tool_calls"
        assert [
            (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()
        ] == expected
    assert message.stop_reason == "tool_use"
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        ("function-call-1", "get_weather", {"city": "Paris"}),
        ("function-call-2", "get_time", {"zone": "CET"}),
    ]


async def test_a_call_with_no_id_gets_one_its_result_can_answer():
    pieces = (calls_chunk({"index": 0, **call("{}", name="get_weather")}),)
    async with (
        relay([unnumbered(pieces)]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as claude,
    ):
        tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
        asked: Any = [{"role": "user", "content": "Weather?"}]
        message = await claude.messages.create(
            model="m", max_tokens=24, messages=asked, tools=tools
        )
        [block] = message.content
        assert block.type == "tool_use" and block.id.startswith("call_") and len(block.id) > 5
        history: Any = [
            *asked,
            {"role": "assistant", "content": [block.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "ok"}],
            },
        ]
        answered = await claude.messages.create(
            model="m",
            max_tokens=24,
            tools=tools,
            messages=history,
        )
    assert answered.stop_reason == "tool_use"
