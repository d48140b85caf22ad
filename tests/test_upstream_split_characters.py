"""A character cut between two chunks by an upstream that writes JSON as Node.js does: each
half of its UTF-16 pair a lone surrogate escape (``"\\ud83d"``, then ``"\\ude00"``), each
event valid JSON. The halves are joined into the one character, in a text, in thinking and in
each tool call's arguments alike; a half whose other never comes is U+FFFD; neither ends the
reply. Over a real relay and scripted aiohttp upstreams on loopback sockets (read by the
official SDKs in the chat, Anthropic Messages and Responses dialects), and on the chunk reader
alone for reads cut anywhere."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from replystream.engine.upstream_chunks import ChunkReader
from tests.sse_client import post_events
from tests.test_upstream_routing import Scripted, relay

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def event(content: str | None = None, finish: str | None = None, **delta: Any) -> bytes:
    """A chat chunk as Node.js's ``JSON.stringify`` writes it: every character outside
    ASCII escaped here, so a lone surrogate is a lone escape (``ensure_ascii``)."""
    if content is not None:
        delta["content"] = content
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


# "Hi 😀 there 😀!": its first emoji cut between two chunks, its second too, within texts.
SPLIT = [
    event("Hi "),
    event("there "),  # a template to learn: common chunks read by their bytes
    event("\ud83d"),
    event("\ude00"),
    event(" there \ud83d"),
    event("\ude00!"),
]


async def relayed(events: list[bytes]) -> tuple[str, bytes]:
    async with relay([Scripted([*events, event(None, "stop")])]) as url:
        got = await post_events(f"{url}/v1/chat/completions", CHAT)
    assert got.status == 200
    return got.chat_text, got.raw


async def test_a_character_split_between_chunks_is_joined_into_the_one_character():
    text, raw = await relayed(SPLIT)
    assert text == "Hi there \U0001f600 there \U0001f600!"
    assert b"upstream_bad_chunk" not in raw and b'"finish_reason":"stop"' in raw


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([event("a\ud83d"), event("b")], "a\ufffdb"),  # a high half, then no low one
        # The same after common chunks taught their bytes, and with one more after it.
        ([event("x"), event("y"), event("a\ud83d"), event("b"), event("c")], "xya\ufffdbc"),
        ([event("a"), event("\ude00b")], "a\ufffdb"),  # a low half with no high one before
        ([event("a\ud83dz\ude00b")], "a\ufffdz\ufffdb"),  # lone halves within a text
        ([event("a"), event("\ud83d")], "a\ufffd"),  # a high half, then the finish
        ([event("\ud83d"), event("\ud83d"), event("\ude00")], "\ufffd\U0001f600"),
    ],
)
async def test_a_half_of_a_character_alone_is_a_replacement_character(
    events: list[bytes], expected: str
):
    text, raw = await relayed(events)
    assert text == expected
    assert b"upstream_bad_chunk" not in raw and b'"finish_reason":"stop"' in raw


async def test_a_lone_half_in_thinking_is_a_replacement_character_not_an_error():
    events = [event(reasoning_content="x\ud83d"), event("ok")]
    text, raw = await relayed(events)
    assert text == "ok" and b"upstream_bad_chunk" not in raw


def test_reads_cut_anywhere_make_the_same_text_and_tokens():
    body = b"".join([*SPLIT, event(None, "stop"), b"data: [DONE]\n\n"])
    for cut in range(1, len(body)):
        reader = ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 16)
        reader._take(body[:cut], 0.0)
        reader._take(body[cut:], 0.0)
        deltas = list(reader._pending)
        assert "".join(d.text for d in deltas) == "Hi there \U0001f600 there \U0001f600!"
        assert sum(d.tokens for d in deltas) == len(SPLIT)  # one token per chunk, as ever
        assert deltas[-1].finish_reason == "stop"


def test_an_event_that_is_not_json_is_still_a_bad_chunk():
    for data in (b'data: {"choices": "\\ud83d\n\n', b"data: " + b"[" * 5000 + b'"\\ud83d"\n\n'):
        reader = ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 16)
        reader._take(data, 0.0)
        assert reader._error is not None and reader._error.code == "upstream_bad_chunk"


def call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    """A chat chunk's ``tool_calls`` entry: a call's first piece when ``name`` is given."""
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": f"call_{name}", "type": "function", "function": function}


# Thinking "think 😀 more 😀", then calls whose arguments have the same character cut between
# pieces: {"a":"😀"} (its second piece the low half alone), and {"b":"x😀"} with a piece of the
# other call between its halves, as chat's indexes allow. "ok" between: no piece of text.
THOUGHT, FIRST, SECOND = (
    "think \U0001f600 more \U0001f600",
    '{"a":"\U0001f600"}',
    '{"b":"x\U0001f600"}',
)
CUT = [
    event(reasoning_content="think \ud83d"),
    event(reasoning_content="\ude00 more \ud83d"),
    event(reasoning_content="\ude00"),
    event("ok"),
    event(tool_calls=[call(0, '{"a":"\ud83d', "first")]),
    event(tool_calls=[call(0, "\ude00"), call(1, "", "second")]),
    event(tool_calls=[call(0, '"}'), call(1, '{"b":"x\ud83d')]),
    event(tool_calls=[call(0, "")]),  # an empty piece of the other call between the halves
    event(tool_calls=[call(1, '\ude00"}')]),
    event(None, "tool_calls"),
]
TOOLS: Any = [
    {"name": name, "description": name, "input_schema": {"type": "object"}}
    for name in ("first", "second")
]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}
ASK: Any = [{"role": "user", "content": "hi"}]


def pieces_of(chunks: list[Any]) -> list[tuple[str, Any]]:
    """A streamed chat reply's pieces in order: ("thought", text), ("text", text), and
    ("call", its tool_calls entry), from the SDK's chunks."""
    pieces: list[tuple[str, Any]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            thought = (choice.delta.model_extra or {}).get("reasoning_content")
            if thought:
                pieces.append(("thought", thought))
            if choice.delta.content:
                pieces.append(("text", choice.delta.content))
            pieces += [("call", piece) for piece in choice.delta.tool_calls or ()]
    return pieces


def streamed_chat(chunks: list[Any]) -> tuple[str, str, dict[int, str]]:
    """The thinking, text and each call's arguments of a streamed chat reply, joined."""
    thought, text = "", ""
    arguments: dict[int, str] = {}
    for kind, piece in pieces_of(chunks):
        if kind == "thought":
            thought += piece
        elif kind == "text":
            text += piece
        else:
            arguments[piece.index] = arguments.get(piece.index, "") + piece.function.arguments
    return thought, text, arguments


async def test_a_character_split_in_thinking_or_a_calls_arguments_is_joined_in_chat():
    async with (
        relay([Scripted(CUT)]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
        streamed = streamed_chat([chunk async for chunk in stream])
        whole = await client.chat.completions.create(model="m", messages=ASK)
    assert streamed == (THOUGHT, "ok", {0: FIRST, 1: SECOND})
    message = whole.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == THOUGHT
    assert message.content == "ok"
    assert [c.function.arguments for c in message.tool_calls or ()] == [FIRST, SECOND]  # type: ignore[union-attr]
    assert whole.choices[0].finish_reason == "tool_calls"


async def test_a_character_split_in_thinking_or_a_calls_arguments_is_joined_in_messages():
    async with (
        relay([Scripted(CUT)]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client,
    ):
        async with client.messages.stream(
            model="m", max_tokens=2048, messages=ASK, thinking=THINKING, tools=TOOLS
        ) as stream:
            thinking = "".join([e.thinking async for e in stream if e.type == "thinking"])
            streamed = await stream.get_final_message()
        whole = await client.messages.create(
            model="m", max_tokens=2048, messages=ASK, thinking=THINKING, tools=TOOLS
        )
    assert thinking == THOUGHT
    for message in (streamed, whole):
        blocks = [
            (
                b.type,
                getattr(b, "thinking", None)
                or getattr(b, "text", None)
                or getattr(b, "input", None),
            )
            for b in message.content
        ]
        assert blocks == [
            ("thinking", THOUGHT),
            ("text", "ok"),
            ("tool_use", json.loads(FIRST)),
            ("tool_use", json.loads(SECOND)),
        ]
        assert message.stop_reason == "tool_use"


async def test_a_character_split_in_thinking_or_a_calls_arguments_is_joined_in_responses():
    tools: Any = [
        {"type": "function", "name": name, "parameters": {"type": "object"}}
        for name in ("first", "second")
    ]
    async with (
        relay([Scripted(CUT)]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        stream = await client.responses.create(model="m", input="hi", tools=tools, stream=True)
        events = [e async for e in stream]
        whole = await client.responses.create(model="m", input="hi", tools=tools, store=False)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert thought == THOUGHT and arguments == [FIRST, SECOND]
    for response in (events[-1].response, whole):  # type: ignore[union-attr]
        output: Any = response.output
        reasoning, _, first, second = output
        assert reasoning.content[0].text == THOUGHT
        assert response.output_text == "ok"
        assert [first.arguments, second.arguments] == [FIRST, SECOND]


@pytest.mark.parametrize(
    ("events", "thought", "arguments"),
    [
        # A high half, then the answer: the thinking is over, its half alone (and before it).
        ([event(reasoning_content="x\ud83d"), event("\ude00ok")], "x\ufffd", {}),
        # A low half with no high one before it, in thinking and in a call's arguments.
        ([event(reasoning_content="\ude00x")], "\ufffdx", {}),
        ([event(tool_calls=[call(0, "\ude00", "f")])], "", {0: "\ufffd"}),
        # A high half, then another call's piece, then the reply's end: alone.
        (
            [
                event(tool_calls=[call(0, '{"a":"\ud83d', "f")]),
                event(tool_calls=[call(1, "{}", "g")]),
            ],
            "",
            {0: '{"a":"\ufffd', 1: "{}"},
        ),
        # A call's first piece, named, its arguments only a high half: the name goes out.
        ([event(tool_calls=[call(0, "\ud83d", "f")])], "", {0: "\ufffd"}),
        # A high half in thinking, then a call named before any of its arguments.
        (
            [
                event(reasoning_content="x\ud83d"),
                event(tool_calls=[call(0, "", "f")]),
                event(tool_calls=[call(0, "\ude00")]),
            ],
            "x\ufffd",
            {0: "\ufffd"},
        ),
        # One call's high half is no other call's: each half alone.
        (
            [
                event(tool_calls=[call(0, "\ud83d", "f")]),
                event(tool_calls=[call(1, "\ude00", "g")]),
            ],
            "",
            {0: "\ufffd", 1: "\ufffd"},
        ),
    ],
)
async def test_a_half_alone_in_thinking_or_a_calls_arguments_is_a_replacement_character(
    events: list[bytes], thought: str, arguments: dict[int, str]
):
    async with (
        relay([Scripted([*events, event(None, "stop")])]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
        chunks = [chunk async for chunk in stream]
    got = streamed_chat(chunks)
    assert (got[0], got[2]) == (thought, arguments)
    pieces = pieces_of(chunks)
    names = [piece.function.name for kind, piece in pieces if kind == "call"]
    assert len([name for name in names if name]) == len(arguments)  # each call named once
    kinds = [kind for kind, _ in pieces]
    assert kinds[: kinds.count("thought")] == ["thought"] * kinds.count("thought")  # first


def test_reads_cut_anywhere_make_the_same_thinking_arguments_and_tokens():
    body = b"".join([*CUT, b"data: [DONE]\n\n"])
    for cut in range(1, len(body)):
        reader = ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 16, reasoning=True)
        reader._take(body[:cut], 0.0)
        reader._take(body[cut:], 0.0)
        deltas = list(reader._pending)
        arguments: dict[int, str] = {}
        for d in deltas:
            if d.tool_call is not None:
                arguments[d.tool_call.index] = (
                    arguments.get(d.tool_call.index, "") + d.tool_call.arguments
                )
        assert "".join(d.reasoning for d in deltas) == THOUGHT
        assert "".join(d.text for d in deltas) == "ok"
        assert arguments == {0: FIRST, 1: SECOND}
        # One token per piece, as ever: the thoughts, the text, the calls' pieces.
        assert sum(d.tokens for d in deltas) == 3 + 1 + 7
        assert deltas[-1].finish_reason == "tool_calls"
