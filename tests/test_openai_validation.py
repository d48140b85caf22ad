"""Every bad OpenAI-style request gets its status and the error shape before any stream starts."""

from typing import Any

import aiohttp
import pytest

from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = "/v1/chat/completions"
LEGACY = "/v1/completions"

CASES: list[tuple[str, Any, int, str, str | None]] = [
    # (path, body, status, code, param)
    (CHAT, {"model": "simulated"}, 400, "missing_required_parameter", "messages"),
    (CHAT, {"messages": []}, 400, "invalid_value", "messages"),
    (CHAT, {"messages": "hi"}, 400, "invalid_value", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", None),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_value", "messages[0].content"),
    (CHAT, {"messages": USER, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "9"}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 1 << 40}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, 400, "invalid_value", None),
    (CHAT, {"messages": USER, "temperature": 2.5}, 400, "invalid_value", "temperature"),
    (CHAT, {"messages": USER, "temperature": -0.1}, 400, "invalid_value", "temperature"),
    (CHAT, {"messages": USER, "top_p": 1.5}, 400, "invalid_value", "top_p"),
    (CHAT, {"messages": USER, "n": 129}, 400, "invalid_value", "n"),
    (CHAT, {"messages": USER, "logprobs": 1}, 400, "invalid_value", "logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
    (
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "invalid_value",
        "top_logprobs",
    ),
    (LEGACY, {"prompt": "a", "logprobs": 6}, 400, "invalid_value", "logprobs"),
    (LEGACY, {"prompt": "a", "logprobs": True}, 400, "invalid_value", "logprobs"),
    (CHAT, {"messages": USER, "seed": "x"}, 400, "invalid_value", "seed"),
    (CHAT, {"messages": USER, "stop": 5}, 400, "invalid_value", "stop"),
    (CHAT, {"messages": USER, "stream": "yes"}, 400, "invalid_value", "stream"),
    (CHAT, {"messages": USER, "stream_options": []}, 400, "invalid_value", None),
    (
        CHAT,
        {"messages": USER, "stream": True, "stream_options": {"include_obfuscation": True}},
        400,
        "unsupported_parameter",  # padding, which this server never does
        "stream_options.include_obfuscation",
    ),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "invalid_value", None),
    (CHAT, {"messages": USER, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    # A field with an empty name is named "" (it was "supplied: None", naming no field).
    (CHAT, {"messages": USER, "": 1}, 400, "unknown_parameter", '""'),
    (CHAT, {"messages": [{**USER[0], "": 1}]}, 400, "unknown_parameter", 'messages[0].""'),
    (CHAT, {"messages": USER, "batch_tokens": 0}, 400, "invalid_value", "batch_tokens"),
    (CHAT, {"messages": USER, "model": "gpt-4o"}, 404, "model_not_found", "model"),
    (CHAT, [1, 2], 400, "invalid_json", None),
    (LEGACY, {"model": "simulated"}, 400, "missing_required_parameter", "prompt"),
    # OpenAI's forms this server lacks (several prompts, token ids): a feature, not a value.
    (LEGACY, {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    (LEGACY, {"prompt": [1, 2, 3]}, 400, "unsupported_parameter", "prompt"),
    (LEGACY, {"prompt": [[1, 2]]}, 400, "unsupported_parameter", "prompt"),
    (LEGACY, {"prompt": [7]}, 400, "unsupported_parameter", "prompt"),  # one token id
    (LEGACY, {"prompt": [None]}, 400, "invalid_value", "prompt"),
    (LEGACY, {"prompt": 5}, 400, "invalid_value", "prompt"),
    # Values OpenAI takes for features this server lacks; out of OpenAI's range, a bad value.
    (LEGACY, {"prompt": "a", "echo": True}, 400, "unsupported_parameter", "echo"),
    (LEGACY, {"prompt": "a", "best_of": 3}, 400, "unsupported_parameter", "best_of"),
    (LEGACY, {"prompt": "a", "best_of": 0}, 400, "unsupported_parameter", "best_of"),
    (LEGACY, {"prompt": "a", "best_of": 21}, 400, "invalid_value", "best_of"),
    (LEGACY, {"prompt": "a", "echo": "yes"}, 400, "invalid_value", "echo"),
    (LEGACY, {"prompt": "a", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (LEGACY, {"prompt": "a", "model": "nope"}, 404, "model_not_found", "model"),
    # Each of the n choices is the best of best_of: fewer candidates than choices is no request.
    (LEGACY, {"prompt": "a", "n": 2, "best_of": 1}, 400, "invalid_value", "best_of"),
    # Chat's own fields: OpenAI's legacy route has none of them, and was taking them silently.
    *(
        (LEGACY, {"prompt": "a", name: value}, 400, "unknown_parameter", name)
        for name, value in (
            ("parallel_tool_calls", False),
            ("verbosity", "low"),
            ("metadata", {"k": "v"}),
            ("store", True),
            ("reasoning_effort", "low"),
            ("messages", USER),
            ("tools", []),
            ("tool_choice", "none"),
            ("response_format", {"type": "text"}),
            ("max_completion_tokens", 2),
            ("top_logprobs", 1),
            ("continue_final_message", False),
            ("add_generation_prompt", True),
            ("chat_template_kwargs", {}),
            ("modalities", None),  # chat takes these at null; the legacy route knows none
            ("audio", None),
        )
    ),
    # The documented bounds, one past each: at most 128 tools, 1,024 token biases.
    (CHAT, {"messages": USER, "tools": [TOOL] * 129}, 400, "invalid_value", "tools"),
    (
        CHAT,
        {"messages": USER, "logit_bias": {str(i): 1 for i in range(1025)}},
        400,
        "invalid_value",
        "logit_bias",
    ),
]


def assert_error_shape(body: Any, status: int, code: str, param: str | None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"  # OpenAI's type for a 404 too
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), CASES)
async def test_bad_request_gets_status_and_error_shape(path, body, status, code, param):
    engine = fast_engine()
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for stream in (False, True):
            sent = (
                {**body, "stream": stream}
                if isinstance(body, dict) and "stream" not in body
                else body
            )
            async with http.post(f"{url}{path}", json=sent) as response:
                assert response.status == status
                assert response.content_type == "application/json"
                assert_error_shape(await response.json(), status, code, param)
    assert engine.stats().started == 0


# A value a rule of the schema refuses (a pattern, a bound it may not reach), said in our words:
# pydantic's would read "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'" or "Input should
# be greater than 0", the library's wording and the pattern's syntax, to an API client.
WORDED: list[tuple[str, Any, str, str]] = [
    # (path, body, param, message)
    (
        CHAT,
        {"messages": USER, "repetition_penalty": 0},
        "repetition_penalty",
        "repetition_penalty must be greater than 0.0, got 0",
    ),
    (
        CHAT,
        {"messages": USER, "logit_bias": {"the": 5}},
        "logit_bias",
        "a key of logit_bias must be a token id: 1 to 9 digits",
    ),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
        "tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes",
    ),
    (
        "/v1/responses",
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a.b", "schema": {}}}},
        "text.format.name",
        "text.format.name must be 1 to 64 letters, digits, underscores or dashes",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), WORDED)
async def test_a_value_a_rule_refuses_is_said_in_words(path, body, param, message):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert (error["param"], error["code"], error["message"]) == (param, "invalid_value", message)


async def test_malformed_json_oversized_body_and_long_prompt():
    config = ServerConfig(max_body_bytes=2000, max_prompt_chars=50)
    async with running(create_app(fast_engine(), config)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}{CHAT}", data=b'{"messages": [', headers=JSON) as response:
            assert response.status == 400
            assert_error_shape(await response.json(), 400, "invalid_json", None)
        huge = {"messages": [{"role": "user", "content": "x" * 5000}]}
        async with http.post(f"{url}{CHAT}", json=huge) as response:
            assert response.status == 413
            assert_error_shape(await response.json(), 413, "body_too_large", None)
        long = {"messages": [{"role": "user", "content": "word " * 20}], "stream": True}
        async with http.post(f"{url}{CHAT}", json=long) as response:
            assert response.status == 400
            assert_error_shape(await response.json(), 400, "context_length_exceeded", "messages")
        async with http.post(f"{url}{LEGACY}", json={"prompt": "y" * 51}) as response:
            assert response.status == 400
            assert_error_shape(await response.json(), 400, "context_length_exceeded", "prompt")


JSON = {"Content-Type": "application/json"}


async def test_fields_a_server_may_ignore_are_accepted():
    body = {
        "model": "simulated",
        "messages": [{"role": "developer", "content": "x"}, *USER],
        "max_tokens": 3,
        "n": 1,
        "logprobs": False,
        "user": "u-1",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": 3},
        "parallel_tool_calls": False,
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "response_format": {"type": "text"},
        "temperature": 0,
        "top_p": 0.5,
        "stop": ["never"],
        "stream": False,
        "stream_options": None,
    }
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}{CHAT}", json=body) as response:
            assert response.status == 200
            reply = await response.json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3


async def test_engine_failure_before_the_first_token_is_a_json_500_not_a_stream():
    engine = fast_engine(fail_after=0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        body = {"messages": USER, "stream": True}
        async with http.post(f"{url}{CHAT}", json=body) as response:
            assert response.status == 500
            error = (await response.json())["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_failed"


async def test_tools_and_biases_up_to_their_documented_bounds():
    # docs/api.md: chat, Responses and Messages offer at most 128 tools; chat at most 1,024
    # token biases. The bound is served, one past it refused naming the field.
    schema = {"type": "object"}
    names = [f"f{i}" for i in range(129)]
    chat_tools = [
        {"type": "function", "function": {"name": n, "parameters": schema}} for n in names
    ]
    responses_tools = [{"type": "function", "name": n, "parameters": schema} for n in names]
    messages_tools = [{"name": n, "input_schema": schema} for n in names]
    biases = {str(i): 1 for i in range(1024)}
    bodies: list[tuple[str, dict[str, Any], list[Any]]] = [
        (CHAT, {"messages": USER, "max_tokens": 1, "logit_bias": biases}, chat_tools),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}, responses_tools),
        ("/v1/messages", {"model": "simulated", "max_tokens": 1, "messages": USER}, messages_tools),
    ]
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        for path, body, tools in bodies:
            async with http.post(f"{url}{path}", json={**body, "tools": tools[:128]}) as response:
                assert response.status == 200, (path, await response.text())
            async with http.post(f"{url}{path}", json={**body, "tools": tools}) as response:
                assert response.status == 400
                error = (await response.json())["error"]
                assert (error["param"], error["code"]) == ("tools", "invalid_value"), path
