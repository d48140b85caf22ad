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


def use(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {}}


def answer(call_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "sunny"}


TEXT = {"type": "text", "text": "and tomorrow?"}


def said(role: str, *content: Any) -> dict[str, Any]:
    return {"role": role, "content": list(content)}


@pytest.mark.parametrize(
    ("turns", "missing"),
    [
        ([said("assistant", use("t1")), said("user", TEXT, answer("t1"))], "t1"),
        ([said("assistant", use("t1"), use("t2")), said("user", answer("t1"))], "t2"),
        (
            [
                said("assistant", use("t1"), use("t2")),
                said("user", answer("t1"), TEXT, answer("t2")),
            ],
            "t2",
        ),
        (
            [
                said("assistant", use("t1")),
                said("user", TEXT),
                said("assistant", {"type": "text", "text": "ok"}),
                said("user", answer("t1")),
            ],
            "t1",
        ),
    ],
)
async def test_calls_not_answered_first_in_the_next_turn_are_refused_as_anthropic_does(
    client: anthropic.AsyncAnthropic, turns: list[dict[str, Any]], missing: str
):
    ask: Any = {"model": "simulated", "tools": TOOLS, "messages": [USER, *turns]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(**ask, max_tokens=5)
    with pytest.raises(anthropic.BadRequestError) as not_counted:
        await client.messages.count_tokens(**ask)
    for error in (refused.value.body["error"], not_counted.value.body["error"]):  # type: ignore[index]
        assert (error["type"], error["param"]) == ("invalid_request_error", "messages[1]")
        assert error["message"].startswith(
            f"messages.1: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {missing}."
        )


SERVED: list[Any] = [
    # Results first, then the user's text; or the results in a message of their own.
    [said("assistant", use("t1"), use("t2")), said("user", answer("t2"), answer("t1"), TEXT)],
    [said("assistant", use("t1")), said("user", answer("t1")), said("user", TEXT)],
    # Consecutive messages of one role are one turn: the calls may come in an earlier one.
    [said("assistant", use("t1")), said("assistant", TEXT), said("user", answer("t1"))],
    # Calls no turn has answered yet end the conversation.
    [said("assistant", use("t1"))],
]


async def test_only_what_anthropic_refuses_is_refused(client: anthropic.AsyncAnthropic):
    ask: Any = {"model": "simulated", "tools": TOOLS}
    for turns in SERVED:
        message = await client.messages.create(**ask, max_tokens=5, messages=[USER, *turns])
        counted = await client.messages.count_tokens(**ask, messages=[USER, *turns])
        assert message.stop_reason in ("tool_use", "max_tokens") and counted.input_tokens > 0
    # The same answer after the user's text is not: the results lead the turn.
    late: Any = [said("assistant", use("t1")), said("user", TEXT, answer("t1"))]
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(**ask, max_tokens=5, messages=[USER, *late])


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([{"role": "user", "content": ""}], "messages[0].content", "messages.0: all messages"),
        ([said("user")], "messages[0].content", "must have non-empty content"),
        (
            [said("user", {"type": "text", "text": ""})],
            "messages[0].content[0].text",
            "messages.0.content.0.text: text content blocks must be non-empty",
        ),
        (
            [said("user", {"type": "text", "text": " \n"})],
            "messages[0].content[0].text",
            "messages.0.content.0.text: text content blocks must contain non-whitespace text",
        ),
        (
            [USER, said("assistant", {"type": "text", "text": "\n\n"}), USER],
            "messages[1].content[0].text",
            "messages.1.content.0.text: text content blocks must contain non-whitespace text",
        ),
        (
            [USER, said("assistant"), USER],
            "messages[1].content",
            "messages.1: all messages must have non-empty content except for the optional "
            "final assistant message",
        ),
        (
            [USER, said("assistant", {**use("t1"), "id": ""}), said("user", answer(""))],
            "messages[1].content[0].id",
            "at least 1 character",
        ),
    ],
)
async def test_empty_content_is_refused_as_anthropic_refuses_it(
    client: anthropic.AsyncAnthropic, messages: list[dict[str, Any]], param: str, says: str
):
    ask: Any = {"model": "simulated", "tools": TOOLS, "messages": messages}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(**ask, max_tokens=5)
    with pytest.raises(anthropic.BadRequestError) as not_counted:
        await client.messages.count_tokens(**ask)
    for error in (refused.value.body["error"], not_counted.value.body["error"]):  # type: ignore[index]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert says in error["message"]


async def test_a_prefill_may_be_empty_but_may_not_end_in_whitespace(
    client: anthropic.AsyncAnthropic,
):
    ask: Any = {"model": "simulated", "max_tokens": 5}
    prefill: Any
    for prefill in ("", [], "It is", [TEXT, use("t1")]):
        message = await client.messages.create(
            **ask, messages=[USER, {"role": "assistant", "content": prefill}]
        )
        assert message.stop_reason in ("tool_use", "max_tokens")
    for prefill in ("It is ", [{"type": "text", "text": "It is\n"}], " "):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(
                **ask, messages=[USER, {"role": "assistant", "content": prefill}]
            )
        error = refused.value.body["error"]  # type: ignore[index]
        assert error["param"] == "messages[1].content"
        assert error["message"] == (
            "messages.1: final assistant content cannot end with trailing whitespace"
        )
