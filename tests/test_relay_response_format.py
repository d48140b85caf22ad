"""Structured outputs through the relay: chat's ``response_format`` and the Responses API's
``text.format`` (JSON mode, or JSON a schema describes) go to the upstream in chat's form,
whose grammar holds the text to it; the official SDK's parse helpers read the relayed reply.
Engines that sample freely refuse a JSON format in each dialect's words, a malformed format is
a 400 naming its field, and a reply held to a schema is not continued at another upstream
(the next one's grammar would start the schema over after the text already sent).

The upstreams are small aiohttp apps in this process (real servers on loopback ports), the
relay a replystream app serving an ``UpstreamEngine``; the clients are the official SDK and a
plain HTTP client."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from anthropic.types import MessageParam, OutputConfigParam
from pydantic import BaseModel

from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, chunk, relay

ASK = [{"role": "user", "content": "Which city, and how many live there?"}]
ANSWER = '{"city": "Paris", "population": 2102650}'


class City(BaseModel):
    city: str
    population: int


class JSONUpstream(Upstream):
    """An upstream whose reply is ``ANSWER``, streamed in pieces, as a server holding its text
    to the schema it was given would answer."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("", role="assistant"))
        for start in range(0, len(ANSWER), 9):
            await response.write(chunk(ANSWER[start : start + 9]))
        await response.write(chunk(None, "stop"))
        usage = {"prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response


def city_format(sent: dict[str, Any]) -> dict[str, Any]:
    """The ``response_format`` an upstream was sent, its schema checked to be ``City``'s."""
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["strict"] is True
    assert set(fmt["json_schema"]["schema"]["properties"]) == {"city", "population"}
    return dict(fmt)


async def test_chats_response_format_goes_upstream_as_given_and_the_sdk_parses_the_reply():
    up = JSONUpstream(["m"])
    async with (
        relay([up]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        whole = await oai.chat.completions.parse(model="m", messages=ASK, response_format=City)  # type: ignore[arg-type]
        async with oai.chat.completions.stream(
            model="m",
            messages=ASK,  # type: ignore[arg-type]
            response_format=City,
        ) as stream:
            streamed = await stream.get_final_completion()
        json_mode = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ASK, response_format={"type": "json_object"}
        )
        plain = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ASK, response_format={"type": "text"}
        )
    for got in (whole, streamed):
        assert got.choices[0].message.parsed == City(city="Paris", population=2102650)
    assert json.loads(json_mode.choices[0].message.content or "") == {
        "city": "Paris",
        "population": 2102650,
    }
    first, second, third, fourth = up.bodies
    assert city_format(first) == city_format(second)
    assert third["response_format"] == {"type": "json_object"}
    assert "response_format" not in fourth  # plain text: what every upstream makes unasked
    assert plain.choices[0].message.content == ANSWER


async def test_responses_text_format_goes_upstream_in_chats_form_and_is_echoed():
    up = JSONUpstream(["m"])
    async with (
        relay([up]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        parsed = await oai.responses.parse(model="m", input="Which city?", text_format=City)
        async with oai.responses.stream(model="m", input="Which city?", text_format=City) as s:
            final = await s.get_final_response()
        stored = await oai.responses.retrieve(parsed.id)
        json_mode = await oai.responses.create(
            model="m", input="Which city?", text={"format": {"type": "json_object"}}
        )
    assert parsed.output_parsed == City(city="Paris", population=2102650)
    assert final.output_parsed == City(city="Paris", population=2102650)
    # The Responses spelling (the schema's fields beside its type) becomes chat's.
    assert city_format(up.bodies[0]) == city_format(up.bodies[1])
    assert up.bodies[2]["response_format"] == {"type": "json_object"}
    for response in (parsed, final, stored):
        assert response.text is not None and response.text.format is not None
        echoed = response.text.format.model_dump(exclude_none=True, by_alias=True)
        assert echoed["type"] == "json_schema" and echoed["name"] == "City"
        assert echoed["schema"] == up.bodies[0]["response_format"]["json_schema"]["schema"]
    assert json_mode.text is not None and json_mode.text.format is not None
    assert json_mode.text.format.type == "json_object"


async def test_an_engine_that_samples_freely_refuses_json_in_each_dialects_words():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=0, jitter_ms=0))
    async with (
        running(create_app(engine, ServerConfig(model_name="m"))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        with pytest.raises(openai.BadRequestError) as chat:
            await oai.chat.completions.parse(model="m", messages=ASK, response_format=City)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as responses:
            await oai.responses.create(
                model="m", input="x", text={"format": {"type": "json_object"}}
            )
        plain = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ASK, response_format={"type": "text"}, max_tokens=2
        )
    for refused, param in ((chat, "response_format"), (responses, "text.format")):
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("unsupported_parameter", param)
        assert "simulated engine samples its text freely" in error["message"]
    assert chat.value.status_code == responses.value.status_code == 400
    assert plain.choices[0].message.content


MALFORMED = [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    (
        {"type": "json_schema", "json_schema": {"name": "a city"}},
        "response_format.json_schema.name",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": 5}}},
        "response_format.json_schema.schema",
    ),
    ({"type": "xml"}, "response_format"),
    ("json", "response_format"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
]


@pytest.mark.parametrize(("fmt", "param"), MALFORMED, ids=[json.dumps(f) for f, _ in MALFORMED])
async def test_a_malformed_response_format_is_a_400_naming_its_field(fmt: object, param: str):
    async with relay([JSONUpstream(["m"])]) as url:
        got = await post_events(
            f"{url}/v1/chat/completions", {"messages": ASK, "response_format": fmt}
        )
    assert got.status == 400, got.raw
    error = json.loads(got.raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param in error["message"]  # the field named in the words too


async def test_a_responses_json_schema_format_without_its_schema_is_a_400_naming_it():
    # OpenAI's Responses API requires the schema (chat's may be left out): without one, the
    # upstream would be sent a JSON Schema form with no schema to hold the text to.
    up = JSONUpstream(["m"])
    async with relay([up]) as url:
        got = await post_events(
            f"{url}/v1/responses",
            {"input": "Which city?", "text": {"format": {"type": "json_schema", "name": "City"}}},
        )
    assert got.status == 400, got.raw
    error = json.loads(got.raw)["error"]
    assert (error["param"], error["message"]) == (
        "text.format.schema",
        "text.format.schema is required",
    )
    assert up.bodies == []


async def test_a_tools_parameters_that_are_no_schema_are_named_in_the_message():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    async with relay([JSONUpstream(["m"])]) as url:
        got = await post_events(f"{url}/v1/chat/completions", {"messages": ASK, "tools": [tool]})
    error = json.loads(got.raw)["error"]
    assert got.status == 400 and error["param"] == "tools[0].function.parameters"
    assert error["message"].startswith("tools[0].function.parameters is not a valid JSON Schema")


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, None], ids=["json", "text"])
async def test_a_reply_held_to_a_json_format_is_not_continued_at_another_upstream(fmt):
    stalling, other = Upstream(["m"], mode="stall"), JSONUpstream(["m"])
    body = {"messages": ASK, "stream": True, "upstream_continue": True, "response_format": fmt}
    async with relay([stalling, other], stall_s=0.4) as url:
        got = await post_events(f"{url}/v1/chat/completions", body)
    if fmt is None:  # plain text: continued there, after the text already sent
        assert got.chat_text == "w0 w1 w2 " + ANSWER and len(other.bodies) == 1
        return
    assert got.chat_text == "w0 w1 w2 " and other.bodies == []  # it ended where it stalled
    assert [e["error"]["code"] for e in got.of_type("error")] == ["upstream_stalled"]


async def test_anthropics_output_config_goes_upstream_in_chats_form_and_the_sdk_parses_it():
    up = JSONUpstream(["m"])
    ask: list[MessageParam] = [{"role": "user", "content": "Which city?"}]
    async with (
        relay([up]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        whole = await claude.messages.parse(
            model="m", max_tokens=50, messages=ask, output_format=City
        )
        async with claude.messages.stream(
            model="m", max_tokens=50, messages=ask, output_format=City
        ) as stream:
            streamed = await stream.get_final_message()
        effort = await claude.messages.create(
            model="m", max_tokens=50, messages=ask, output_config={"effort": "low"}
        )
    assert whole.parsed_output == City(city="Paris", population=2102650)
    assert streamed.parsed_output == City(city="Paris", population=2102650)
    sent = up.bodies[0]["response_format"]
    # Chat's form needs a name, which Anthropic's has not; its schema is always held to.
    assert (sent["type"], sent["json_schema"]["name"]) == ("json_schema", "output")
    assert sent["json_schema"]["strict"] is True
    assert set(sent["json_schema"]["schema"]["properties"]) == {"city", "population"}
    assert up.bodies[1]["response_format"] == sent
    assert up.bodies[2]["reasoning_effort"] == "low" and "response_format" not in up.bodies[2]
    assert effort.content[0].type == "text"


async def test_anthropics_output_format_is_refused_where_it_cannot_be_honoured():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=0, jitter_ms=0))
    fmt: OutputConfigParam = {"format": {"type": "json_schema", "schema": City.model_json_schema()}}
    prefilled: list[MessageParam] = [
        {"role": "user", "content": "Which city?"},
        {"role": "assistant", "content": '{"city":'},
    ]
    async with (
        running(create_app(engine, ServerConfig(model_name="m"))) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        refusals = []
        for messages in (prefilled[:1], prefilled):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(
                    model="m", max_tokens=5, messages=messages, output_config=fmt
                )
            refusals.append(refused.value)
    free, prefill = refusals
    for error in refusals:
        assert isinstance(error.body, dict)
        assert error.body["type"] == "error"
        assert error.body["error"]["type"] == "invalid_request_error"
    assert "samples its text freely" in free.message
    assert "prefilled final assistant message" in prefill.message


async def test_anthropics_strict_tool_goes_upstream_as_chats_strict_function():
    # Anthropic's ``strict`` on a tool holds its input to ``input_schema`` exactly, as
    # chat's ``strict`` holds a function's arguments: the upstream's grammar honours either.
    up = JSONUpstream(["m"])
    schema = City.model_json_schema() | {"additionalProperties": False}
    ask: list[MessageParam] = [{"role": "user", "content": "Which city?"}]
    async with (
        relay([up]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        for strict in (True, False):
            await claude.messages.create(
                model="m",
                max_tokens=50,
                messages=ask,
                tools=[{"name": "city", "input_schema": schema, "strict": strict}],
            )
        await claude.messages.create(
            model="m", max_tokens=50, messages=ask, tools=[{"name": "city", "input_schema": schema}]
        )
    functions = [body["tools"][0]["function"] for body in up.bodies]
    assert [f.get("strict") for f in functions] == [True, False, None]
    assert all(f["parameters"] == schema for f in functions)
