"""The tiny engine behind the real server: a reply in words, a refusal before any byte."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.prompts import ChatPrompt
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.sse import EventParser


async def test_server_replies_in_words_from_the_tiny_engine() -> None:
    engine = load_default_engine()
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as session:
        query = {"prompt": "And the LORD said unto Moses,", "max_tokens": "20", "seed": "3"}
        async with session.get(f"{url}/wait", params=query) as response:
            assert response.status == 200
            text = (await response.json())["text"]
        async with session.get(f"{url}/wait", params={"prompt": "amen " * 400}) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert len(text.split()) >= 8
    assert error["param"] == "prompt"
    assert engine.stats().finished == 1
    assert engine.scheduler_stats().kv.used_blocks == 0


# A chat template that adds a system prompt, as SmolLM2's does when the client sends none: the
# model reads many more tokens than the conversation's text holds.
SYSTEM_TEMPLATE = (
    "{{ 'system: You answer questions about the books of the Bible in one sentence.\\n' }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{{ 'assistant:' }}"
)


async def test_usage_counts_the_prompt_the_chat_template_made_streamed_or_whole_stopped_or_not():
    default = load_default_engine()
    template = ChatTemplate(SYSTEM_TEMPLATE)
    prompts = ChatPrompt(default.tokenizer, template, default.tokenizer.encode("\n")[0])
    # Seed 3 for a request that gives none too (Anthropic's has no seed): the same text.
    engine = TinyEngine(default.model, default.tokenizer, TinyEngineConfig(seed=3), prompts=prompts)
    messages = [{"role": "user", "content": "Who led Israel?"}]
    read = len(default.tokenizer.encode(template.render(messages)))
    ask = {"model": "tiny", "messages": messages, "max_tokens": 4, "seed": 3}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        counts, endings = [], []
        for extra in ({}, {"stop": ["e"]}):
            async with http.post(f"{url}/v1/chat/completions", json={**ask, **extra}) as response:
                whole = await response.json()
            counts.append(whole["usage"]["prompt_tokens"])
            endings.append(whole["choices"][0]["finish_reason"])
            streamed = {**ask, **extra, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(f"{url}/v1/chat/completions", json=streamed) as response:
                chunks = [
                    json.loads(line[6:])
                    for line in (await response.text()).splitlines()
                    if line.startswith("data: {")
                ]
            counts.append(chunks[-1]["usage"]["prompt_tokens"])
        anthropic = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 4,
            "stop_sequences": ["e"],
            "stream": True,
        }
        async with http.post(f"{url}/v1/messages", json=anthropic) as response:
            events = EventParser().feed(await response.read())
        delta = next(json.loads(e.data) for e in events if e.type == "message_delta")
        counts.append(delta["usage"]["input_tokens"])
        endings.append(delta["delta"]["stop_reason"])
    assert endings == ["length", "stop", "stop_sequence"]  # the stop string cut both replies
    assert read > len(default.tokenizer.encode("user: Who led Israel?")) + 10
    assert counts == [read] * 5


async def test_a_refusal_names_the_field_the_openai_client_sent_as_openai_codes_it():
    # A 64-token KV pool: a long prompt does not fit, nor does a short one with 100 more.
    engine = load_default_engine(TinyEngineConfig(num_blocks=4, block_size=16))
    long, short = "amen " * 40, "And the LORD said"
    chat, legacy = "/v1/chat/completions", "/v1/completions"
    cases: list[tuple[str, dict[str, Any], str]] = [
        (chat, {"messages": [{"role": "user", "content": long}]}, "messages"),
        (chat, {"messages": [{"role": "user", "content": short}], "max_tokens": 100}, "max_tokens"),
        (
            chat,
            {"messages": [{"role": "user", "content": short}], "max_completion_tokens": 100},
            "max_completion_tokens",
        ),
        (legacy, {"prompt": long}, "prompt"),
        (legacy, {"prompt": short, "max_tokens": 100}, "max_tokens"),
    ]
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for path, body, param in cases:
            for stream in (False, True):
                async with http.post(f"{url}{path}", json={**body, "stream": stream}) as response:
                    assert response.status == 400
                    error = (await response.json())["error"]
                assert (error["param"], error["code"]) == (param, "context_length_exceeded")
                assert error["type"] == "invalid_request_error"
                assert "max_tokens" not in error["message"]  # the message names no field
    assert engine.stats().started == 0


async def test_a_refusal_names_the_field_the_responses_or_messages_client_sent():
    # The same refusals as on chat, to clients that sent the prompt as Responses' ``input``
    # and the limit as ``max_output_tokens``, or as Anthropic's ``messages``, ``max_tokens``.
    engine = load_default_engine(TinyEngineConfig(num_blocks=4, block_size=16))
    long, short = "amen " * 40, "And the LORD said"
    responses, messages = "/v1/responses", "/v1/messages"
    said = {"model": "tiny", "max_tokens": 5}
    cases: list[tuple[str, dict[str, Any], str]] = [
        (responses, {"input": long}, "input"),
        (responses, {"input": short, "max_output_tokens": 100}, "max_output_tokens"),
        (messages, {**said, "messages": [{"role": "user", "content": long}]}, "messages"),
        (
            messages,
            {**said, "messages": [{"role": "user", "content": short}], "max_tokens": 100},
            "max_tokens",
        ),
    ]
    # A Responses request is answered stored or not, streamed, whole or in the background.
    ways = [{"stream": s} for s in (False, True)]
    stored = [{"store": False}, {"store": True}, {"background": True}]
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for path, body, param in cases:
            for way in [{**w, **s} for w in ways for s in stored] if path == responses else ways:
                async with http.post(f"{url}{path}", json={**body, **way}) as response:
                    assert response.status == 400, (path, way)
                    answer = await response.json()
                if path == messages:  # Anthropic's shape: the type beside the error
                    assert answer["type"] == "error"
                error = answer["error"]
                assert (error["param"], error["code"]) == (param, "context_length_exceeded")
                assert error["type"] == "invalid_request_error"


# A template that refuses one message, and shows only the user's turns (so an assistant's
# final message, to be continued, does not appear in what it makes).
REFUSING_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] == 'refuse me' %}"
    "{{ raise_exception('this template refuses that message') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
)


async def test_a_chat_templates_refusal_names_the_field_each_api_takes_the_messages_in():
    default = load_default_engine()
    prompts = ChatPrompt(default.tokenizer, ChatTemplate(REFUSING_TEMPLATE), 0)
    engine = TinyEngine(default.model, default.tokenizer, TinyEngineConfig(), prompts=prompts)
    refused = [{"role": "user", "content": "refuse me"}]
    prefill = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "I"}]
    anthropic = {"model": "tiny", "max_tokens": 4}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/responses", {"input": "refuse me", "stream": False}, "input"),
        ("/v1/responses", {"input": "refuse me", "stream": True}, "input"),
        ("/v1/responses/input_tokens", {"input": "refuse me"}, "input"),
        ("/v1/messages", {**anthropic, "messages": refused}, "messages"),
        # The prefill the template does not show cannot be continued: the client sent it
        # as its messages' last.
        ("/v1/messages", {**anthropic, "messages": prefill, "stream": False}, "messages"),
        ("/v1/messages", {**anthropic, "messages": prefill, "stream": True}, "messages"),
        ("/v1/messages/count_tokens", {"model": "tiny", "messages": prefill}, "messages"),
    ]
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for path, body, param in cases:
            async with http.post(f"{url}{path}", json=body) as response:
                assert response.status == 400, (path, body)
                error = (await response.json())["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), path
