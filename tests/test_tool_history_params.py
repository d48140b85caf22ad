"""A mistake in a request's tool-call history names the client's own place, through the SDKs.

``/v1/messages`` and ``/v1/responses`` turn their requests into chat messages before checking
that every tool result answers a call once; a system message (``system``, ``instructions``)
or a stored history comes first there, and one Anthropic message may become several. The
error's ``param`` is still the path in what the client sent. A call left unanswered is
refused by each API's own rule: chat's (and the native route's) tool messages right after
the call, Responses' output anywhere after it."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from replystream.server import create_app, running
from tests.chat_upstream import RecordingUpstream, relaying_to
from tests.conftest import fast_engine

USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
ANSWER = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
STRAY = {"type": "tool_result", "tool_use_id": "nobody", "content": "r"}


def sent(body: object) -> Any:
    """A request field as sent over the wire (the SDKs' parameter types are not checked)."""
    return body


async def anthropic_refusal(messages: list[dict[str, Any]]) -> dict[str, Any]:
    async with (
        running(create_app(fast_engine())) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(
                model="simulated", max_tokens=3, system="be brief", messages=sent(messages)
            )
    body = refused.value.body
    assert isinstance(body, dict)
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(
    ("last_turn", "param", "says"),
    [
        # The user's text after the results is its own chat message: still messages[2].
        ([ANSWER, ANSWER, {"type": "text", "text": "go on"}], "messages[2].content[1]", "twice"),
        ([{"type": "text", "text": "see"}, STRAY], "messages[2].content[1]", "no earlier"),
    ],
)
async def test_an_anthropic_tool_result_mistake_names_its_block_after_a_system_message(
    last_turn: list[dict[str, Any]], param: str, says: str
):
    error = await anthropic_refusal(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [USE]},
            {"role": "user", "content": last_turn},
        ]
    )
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert says in error["message"]


async def test_an_anthropic_tool_use_id_given_twice_names_the_second_block():
    text = {"type": "text", "text": "calling"}
    error = await anthropic_refusal(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [text, USE, USE]},
            {"role": "user", "content": [ANSWER]},
        ]
    )
    assert error["param"] == "messages[1].content[2]", error
    assert "two tool calls" in error["message"]


def call(call_id: str) -> dict[str, str]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> dict[str, str]:
    return {"type": "function_call_output", "call_id": call_id, "output": "r"}


@pytest.mark.parametrize(
    ("items", "param", "says"),
    [
        ([call("c1"), output("c1"), output("c1")], "input[3]", "answered twice"),
        ([call("c1"), output("c2")], "input[2]", "no earlier"),
        # Consecutive calls are one chat message: the second item with the id is named.
        ([call("c1"), call("c2"), call("c1"), output("c1")], "input[3]", "two tool calls"),
    ],
)
async def test_a_responses_input_mistake_names_its_item_after_instructions(
    items: list[dict[str, str]], param: str, says: str
):
    ask = [{"role": "user", "content": "hi"}, *items]
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="simulated", instructions="be brief", input=sent(ask)
            )
    assert (refused.value.code, refused.value.param) == ("invalid_value", param)
    assert says in refused.value.message


async def test_a_responses_mistake_after_a_stored_turn_names_the_new_input():
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        turn = [{"role": "user", "content": "hi"}, call("c1"), output("c1")]
        first = await client.responses.create(model="simulated", input=sent(turn))
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="simulated", previous_response_id=first.id, input=sent([output("c1")])
            )
    assert refused.value.param == "input[0]"
    assert "answered twice" in refused.value.message


def calls(*ids: str) -> dict[str, Any]:
    """An assistant message making a call of ``f`` with each id."""
    made = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": made}


