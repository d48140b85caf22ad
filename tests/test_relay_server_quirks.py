"""The relay in front of stand-ins that write, byte for byte, what real OpenAI-compatible model
servers write where they depart from OpenAI's own streams, read in every dialect by the
official SDKs (chat, Anthropic Messages, Responses) and as native events:
- vLLM's reasoning parsers end the thinking and begin the answer in one delta when one
  engine step made both (``{"reasoning_content": "...", "content": "..."}``: a step of
  several tokens, as speculative decoding or a busy engine's merged outputs make);
- TGI streams a tool call with no finish reason at all: its last chunk is the call's last
  piece of arguments, then its usage chunk and ``data:[DONE]`` (no space after the colon).
Each stand-in is a real aiohttp server on a loopback port (``Scripted``)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.sse_client import post_events
from tests.test_upstream_routing import Scripted, relay

ASK: Any = [{"role": "user", "content": "What is 2 + 2?"}]
VLLM = {
    "id": "chatcmpl-9f2",
    "object": "chat.completion.chunk",
    "created": 1700000000,
    "model": "m",
}


def vllm(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> bytes:
    """A chunk as vLLM's ``serving_chat`` writes it (pydantic, ``exclude_unset``)."""
    chosen = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **choice}
    body = {**VLLM, "choices": [chosen]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def thinking_then_answer(key: str) -> Scripted:
    """A reasoning model's reply whose last thought and first words came in one delta."""
    usage = {"prompt_tokens": 9, "total_tokens": 17, "completion_tokens": 8}
    return Scripted(
        (
            vllm({"role": "assistant", "content": ""}),
            vllm({key: "Two and two"}),
            vllm({key: " make four."}),
            vllm({key: " Sure.", "content": "The answer"}),
            vllm({"content": " is 4."}),
            vllm({"content": ""}, "stop", stop_reason=None),
            b"data: " + json.dumps({**VLLM, "choices": [], "usage": usage}).encode() + b"\n\n",
        )
    )


THOUGHT, ANSWER = "Two and two make four. Sure.", "The answer is 4."


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
async def test_thinking_that_ends_in_the_delta_the_answer_begins_in_is_relayed_whole(key: str):
    async with (
        relay([thinking_then_answer(key)]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
        thought, text = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                text += choice.delta.content or ""
        assert (thought, text) == (THOUGHT, ANSWER)

        whole = await client.chat.completions.create(model="m", messages=ASK)
        message = whole.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") == THOUGHT
        assert message.content == ANSWER

        async with claude.messages.stream(
            model="m",
            max_tokens=2048,
            messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 1024},
        ) as messages:
            said = await messages.get_final_message()
        thinking, text_block = said.content
        assert thinking.type == "thinking" and thinking.thinking == THOUGHT
        assert text_block.type == "text" and text_block.text == ANSWER

        async with client.responses.stream(model="m", input="What is 2 + 2?") as responding:
            response = await responding.get_final_response()
        reasoning, _ = response.output
        assert reasoning.type == "reasoning" and reasoning.content is not None
        assert "".join(part.text for part in reasoning.content) == THOUGHT
        assert response.output_text == ANSWER

        native = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
        assert "".join(t["text"] for t in native.of_type("thinking")) == THOUGHT
        assert native.text == ANSWER


TGI = {"object": "chat.completion.chunk", "id": "", "created": 1700000000, "model": "m"}


def tgi(body: dict[str, Any]) -> bytes:
    """An event as TGI's router (axum) writes it: ``data:`` with no space after the colon."""
    return b"data:" + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def tgi_piece(arguments: str, name: str | None = None) -> bytes:
    """A piece of TGI's one tool call: every piece repeats its id (``"0"``) and type, its
    name only on the first, and the role on each."""
    call = {
        "index": 0,
        "id": "0",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    delta = {"role": "assistant", "tool_calls": [call]}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return tgi({**TGI, "system_fingerprint": "3.3.6-native", "choices": [choice], "usage": None})


# TGI's tool call, as its ``ChatState`` streams it: a piece a token, the call's closing brace
# trimmed off the last, then no finish reason (the token that ended the reply comes after the
# call's JSON is whole, and makes no event), its usage, and ``[DONE]``.
TGI_CALL = (
    tgi_piece("{", "get_weather"),
    tgi_piece(' "'),
    tgi_piece("location"),
    tgi_piece('":'),
    tgi_piece(' "Paris'),
    tgi_piece('"}'),
    tgi(
        {
            **TGI,
            "choices": [],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
        }
    ),
)
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


async def test_a_tool_call_whose_stream_ends_with_done_and_no_finish_reason_is_a_finished_call():
    async with (
        relay([Scripted(TGI_CALL, done=b"data:[DONE]\n\n")]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        async with client.chat.completions.stream(
            model="m", messages=ASK, tools=TOOLS, stream_options={"include_usage": True}
        ) as stream:
            final = await stream.get_final_completion()
        whole = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        for completion in (final, whole):
            [choice] = completion.choices
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls or []
            assert call.type == "function"
            assert (call.id, call.function.name) == ("0", "get_weather")
            assert json.loads(call.function.arguments) == {"location": "Paris"}
            assert completion.usage is not None and completion.usage.completion_tokens == 9

        async with claude.messages.stream(
            model="m",
            max_tokens=64,
            messages=ASK,
            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
        ) as messages:
            said = await messages.get_final_message()
        assert said.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "input", None)) for b in said.content] == [
            ("tool_use", {"location": "Paris"})
        ]
        assert said.usage.output_tokens == 9

        tools: Any = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        async with client.responses.stream(model="m", input="Weather?", tools=tools) as responding:
            response = await responding.get_final_response()
        assert response.status == "completed"
        [item] = response.output
        assert item.type == "function_call" and json.loads(item.arguments) == {"location": "Paris"}


async def test_a_tool_call_cut_short_by_done_is_still_a_failure():
    """llama-cpp-python's server ends a running stream with ``[DONE]`` and no finish reason
    when another request comes: a call's arguments left unclosed are no finished call."""
    async with relay([Scripted(TGI_CALL[:4], done=b"data:[DONE]\n\n")]) as url:
        got = await post_events(
            f"{url}/v1/chat/completions",
            {"model": "m", "messages": ASK, "tools": TOOLS, "stream": True},
        )
    *_, last = got.events
    assert last.type == "error"
    assert json.loads(last.data)["error"]["code"] == "upstream_bad_chunk"
    assert all('"finish_reason":"tool_calls"' not in e.data for e in got.events)
