"""The relay in front of an aiohttp upstream on a loopback socket that answers as
llama-cpp-python's server (0.3.36) does where it departs from OpenAI's API: it names a
streamed tool call (its ``id``, ``type`` and function ``name``) again on every piece of it."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
from aiohttp import web

from tests.test_upstream_routing import Upstream, chunk, relay

CALL_ID = "call__0_get_weather_cmpl-05a6ae4a"
ARGUMENTS = ("{", ' "', "city", '":', ' "', "Paris", '"', " }", "")
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK: Any = {
    "model": "m",
    "max_tokens": 24,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}


def piece(arguments: str) -> bytes:
    """One piece of the call as llama-cpp-python streams it: named whole every time, with
    the deprecated ``function_call`` beside it."""
    function = {"name": "get_weather", "arguments": arguments}
    call = {"index": 0, "id": CALL_ID, "type": "function", "function": function}
    delta = {"role": None, "content": None, "function_call": function, "tool_calls": [call]}
    body = {"choices": [{"index": 0, "finish_reason": None, "logprobs": None, "delta": delta}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class LlamaCppPython(Upstream):
    def __init__(self) -> None:
        super().__init__(["m"])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk(None, role="assistant"))
        for arguments in ARGUMENTS:
            await response.write(piece(arguments))
        await response.write(chunk(None, "tool_calls"))
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_a_call_named_on_every_piece_is_named_once_to_a_chat_client():
    async with (
        relay([LlamaCppPython()]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(**ASK, stream=True)
        calls = [
            call.model_dump(exclude_none=True)
            for event in [c async for c in stream]
            for choice in event.choices
            for call in choice.delta.tool_calls or ()
        ]
        async with client.chat.completions.stream(**ASK) as helped:
            final = await helped.get_final_completion()
        whole = await client.chat.completions.create(**ASK)
    function = {"name": "get_weather", "arguments": "{"}
    assert calls[0] == {"index": 0, "id": CALL_ID, "type": "function", "function": function}
    assert calls[1:] == [
        {"index": 0, "function": {"arguments": arguments}} for arguments in ARGUMENTS[1:]
    ]
    for message in (final.choices[0].message, whole.choices[0].message):
        assert message.tool_calls is not None
        [call] = message.tool_calls
        assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
        assert (call.id, call.function.name) == (CALL_ID, "get_weather")
        assert call.function.arguments == '{ "city": "Paris" }'


# llama-cpp-python's answer to a request its schema refuses (here OpenAI's ``json_schema``
# format, which 0.3.36 does not take), byte for byte but for its install's path.
REFUSED = {
    "error": {
        "message": "1 validation error:\n  {'type': 'literal_error', 'loc': ('body',"
        " 'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\","
        " 'input': 'json_schema', 'ctx': {'expected': \"'text' or 'json_object'\"}}\n\n"
        '  File "/srv/venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 376,'
        " in create_chat_completion\n    POST /v1/chat/completions",
        "type": "internal_server_error",
        "param": None,
        "code": None,
    }
}
# Its answer to an assistant message whose content is null beside its tool calls, which its
# schema takes only as a string: each kind of message it checked, one problem per line.
PROBLEMS = (
    "{'type': 'literal_error', 'loc': ('body', 'messages', 1,"
    " 'ChatCompletionRequestSystemMessage', 'role'), 'msg': \"Input should be 'system'\","
    " 'input': 'assistant', 'ctx': {'expected': \"'system'\"}}",
    "{'type': 'string_type', 'loc': ('body', 'messages', 1,"
    " 'ChatCompletionRequestAssistantMessage', 'content'), 'msg': 'Input should be a valid"
    " string', 'input': None}",
    "{'type': 'missing', 'loc': ('body', 'messages', 1, 'ChatCompletionRequestToolMessage',"
    " 'tool_call_id'), 'msg': 'Field required', 'input': {'role': 'assistant', 'content': None}}",
    "{'type': 'literal_error', 'loc': ('body', 'messages', 1,"
    " 'ChatCompletionRequestToolMessage', 'role'), 'msg': \"Input should be 'tool'\","
    " 'input': 'assistant', 'ctx': {'expected': \"'tool'\"}}",
)
REFUSED_HISTORY = {
    "error": {
        "message": "4 validation errors:\n" + "".join(f"  {p}\n" for p in PROBLEMS),
        "type": "internal_server_error",
        "param": None,
        "code": None,
    }
}
SCHEMA: Any = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": {"type": "object"}},
}


class SchemaRefusing(Upstream):
    """Refuses a JSON schema format as llama-cpp-python's server does, with a 500."""

    def __init__(self) -> None:
        super().__init__(["m"])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("response_format", {}).get("type") == "json_schema":
            self.bodies.append(body)
            return web.json_response(REFUSED, status=500)
        if len(body["messages"]) > 1:
            self.bodies.append(body)
            return web.json_response(REFUSED_HISTORY, status=500)
        return await super().chat(request)


