"""The relay in front of an aiohttp upstream on a loopback socket that answers as
llama-cpp-python's server (0.3.36) does where it departs from OpenAI's API: it names a
streamed tool call (its ``id``, ``type`` and function ``name``) again on every piece of it."""

from __future__ import annotations

import json
from typing import Any

import openai
from aiohttp import web

from tests.test_upstream_routing import Upstream, chunk, relay

CALL_ID = "call__0_get_weather_cmpl-05a6ae4a"
ARGUMENTS = ("{", ' "', "city", '":', ' "', "Paris", '"', " }", "")
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK: Any = {
    "model": "m",
    "max_tokens": 24,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}


def piece(arguments: str) -> bytes:
    """One piece of the call as llama-cpp-python streams it: named whole every time, with
    the deprecated ``function_call`` beside it."""
    function = {"name": "get_weather", "arguments": arguments}
    call = {"index": 0, "id": CALL_ID, "type": "function", "function": function}
    delta = {"role": None, "content": None, "function_call": function, "tool_calls": [call]}
    body = {"choices": [{"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class LlamaCppPython(Upstream):
    def __init__(self) -> None:
        super().__init__(["m"])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk(None, role="assistant"))
        for arguments in ARGUMENTS:
            await response.write(piece(arguments))
        await response.write(chunk(None, "tool_calls"))
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_a_call_named_on_every_piece_is_named_once_to_a_chat_client():
    async with (
        relay([LlamaCppPython()]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(**ASK, stream=True)
        calls = [
            call.model_dump(exclude_none=True)
            for event in [c async for c in stream]
            for choice in event.choices
            for call in choice.delta.tool_calls or ()
        ]
        async with client.chat.completions.stream(**ASK) as helped:
            final = await helped.get_final_completion()
        whole = await client.chat.completions.create(**ASK)
    function = {"name": "get_weather", "arguments": "{"}
    assert calls[0] == {"index": 0, "id": CALL_ID, "type": "function", "function": function}
    assert calls[1:] == [
        {"index": 0, "function": {"arguments": arguments}} for arguments in ARGUMENTS[1:]
    ]
    for message in (final.choices[0].message, whole.choices[0].message):
        assert message.tool_calls is not None
        [call] = message.tool_calls
        assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
        assert (call.id, call.function.name) == (CALL_ID, "get_weather")
        assert call.function.arguments == '{ "city": "Paris" }'
