"""Fields OpenAI's specification gives chat and Responses for features this server lacks
(audio, predicted outputs, web search, stored prompts and conversations, prompt cache
lifetimes, moderation settings, the deprecated functions): null, which asks for nothing and
which clients made from the specification send for every field left unset, is taken; any
other value is a 400 ``unsupported_parameter`` naming the field, never "Unrecognized request
argument", which OpenAI's own API says only of a field it does not have."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
CHAT_ASK: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES_ASK: dict[str, Any] = {"input": "hi", "max_output_tokens": 2}

# Each field, with a value of the specification's shape that asks for the missing feature.
CHAT_FIELDS: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "draft"},
    "web_search_options": {"search_context_size": "low"},
    "functions": [{"name": "get_weather", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "moderation": {"model": "omni-moderation-latest"},
}
RESPONSES_FIELDS: dict[str, Any] = {
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "context_management": [{"type": "compaction"}],
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "moderation": {"model": "omni-moderation-latest"},
}


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as answer:
        return answer.status, await answer.json()


@pytest.mark.parametrize(
    ("path", "ask", "fields"),
    [(CHAT, CHAT_ASK, CHAT_FIELDS), (RESPONSES, RESPONSES_ASK, RESPONSES_FIELDS)],
)
async def test_each_is_taken_at_null_and_refused_as_unsupported_otherwise(path, ask, fields):
    async with running(create_app(fast_engine())) as url:
        status, body = await _post(url, path, {**ask, **dict.fromkeys(fields)})
        assert status == 200, body
        for name, value in fields.items():
            status, body = await _post(url, path, {**ask, name: value})
            assert status == 400, (name, body)
            error = body["error"]
            assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
            assert error["message"].startswith(f"{name}: must be "), error


async def test_text_alone_is_the_modality_every_reply_here_has():
    async with running(create_app(fast_engine())) as url:
        status, body = await _post(url, CHAT, {**CHAT_ASK, "modalities": ["text"]})
    assert status == 200, body


async def test_output_items_sent_back_as_the_sdk_dumps_them_are_taken():
    """``model_dump()`` of a response's message writes ``phase: null``; OpenAI's models label
    an assistant message's ``phase`` and ask clients to send it back. Both are history, and
    the input items list the label as given."""
    async with (
        running(create_app(fast_engine())) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        first = await client.responses.create(model="simulated", input="hi", max_output_tokens=2)
        dumped: list[Any] = [item.model_dump() for item in first.output]
        assert all("phase" in item for item in dumped if item["type"] == "message")
        again = await client.responses.create(
            model="simulated",
            input=[
                {"role": "user", "content": "hi"},
                *dumped,
                {"role": "assistant", "content": "noted", "phase": "final_answer"},
                {"role": "user", "content": "go on"},
            ],
            max_output_tokens=2,
        )
        listed = await client.responses.input_items.list(again.id, order="asc")
    assert again.status == "incomplete"
    phases = [getattr(item, "phase", None) for item in listed.data]
    assert phases == [None, None, "final_answer", None]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"namespace": None, "caller": None}, 200, None),
        ({"namespace": "billing"}, 400, "input[0].namespace"),
        ({"caller": {"type": "program", "caller_id": "p_1"}}, 400, "input[0].caller"),
    ],
)
async def test_a_function_calls_namespace_and_caller_are_taken_null(extra, status, param):
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", **extra}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "4"}
    async with running(create_app(fast_engine())) as url:
        got, body = await _post(url, RESPONSES, {**RESPONSES_ASK, "input": [call, answer]})
    assert got == status, body
    if param is not None:
        assert (body["error"]["param"], body["error"]["code"]) == (param, "unsupported_parameter")
