"""Tool calls whose fragments interleave (chat's ``tool_calls`` indexes allow it), relayed from
an upstream into the dialects whose content is one block at a time: Anthropic's content
blocks and Responses' output items come one after another, each call's deltas inside its
own, read by the official SDKs and checked event by event over a real server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
from aiohttp import web

from replystream.sse import EventParser
from tests.chat_upstream import ChatUpstream, relaying_to

WEATHER = '{"city": "Paris", "note": "a } and a \\" in a string", "days": [[1, 2], {"x": []}]}'
TIME = '{"tz": "CET", "formats": ["{h}:{m}"]}'
TOOLS: Any = [
    {"name": name, "description": name, "input_schema": {"type": "object"}}
    for name in ("get_weather", "get_time")
]
RESPONSES_TOOLS: Any = [
    {"type": "function", "name": name, "parameters": {"type": "object"}}
    for name in ("get_weather", "get_time")
]


def named(index: int, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    return {"index": index, "id": f"call_{name}", "type": "function", "function": function}


def fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def calls(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": list(entries)}


# Call 0 named, call 1 named, then their fragments by turns, both in one chunk once, text
# and a call's fragments between (as some servers send it).
INTERLEAVED: list[dict[str, Any]] = [
    {"role": "assistant", "content": "Checking. "},
    calls(named(0, "get_weather")),
    calls(named(1, "get_time")),
    calls(fragment(0, WEATHER[:9])),
    calls(fragment(1, TIME[:10])),
    {"content": "One moment. "},
    calls(fragment(0, WEATHER[9:30]), fragment(1, TIME[10:25])),
    calls(fragment(1, TIME[25:])),
    calls(fragment(0, WEATHER[30:])),
]


class ScriptedChunks(ChatUpstream):
    """Streams each delta of ``deltas`` as one chat chunk, then ``finish_reason``; before
    the delta at index ``i`` of ``gates``, waits for that gate to be set."""

    def __init__(
        self,
        deltas: list[dict[str, Any]],
        finish_reason: str = "tool_calls",
        gates: dict[int, asyncio.Event] | None = None,
    ) -> None:
        self.deltas, self.finish_reason, self.gates = deltas, finish_reason, gates or {}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ending = {"index": 0, "delta": {}, "finish_reason": self.finish_reason}
        bodies = [{"choices": [{"index": 0, "delta": d}]} for d in self.deltas]
        for at, body in enumerate([*bodies, {"choices": [ending]}]):
            if at in self.gates:
                await asyncio.wait_for(self.gates[at].wait(), 10)
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


async def raw_events(url: str, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
    """Each event of a streamed request as it arrives, its ``data`` parsed."""
    parser = EventParser()
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as response:
        assert response.status == 200
        async for chunk in response.content.iter_any():
            for event in parser.feed(chunk):
                yield event.type, json.loads(event.data)


def assert_blocks_one_at_a_time(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every content block is started at the next index, gets deltas while it is the open
    one, and is stopped before the next starts."""
    open_block: int | None = None
    started = 0
    for kind, data in events:
        if kind == "content_block_start":
            assert open_block is None, f"block {data['index']} started in block {open_block}"
            assert data["index"] == started
            open_block, started = started, started + 1
        elif kind == "content_block_delta":
            assert data["index"] == open_block, f"a delta of block {data['index']}: {data}"
        elif kind == "content_block_stop":
            assert data["index"] == open_block
            open_block = None
        elif kind == "message_delta":
            assert open_block is None


