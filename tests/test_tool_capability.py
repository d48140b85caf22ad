"""An engine that cannot make tool calls refuses a forced ``tool_choice`` with a 400 naming it,
in each API's own error shape, read by the official SDKs over a real server; ``"auto"`` is
answered with text (the model chose not to call)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import openai
import pytest

from replystream.engine.base import Engine
from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.test_tool_calls import ANTHROPIC_TOOLS, CHAT_TOOLS, RESPONSES_TOOLS, USER

FORCED_CHAT: list[Any] = ["required", {"type": "function", "function": {"name": "get_time"}}]
FORCED_RESPONSES: list[Any] = ["required", {"type": "function", "name": "get_time"}]
FORCED_ANTHROPIC: list[Any] = [{"type": "any"}, {"type": "tool", "name": "get_time"}]


@asynccontextmanager
async def clients(engine: Engine) -> AsyncIterator[tuple[str, Any, Any]]:
    async with running(create_app(engine)) as url:
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        async with oai, claude:
            yield engine.name, oai, claude


@pytest.fixture(params=["simulated", "tiny"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Any, Any]]:
    engine: Engine = fast_engine() if request.param == "simulated" else load_default_engine()
    async with clients(engine) as served:
        yield served


async def test_a_forced_tool_choice_is_refused_by_an_engine_without_tool_calls(
    served: tuple[str, Any, Any],
):
    model, oai, claude = served
    refusals: list[Any] = []
    for choice in FORCED_CHAT:
        for extra in ({}, {"n": 2}, {"stream": True}):
            with pytest.raises(openai.BadRequestError) as error:
                await oai.chat.completions.create(
                    model=model, messages=USER, tools=CHAT_TOOLS, tool_choice=choice, **extra
                )
            refusals.append(error.value)
    for choice in FORCED_RESPONSES:
        with pytest.raises(openai.BadRequestError) as error:
            await oai.responses.create(
                model=model, input="hi", tools=RESPONSES_TOOLS, tool_choice=choice, store=False
            )
        refusals.append(error.value)
    for choice in FORCED_ANTHROPIC:
        with pytest.raises(anthropic.BadRequestError) as claude_error:
            await claude.messages.create(
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
    chat = await oai.chat.completions.create(
        model=model, messages=USER, tools=CHAT_TOOLS, tool_choice="auto", max_tokens=3
    )
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].message.content
    message = await claude.messages.create(
        model=model, max_tokens=3, messages=USER, tools=ANTHROPIC_TOOLS
    )
    assert [block.type for block in message.content] == ["text"]
