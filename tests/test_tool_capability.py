"""What an engine can do with tools, told to clients, read by the official SDKs over real servers.

An engine that cannot make tool calls refuses a forced ``tool_choice`` with a 400 naming it, in
each API's own error shape; ``"auto"`` is answered with text (the model chose not to call).
``parallel_tool_calls: false`` (Anthropic: ``disable_parallel_tool_use``) is passed upstream by
the relay, and a reply script of several calls refuses it rather than break it. A reply script
keeps to ``tool_choice``: ``"none"`` leaves its calls out, a named function all calls but its
own, and a choice the script cannot honour is a 400 naming ``tool_choice``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from replystream.engine.base import Engine
from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.processes import replica
from tests.test_tool_calls import (
    ANTHROPIC_TOOLS,
    CHAT_TOOLS,
    RESPONSES_TOOLS,
    SCRIPT,
    TEXT,
    USER,
    body_of,
    chunks_of,
    claude,
    oai,
    scripted,
    tool_call_deltas,
)

FORCED_CHAT: list[Any] = ["required", {"type": "function", "function": {"name": "get_time"}}]
FORCED_RESPONSES: list[Any] = ["required", {"type": "function", "name": "get_time"}]
FORCED_ANTHROPIC: list[Any] = [{"type": "any"}, {"type": "tool", "name": "get_time"}]


@asynccontextmanager
async def clients(engine: Engine) -> AsyncIterator[tuple[str, Any, Any]]:
    async with running(create_app(engine)) as url, oai(url) as openai_client:
        async with claude(url) as anthropic_client:
            yield engine.name, openai_client, anthropic_client


@pytest.fixture(params=["simulated", "tiny"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Any, Any]]:
    engine: Engine = fast_engine() if request.param == "simulated" else load_default_engine()
    async with clients(engine) as served:
        yield served


async def test_a_forced_tool_choice_is_refused_by_an_engine_without_tool_calls(
    served: tuple[str, Any, Any],
):
    model, openai_client, anthropic_client = served
    refusals: list[Any] = []
    for choice in FORCED_CHAT:
        for extra in ({}, {"n": 2}, {"stream": True}):
            with pytest.raises(openai.BadRequestError) as error:
                await openai_client.chat.completions.create(
                    model=model, messages=USER, tools=CHAT_TOOLS, tool_choice=choice, **extra
                )
            refusals.append(error.value)
    for choice in FORCED_RESPONSES:
        with pytest.raises(openai.BadRequestError) as error:
            await openai_client.responses.create(
                model=model, input="hi", tools=RESPONSES_TOOLS, tool_choice=choice, store=False
            )
        refusals.append(error.value)
    for choice in FORCED_ANTHROPIC:
        with pytest.raises(anthropic.BadRequestError) as claude_error:
            await anthropic_client.messages.create(
                model=model, max_tokens=5, messages=USER, tools=ANTHROPIC_TOOLS, tool_choice=choice
            )
        body: Any = claude_error.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        refusals.append(claude_error.value)
    for refusal in refusals:
        assert refusal.status_code == 400
        error = refusal.body.get("error", refusal.body)
        assert error["param"] == "tool_choice", refusal.body
        assert "cannot make tool calls" in error["message"]

    # "auto" (and no choice) are served: the engine chose text.
    chat = await openai_client.chat.completions.create(
        model=model, messages=USER, tools=CHAT_TOOLS, tool_choice="auto", max_tokens=3
    )
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].message.content
    message = await anthropic_client.messages.create(
        model=model, max_tokens=3, messages=USER, tools=ANTHROPIC_TOOLS
    )
    assert [block.type for block in message.content] == ["text"]


async def test_parallel_tool_calls_false_refuses_a_script_of_two_calls_directly_and_relayed(
    tmp_path: Path,
):
    async with (
        scripted(tmp_path) as (_, upstream),  # SCRIPT makes two calls
        replica("--engine", f"upstream:{upstream}/v1", "--model-name", "simulated") as (_, front),
    ):
        # Through the relay, the refusal is the upstream's: it was sent the field.
        for url in (upstream, front):
            async with oai(url) as client, claude(url) as anthropic_client:
                with pytest.raises(openai.BadRequestError) as chat:
                    await client.chat.completions.create(
                        model="simulated",
                        messages=USER,
                        tools=CHAT_TOOLS,
                        parallel_tool_calls=False,
                    )
                with pytest.raises(openai.BadRequestError) as responses:
                    await client.responses.create(
                        model="simulated",
                        input="hi",
                        tools=RESPONSES_TOOLS,
                        parallel_tool_calls=False,
                        store=False,
                    )
                with pytest.raises(anthropic.BadRequestError) as messages:
                    await anthropic_client.messages.create(
                        model="simulated",
                        max_tokens=50,
                        messages=USER,
                        tools=ANTHROPIC_TOOLS,
                        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                    )
            params = [body_of(e)["param"] for e in (chat, responses)]
            assert params == ["parallel_tool_calls", "parallel_tool_calls"], url
            claude_error: Any = messages.value.body
            assert claude_error["error"]["param"] == "tool_choice.disable_parallel_tool_use"
            assert "parallel tool calls are disabled" in claude_error["error"]["message"]
            # Allowed (true, or not said): both calls.
            async with oai(url) as client:
                whole = await client.chat.completions.create(
                    model="simulated", messages=USER, tools=CHAT_TOOLS, parallel_tool_calls=True
                )
                response = await client.responses.create(
                    model="simulated", input="hi", tools=RESPONSES_TOOLS, store=False
                )
            assert len(whole.choices[0].message.tool_calls) == 2
            assert response.parallel_tool_calls is True


async def test_parallel_tool_calls_false_serves_one_call_and_the_response_says_so(
    tmp_path: Path,
):
    one_call = [SCRIPT[0], SCRIPT[2]]
    async with scripted(tmp_path, one_call) as (_, url), oai(url) as client:
        chat = await client.chat.completions.create(
            model="simulated", messages=USER, tools=CHAT_TOOLS, parallel_tool_calls=False
        )
        response = await client.responses.create(
            model="simulated",
            input="hi",
            tools=RESPONSES_TOOLS,
            parallel_tool_calls=False,
            store=False,
        )
    assert [call.function.name for call in chat.choices[0].message.tool_calls] == ["get_weather"]
    assert response.parallel_tool_calls is False
    assert [item.type for item in response.output][-1] == "function_call"


async def test_a_reply_script_leaves_out_the_calls_tool_choice_forbids_in_every_dialect(
    tmp_path: Path,
):
    async with scripted(tmp_path) as (_, url), oai(url) as client, claude(url) as other:
        # "none": the script's text, no calls, ending as text ends.
        chat = await client.chat.completions.create(
            model="simulated", messages=USER, tools=CHAT_TOOLS, tool_choice="none"
        )
        assert chat.choices[0].message.content == TEXT
        assert chat.choices[0].message.tool_calls is None
        assert chat.choices[0].finish_reason == "stop"
        response = await client.responses.create(
            model="simulated", input="hi", tools=RESPONSES_TOOLS, tool_choice="none", store=False
        )
        assert [item.type for item in response.output] == ["message"]
        assert response.output_text == TEXT
        message = await other.messages.create(
            model="simulated",
            max_tokens=50,
            messages=USER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "none"},
        )
        assert [block.type for block in message.content] == ["text"]
        assert message.stop_reason == "end_turn"

        # A named function: only its calls, numbered from 0 (one call: parallel false is met).
        named = {"type": "function", "function": {"name": "get_time"}}
        chunks = await chunks_of(
            url,
            {
                "model": "simulated",
                "messages": USER,
                "tools": CHAT_TOOLS,
                "tool_choice": named,
                "parallel_tool_calls": False,
                "stream": True,
            },
        )
        calls = tool_call_deltas(chunks)
        assert {call["index"] for call in calls} == {0}
        assert [call["function"].get("name") for call in calls if "id" in call] == ["get_time"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        response = await client.responses.create(
            model="simulated",
            input="hi",
            tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "get_time"},
            store=False,
        )
        assert [item.name for item in response.output if item.type == "function_call"] == [
            "get_time"
        ]
        message = await other.messages.create(
            model="simulated",
            max_tokens=50,
            messages=USER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert [b.name for b in message.content if b.type == "tool_use"] == ["get_weather"]

        # A function the script never calls: refused in each API's shape, naming tool_choice.
        tools = [*CHAT_TOOLS, {"type": "function", "function": {"name": "get_news"}}]
        with pytest.raises(openai.BadRequestError) as chat_error:
            await client.chat.completions.create(
                model="simulated",
                messages=USER,
                tools=tools,
                tool_choice={"type": "function", "function": {"name": "get_news"}},
                stream=True,
            )
        with pytest.raises(openai.BadRequestError) as responses_error:
            await client.responses.create(
                model="simulated",
                input="hi",
                tools=[*RESPONSES_TOOLS, {"type": "function", "name": "get_news"}],
                tool_choice={"type": "function", "name": "get_news"},
                store=False,
            )
        with pytest.raises(anthropic.BadRequestError) as claude_error:
            await other.messages.create(
                model="simulated",
                max_tokens=50,
                messages=USER,
                tools=[*ANTHROPIC_TOOLS, {"name": "get_news", "input_schema": {"type": "object"}}],
                tool_choice={"type": "tool", "name": "get_news"},
            )
    for error in (body_of(chat_error), body_of(responses_error), body_of(claude_error)["error"]):
        assert error["param"] == "tool_choice", error
        assert "'get_news'" in error["message"]


async def test_a_reply_script_refuses_a_tool_choice_it_cannot_honour(tmp_path: Path):
    async with scripted(tmp_path, SCRIPT[:2]) as (_, url), oai(url) as client:  # text only
        with pytest.raises(openai.BadRequestError) as required:
            await client.chat.completions.create(
                model="simulated", messages=USER, tools=CHAT_TOOLS, tool_choice="required"
            )
        async with claude(url) as other:
            with pytest.raises(anthropic.BadRequestError) as any_tool:
                await other.messages.create(
                    model="simulated",
                    max_tokens=50,
                    messages=USER,
                    tools=ANTHROPIC_TOOLS,
                    tool_choice={"type": "any"},
                )
    calls_only = [SCRIPT[2]]
    async with scripted(tmp_path, calls_only) as (_, url), oai(url) as client:
        with pytest.raises(openai.BadRequestError) as none:
            await client.responses.create(
                model="simulated", input="hi", tools=RESPONSES_TOOLS, tool_choice="none"
            )
    for error in (body_of(required), body_of(any_tool)["error"], body_of(none)):
        assert error["param"] == "tool_choice", error
