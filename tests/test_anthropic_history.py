"""A conversation's history on ``POST /v1/messages`` and its ``count_tokens``, through the
anthropic SDK: what Anthropic's API takes back as history is taken (a response's blocks as
the SDK dumps them), and what it refuses is refused as a 400 in its shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running

USER: Any = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
SCRIPT = [
    {"text": "Let me look."},
    {"tool_call": {"name": "get_weather", "id": "toolu_1", "arguments": '{"city": "Paris"}'}},
]


@pytest.fixture
async def client() -> AsyncIterator[anthropic.AsyncAnthropic]:
    engine = simulated_engine(
        SimulatedConfig(delay_ms=1.0, jitter_ms=0.0, script=parse_reply_script(SCRIPT))
    )
    async with (
        running(create_app(engine)) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as sdk,
    ):
        yield sdk


async def test_a_replys_blocks_dumped_by_the_sdk_are_taken_back_as_history(
    client: anthropic.AsyncAnthropic,
):
    ask: Any = {"model": "simulated", "tools": TOOLS}
    called = await client.messages.create(**ask, max_tokens=50, messages=[USER])
    assert [block.type for block in called.content] == ["text", "tool_use"]
    dumped = [block.model_dump() for block in called.content]
    assert {"caller", "toolset_name"} <= set(dumped[1])  # what the SDK's dump holds
    answer = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    history = [
        USER,
        {"role": "assistant", "content": dumped},
        {"role": "user", "content": [{**answer, "toolset_name": None}]},
    ]
    again = await client.messages.create(**ask, max_tokens=50, messages=history)
    counted = await client.messages.count_tokens(**ask, messages=history)
    assert again.stop_reason == "tool_use" and counted.input_tokens > 0
