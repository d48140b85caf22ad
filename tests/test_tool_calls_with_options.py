"""Tool calls together with stop strings, log probabilities, several choices and the usage
chunk, read by the official SDKs over a real scripted server.

A tool call ends the text before it: a tail withheld because it could begin a stop string is
released before the call, no stop string is matched across a call, each text chunk carries
exactly its own tokens' log probabilities (tool-call chunks none), and with ``n > 1`` every
choice makes its own calls under its own ``index``. Streamed must equal whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.processes import replica
from tests.test_tool_calls import ANTHROPIC_TOOLS, CHAT_TOOLS, USER, claude, oai, scripted

STOPS = ["##END", "STOP"]
WEATHER = ['{"city":', ' "Paris"}']
TIME = ['{"tz":', ' "CET"}']
SCRIPT: list[dict[str, Any]] = [
    {"text": "Looking ", "delay_ms": 2},
    {"text": "it up #", "delay_ms": 2},  # "#" could begin "##END": withheld until the call
    {"tool_call": {"name": "get_weather", "id": "call_W", "arguments": WEATHER}, "delay_ms": 2},
    {"text": "Done. ST", "delay_ms": 2},  # "ST" could begin "STOP"
    {"tool_call": {"name": "get_time", "id": "call_T", "arguments": TIME}, "delay_ms": 2},
    {"text": "OP now", "delay_ms": 2},  # "ST" + "OP" spans a call: not a stop string
]
TEXT = "Looking it up #Done. STOP now"
TOKENS = 4 + (1 + len(WEATHER)) + (1 + len(TIME))  # every delta of the script is one token
CALLS = [("call_W", "get_weather", "".join(WEATHER)), ("call_T", "get_time", "".join(TIME))]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    async with scripted(tmp_path, SCRIPT) as (_, url):
        yield url


def calls_of(message: Any) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(
    "delivery",
    [{}, {"holdback_tokens": 2, "batch_tokens": 3}],
    ids=["per-token", "held-and-batched"],
)
async def test_n_2_tool_calls_with_stops_logprobs_and_usage_streamed_equal_whole(
    server: str, delivery: dict[str, Any]
):
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": USER,
        "tools": CHAT_TOOLS,
        "n": 2,
        "stop": STOPS,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": delivery,
    }
    text: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    pieces: dict[int, list[Any]] = {0: [], 1: []}
    usage = None
    async with oai(server) as client:
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            if not chunk.choices:
                usage = chunk.usage
                continue
            [choice] = chunk.choices
            content = choice.delta.content
            if choice.delta.tool_calls:
                assert content is None and choice.logprobs is None
                pieces[choice.index] += choice.delta.tool_calls
            if content:
                # This chunk's tokens (a token split by a withheld tail goes with its first
                # part): the text so far is never ahead of its tokens' text.
                assert choice.logprobs is not None and choice.logprobs.content is not None
                tokens[choice.index] += [entry.token for entry in choice.logprobs.content]
                text[choice.index] += content
                assert "".join(tokens[choice.index]).startswith(text[choice.index])
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
        whole = await client.chat.completions.create(**ask)

    assert usage is not None
    assert (usage.completion_tokens, usage.prompt_tokens) == (2 * TOKENS, whole.usage.prompt_tokens)
    assert whole.usage.completion_tokens == 2 * TOKENS
    for index in (0, 1):
        assert text[index] == "".join(tokens[index]) == TEXT
        assert finishes[index] == ["tool_calls"]
        # Each choice's calls, piece by piece, under that choice's index.
        named = [(p.index, p.id, p.function.name) for p in pieces[index] if p.id is not None]
        assert named == [(0, "call_W", "get_weather"), (1, "call_T", "get_time")]
        for call_index, (_, _, arguments) in enumerate(CALLS):
            joined = "".join(p.function.arguments for p in pieces[index] if p.index == call_index)
            assert joined == arguments
        choice = whole.choices[index]
        assert choice.index == index
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == TEXT
        assert calls_of(choice.message) == CALLS
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [entry.token for entry in choice.logprobs.content] == tokens[index]


async def test_a_stop_string_in_text_after_a_call_still_ends_the_reply(tmp_path: Path):
    steps = [*SCRIPT[:3], {"text": "Done. ##E", "delay_ms": 2}, {"text": "ND more"}]
    async with scripted(tmp_path, steps) as (_, url):
        async with oai(url) as client:
            ask: dict[str, Any] = {"model": "simulated", "messages": USER, "stop": STOPS}
            ask["tools"] = CHAT_TOOLS
            streamed, finish = "", None
            async for chunk in await client.chat.completions.create(**ask, stream=True):
                streamed += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            whole = await client.chat.completions.create(**ask)
    assert streamed == whole.choices[0].message.content == "Looking it up #Done. "
    # It made a call: it ends as one that did (as vLLM ends it), since an agent runs the
    # calls on the finish reason alone.
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert calls_of(whole.choices[0].message) == CALLS[:1]


async def test_anthropic_stop_sequences_and_tool_use_streamed_equal_whole(server: str):
    ask: dict[str, Any] = {
        "model": "simulated",
        "max_tokens": 100,
        "messages": USER,
        "tools": ANTHROPIC_TOOLS,
        "stop_sequences": STOPS,
    }
    async with claude(server) as client:
        async with client.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
        whole = await client.messages.create(**ask)
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None
    texts = "".join(block.text for block in whole.content if block.type == "text")
    assert texts == TEXT
    uses = [(b.id, b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert uses == [
        ("call_W", "get_weather", {"city": "Paris"}),
        ("call_T", "get_time", {"tz": "CET"}),
    ]


async def test_relayed_tool_calls_with_logprobs_and_stops_equal_the_upstreams(tmp_path: Path):
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": USER,
        "tools": CHAT_TOOLS,
        "stop": STOPS,
        "logprobs": True,
        "top_logprobs": 1,
    }

    async def read(url: str) -> tuple[str, list[str], list[tuple[int, str | None, str]], Any]:
        text, tokens, pieces, finish = "", [], [], None
        async with oai(url) as client:
            async for chunk in await client.chat.completions.create(**ask, stream=True):
                [choice] = chunk.choices
                for piece in choice.delta.tool_calls or ():
                    assert choice.logprobs is None
                    pieces.append((piece.index, piece.id, piece.function.arguments))
                if choice.delta.content:
                    text += choice.delta.content
                    tokens += [entry.token for entry in choice.logprobs.content]
                finish = choice.finish_reason or finish
        return text, tokens, pieces, finish

    async with (
        scripted(tmp_path, SCRIPT) as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1", "--model-name", "simulated") as (_, front),
    ):
        direct = await read(upstream)
        relayed = await read(front)
    assert relayed == direct
    text, tokens, pieces, finish = relayed
    assert text == "".join(tokens) == TEXT and finish == "tool_calls"
    assert [(index, call_id) for index, call_id, _ in pieces if call_id] == [
        (0, "call_W"),
        (1, "call_T"),
    ]