def assert_items_one_at_a_time(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every output item is added at the next index, gets its events while it is the open
    one, and is done before the next is added; a call's ``.done`` arguments are its deltas,
    and it names the call, as OpenAI's event does (the spec requires ``name``)."""
    open_item: int | None = None
    added = 0
    arguments = ""
    name = None
    for kind, data in events:
        if kind == "response.output_item.added":
            assert open_item is None, f"item {data['output_index']} added in item {open_item}"
            assert data["output_index"] == added
            open_item, added, arguments = added, added + 1, ""
            name = data["item"].get("name")
        elif kind == "response.output_item.done":
            assert data["output_index"] == open_item
            open_item = None
        elif "output_index" in data:
            assert data["output_index"] == open_item, f"{kind} of a closed item: {data}"
            if kind == "response.function_call_arguments.delta":
                arguments += data["delta"]
            elif kind == "response.function_call_arguments.done":
                assert data["arguments"] == arguments
                assert data["name"] == name
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            assert open_item is None


def blocks(content: list[Any]) -> list[tuple[str, Any, Any]]:
    """A message's content blocks: type, and text or input."""
    return [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in content]


def items(output: list[Any]) -> list[tuple[str, Any]]:
    """A response's output items: type, and a call's arguments."""
    return [(item.type, getattr(item, "arguments", None)) for item in output]


ASK: Any = {
    "model": "m",
    "max_tokens": 100,
    "tools": TOOLS,
    "messages": [{"role": "user", "content": "weather and time in Paris?"}],
}
RESPONSES_ASK: Any = {"model": "m", "input": "weather and time?", "tools": RESPONSES_TOOLS}


async def test_interleaved_calls_are_sequential_tool_use_blocks_the_anthropic_sdk_assembles():
    async with relaying_to(ScriptedChunks(INTERLEAVED)) as url:
        events = [e async for e in raw_events(url, "/v1/messages", {**ASK, "stream": True})]
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        async with client:
            async with client.messages.stream(**ASK) as stream:
                message = await stream.get_final_message()
            whole = await client.messages.create(**ASK)
    assert_blocks_one_at_a_time(events)
    assert blocks(message.content) == blocks(whole.content)
    assert blocks(message.content) == [
        ("text", "Checking. ", None),
        ("tool_use", None, json.loads(WEATHER)),
        ("tool_use", None, json.loads(TIME)),  # its fragments came before the text's
        ("text", "One moment. ", None),
    ]
    ids = [block.id for block in message.content if block.type == "tool_use"]
    assert ids == ["call_get_weather", "call_get_time"]
    assert message.stop_reason == "tool_use"
    partials = "".join(
        data["delta"]["partial_json"]
        for kind, data in events
        if kind == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
    )
    assert partials == WEATHER + TIME  # every fragment, each call's together


async def test_interleaved_calls_are_sequential_function_call_items_the_openai_sdk_assembles():
    async with relaying_to(ScriptedChunks(INTERLEAVED)) as url:
        body = {**RESPONSES_ASK, "stream": True}
        events = [e async for e in raw_events(url, "/v1/responses", body)]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            async with client.responses.stream(**RESPONSES_ASK) as stream:
                response = await stream.get_final_response()
            whole = await client.responses.create(**RESPONSES_ASK)
    assert_items_one_at_a_time(events)
    assert items(response.output) == items(whole.output)
    assert items(response.output) == [
        ("message", None),
        ("function_call", WEATHER),
        ("function_call", TIME),  # its fragments came before the text's
        ("message", None),
    ]
    assert [i.call_id for i in response.output if i.type == "function_call"] == [
        "call_get_weather",
        "call_get_time",
    ]
    assert response.output_text == "Checking. One moment. "
    done = [data["item"] for kind, data in events if kind == "response.output_item.done"]
    assert [item.get("arguments") for item in done] == [None, WEATHER, TIME, None]


async def test_a_reply_cut_mid_arguments_still_sends_every_held_fragment_before_it_ends():
    # The token limit cuts call 0's arguments: what waited for them (call 1, whole) goes
    # out before the ending, in its own block and item.
    deltas = [
        calls(named(0, "get_weather")),
        calls(named(1, "get_time")),
        calls(fragment(0, '{"city": ')),
        calls(fragment(1, TIME)),
        calls(fragment(0, '"Pa')),
    ]
    async with relaying_to(ScriptedChunks(deltas, finish_reason="length")) as url:
        messages = [e async for e in raw_events(url, "/v1/messages", {**ASK, "stream": True})]
        body = {**RESPONSES_ASK, "stream": True}
        responses = [e async for e in raw_events(url, "/v1/responses", body)]
    assert_blocks_one_at_a_time(messages)
    assert_items_one_at_a_time(responses)
    assert messages[-2][1]["delta"]["stop_reason"] == "max_tokens"
    uses = [d["content_block"]["name"] for k, d in messages if k == "content_block_start"]
    assert uses == ["get_weather", "get_time"]
    last = responses[-1][1]["response"]
    assert last["status"] == "incomplete"
    assert [item["arguments"] for item in last["output"]] == ['{"city": "Pa', TIME]


async def test_a_sequential_calls_events_go_out_before_the_next_call_is_sent_upstream():
    # The upstream sends call 1 only once the client has read all of call 0 (and later the
    # ending only once it has read call 1): a server holding anything back never gets them.
    for path, ask in (("/v1/messages", ASK), ("/v1/responses", RESPONSES_ASK)):
        deltas = [
            calls(named(0, "get_weather")),
            calls(fragment(0, WEATHER[:20])),
            calls(fragment(0, WEATHER[20:])),
            calls(named(1, "get_time")),
            calls(fragment(1, TIME)),
        ]
        gates = {3: asyncio.Event(), 5: asyncio.Event()}
        seen: list[tuple[str, dict[str, Any]]] = []
        arguments = {0: "", 1: ""}
        async with relaying_to(ScriptedChunks(deltas, gates=gates)) as url:
            async for kind, data in raw_events(url, path, {**ask, "stream": True}):
                seen.append((kind, data))
                if kind == "content_block_delta" and "partial_json" in data["delta"]:
                    arguments[data["index"]] += data["delta"]["partial_json"]
                elif kind == "response.function_call_arguments.delta":
                    arguments[data["output_index"]] += data["delta"]
                if arguments[0] == WEATHER:
                    gates[3].set()
                if arguments[1] == TIME:
                    gates[5].set()
        assert arguments == {0: WEATHER, 1: TIME}
        if path == "/v1/messages":
            assert_blocks_one_at_a_time(seen)
        else:
            assert_items_one_at_a_time(seen)