def result(call_id: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": call_id, "content": "r"}


ASK = {"role": "user", "content": "hi"}
MORE = {"role": "user", "content": "and?"}


@pytest.mark.parametrize(
    ("messages", "unanswered", "instead"),
    [
        # One of two calls answered, then the user speaks.
        ([ASK, calls("c1", "c2"), result("c1"), MORE], "'c2'", "messages[3] has the role 'user'"),
        # Answered, but not right after the call: OpenAI refuses it too.
        ([ASK, calls("c1"), MORE, result("c1")], "'c1'", "messages[2] has the role 'user'"),
        (
            [ASK, calls("c1"), {"role": "assistant", "content": "wait"}, result("c1")],
            "'c1'",
            "messages[2] has the role 'assistant'",
        ),
        # The conversation ends with calls no result answers.
        ([ASK, calls("c1", "c2")], "'c1', 'c2'", "no message follows"),
        ([ASK, calls("c1", "c2"), result("c2")], "'c1'", "no message follows"),
    ],
)
async def test_a_chat_call_not_answered_right_after_it_is_a_400_naming_its_message(
    messages: list[dict[str, Any]], unanswered: str, instead: str
):
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="simulated", messages=sent(messages))
    error = refused.value
    assert (error.code, error.param) == ("invalid_value", "messages[1]")
    assert f"not answered: {unanswered}." in error.message
    assert f"({instead})" in error.message


async def test_chat_and_native_take_calls_answered_right_after_them_and_no_later():
    # In any order within the tool messages, and an id made again in a later turn.
    answered = [ASK, calls("c1", "c2"), result("c2"), result("c1"), MORE, calls("c1"), result("c1")]
    late = [ASK, calls("c1", "c2"), result("c2"), MORE, result("c1")]
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        aiohttp.ClientSession() as session,
    ):
        taken = await client.chat.completions.create(
            model="simulated", messages=sent(answered), max_tokens=2
        )
        assert taken.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="simulated", messages=sent(late))
        assert refused.value.param == "messages[1]"
        # The native route takes chat's messages, checked alike.
        native = {"messages": answered, "stream": False, "max_tokens": 2}
        async with session.post(f"{url}/v1/replies", json=native) as answer:
            assert answer.status == 200, await answer.text()
        async with session.post(f"{url}/v1/replies", json={**native, "messages": late}) as answer:
            error = (await answer.json())["error"]
    assert answer.status == 400
    assert (error["code"], error["param"]) == ("invalid_value", "messages[1]")
    assert "not answered: 'c1'." in error["message"]
    assert "(messages[3] has the role 'user')" in error["message"]


@pytest.mark.parametrize(
    ("items", "param", "unanswered"),
    [
        ([call("c1"), call("c2"), output("c1")], "input[2]", "c2"),
        ([call("c1")], "input[1]", "c1"),
        ([call("c1"), output("c1"), call("c2"), MORE], "input[3]", "c2"),
    ],
)
async def test_a_responses_call_with_no_output_is_a_400_naming_its_item(
    items: list[dict[str, str]], param: str, unanswered: str
):
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="simulated", instructions="be brief", input=sent([ASK, *items])
            )
        with pytest.raises(openai.BadRequestError) as uncounted:
            await client.responses.input_tokens.count(
                model="simulated", instructions="be brief", input=sent([ASK, *items])
            )
    for error in (refused.value, uncounted.value):
        assert (error.code, error.param) == ("invalid_value", param)
        said = f"the function call {unanswered!r} has no function_call_output after it"
        # Our words, as sent; how the SDK frames them in error.message differs by release.
        assert isinstance(error.body, dict)
        assert error.body["message"] == said


async def test_a_responses_output_may_come_after_other_items_but_must_come():
    # The Responses API pairs a call and its output by call_id, wherever the output is.
    later = [ASK, call("c1"), call("c2"), MORE, output("c2"), MORE, output("c1")]
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        taken = await client.responses.create(model="simulated", input=sent(later))
        assert taken.status == "completed"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="simulated", input=sent(later[:-1]))
    assert refused.value.param == "input[1]"
    assert "'c1'" in refused.value.message


async def test_a_responses_output_after_other_items_reaches_a_chat_upstream_after_its_call():
    """OpenAI's Responses API takes a call's output anywhere after it; chat's wants it right
    after the call (this server's chat route too). Relayed as given, such an input was
    refused by a strict chat upstream: the output now goes up right after its call."""
    upstream = RecordingUpstream()
    items = [ASK, call("c1"), MORE, call("c2"), output("c2"), output("c1")]
    async with (
        relaying_to(upstream) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client,
    ):
        made = await client.responses.create(model="m", input=sent(items), store=False)
    assert made.status == "completed"
    roles = [(m["role"], m.get("tool_call_id")) for m in upstream.bodies[0]["messages"]]
    assert roles == [
        ("user", None),
        ("assistant", None),
        ("tool", "c1"),
        ("user", None),
        ("assistant", None),
        ("tool", "c2"),
    ]