async def test_a_request_its_schema_refuses_is_the_clients_400_and_leaves_the_upstream_up():
    upstream = SchemaRefusing()
    async with (
        relay([upstream], failures=2) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        ask: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):  # past the failures that open a circuit
            try:
                await client.chat.completions.create(**ask, response_format=SCHEMA)
            except openai.BadRequestError as exc:
                refused = exc
            else:
                raise AssertionError("a refused request was answered")
        reply = await client.chat.completions.create(**ask)
    assert refused.status_code == 400
    assert isinstance(refused.body, dict)
    message = refused.body.pop("message")
    assert refused.body == {
        "type": "invalid_request_error",
        "param": "response_format",
        "code": "upstream_rejected",
    }
    assert message.startswith("the upstream at http://127.0.0.1:")
    assert message.endswith(
        "/v1 refused the request: response_format.type: Input should be 'text' or 'json_object'"
    )
    assert reply.choices[0].message.content == "w0 w1 w2 "
    assert len(upstream.bodies) == 4


async def test_a_message_refused_is_told_by_the_kind_its_role_names():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history: Any = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    async with (
        relay([SchemaRefusing()]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        try:
            await client.chat.completions.create(model="m", messages=history)
        except openai.BadRequestError as exc:
            refused = exc
        else:
            raise AssertionError("a refused request was answered")
    assert isinstance(refused.body, dict) and refused.body["param"] == "messages"
    assert refused.body["message"].endswith(
        " refused the request: messages.1.ChatCompletionRequestAssistantMessage.content:"
        " Input should be a valid string"
    )


def null_content_refusal(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python's 500 (0.3.36, with ``--chat_format chatml-function-calling``) for an
    assistant message at ``index`` whose content is null beside its tool calls, as it printed
    it but for its install's path: each kind of message its schema checked, and the message."""
    where = f"('body', 'messages', {index}, "
    problems = (
        f"{{'type': 'literal_error', 'loc': {where}'ChatCompletionRequestSystemMessage', 'role'),"
        " 'msg': \"Input should be 'system'\", 'input': 'assistant', 'ctx': {'expected':"
        " \"'system'\"}}",
        f"{{'type': 'literal_error', 'loc': {where}'ChatCompletionRequestUserMessage', 'role'),"
        " 'msg': \"Input should be 'user'\", 'input': 'assistant', 'ctx': {'expected':"
        " \"'user'\"}}",
        f"{{'type': 'string_type', 'loc': {where}'ChatCompletionRequestAssistantMessage',"
        " 'content'), 'msg': 'Input should be a valid string', 'input': None}",
        f"{{'type': 'literal_error', 'loc': {where}'ChatCompletionRequestToolMessage', 'role'),"
        " 'msg': \"Input should be 'tool'\", 'input': 'assistant', 'ctx': {'expected':"
        " \"'tool'\"}}",
        f"{{'type': 'missing', 'loc': {where}'ChatCompletionRequestToolMessage', 'tool_call_id'),"
        f" 'msg': 'Field required', 'input': {message!r}}}",
        f"{{'type': 'literal_error', 'loc': {where}'ChatCompletionRequestFunctionMessage',"
        " 'role'), 'msg': \"Input should be 'function'\", 'input': 'assistant', 'ctx':"
        " {'expected': \"'function'\"}}",
        f"{{'type': 'missing', 'loc': {where}'ChatCompletionRequestFunctionMessage', 'name'),"
        f" 'msg': 'Field required', 'input': {message!r}}}",
    )
    said = "7 validation errors:\n" + "".join(f"  {p}\n" for p in problems)
    said += (
        '\n  File "/srv/venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 376,'
        " in create_chat_completion\n    POST /v1/chat/completions"
    )
    error = {"message": said, "type": "internal_server_error", "param": None, "code": None}
    return {"error": error}


class NullContentRefusing(Upstream):
    """Refuses an assistant message's null content as llama-cpp-python's server does, and
    answers the same turn with an empty string for content."""

    def __init__(self) -> None:
        super().__init__(["m"])
        self.refused = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        for index, message in enumerate(body["messages"]):
            if message["role"] == "assistant" and message.get("content", "") is None:
                self.refused += 1
                return web.json_response(null_content_refusal(index, message), status=500)
        return await super().chat(request)


async def test_a_turn_of_tool_calls_reaches_an_upstream_that_takes_no_null_content():
    """Anthropic's ``tool_use`` turn and the Responses API's ``function_call`` item become an
    assistant message of calls with no text, which the relay writes with null content, as
    OpenAI's API has it; llama-cpp-python refuses null there, and takes an empty string."""
    upstream = NullContentRefusing()
    weather: Any = {"type": "object", "properties": {"city": {"type": "string"}}}
    async with (
        relay([upstream]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as messages,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        said = await messages.messages.create(
            model="m",
            max_tokens=8,
            tools=[{"name": "get_weather", "input_schema": weather}],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
                    ],
                },
            ],
        )
        answered = await client.responses.create(
            model="m",
            tools=[
                {"type": "function", "name": "get_weather", "parameters": weather, "strict": None}
            ],
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            ],
        )
    assert [block.type for block in said.content] == ["text"]
    assert answered.output_text == "w0 w1 w2 "
    assert upstream.refused == 1  # once: the relay writes it so for that upstream from then on
    for body in upstream.bodies:
        [turn] = [m for m in body["messages"] if m["role"] == "assistant"]
        assert turn["content"] == "" and turn["tool_calls"][0]["function"]["name"] == "get_weather"
