"""Anthropic's ``message_start`` carries the prompt's real size, through the anthropic SDK.

Anthropic sends the input tokens in ``message_start``, and a client may read them there (the
SDK's stream keeps that usage until ``message_delta`` updates it). A chat model's prompt is
its chat template's rendering, many more tokens than the messages' text: the count is the
engine's own from the first event, equal to the one the message ends with and to the whole
message's. On SmolLM2 (its GGUF's chat template, the real tokenizer) and on the simulated
engine, with short replies.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import pytest

from replystream.engine.base import Engine
from replystream.engine.gguf_engine import load_gguf_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.server.serve import serving
from replystream.sse import EventParser
from tests.conftest import fast_engine, wait_for
from tests.services import require_smollm2
from tests.test_responses_queued import Gate

ASK: dict[str, Any] = {
    "max_tokens": 2,
    "system": "You are brief.",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}
FLATTENED = "system: You are brief.\nuser: What is the capital of France?"


async def input_tokens(engine: Engine) -> tuple[int, int, int, int]:
    """The input tokens of ``message_start``, of ``message_delta``, of the streamed message
    at its end, and of the same message whole."""
    ask = {**ASK, "model": engine.name}
    async with (
        running(create_app(engine)) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        async with client.messages.stream(**ask) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        whole = await client.messages.create(**{**ask, "max_tokens": 1})
    starts = [event for event in events if event.type == "message_start"]
    deltas = [event for event in events if event.type == "message_delta"]
    assert len(starts) == len(deltas) == 1
    assert events[0] is starts[0]
    start = starts[0].message.usage.input_tokens
    delta = deltas[0].usage.input_tokens
    assert delta is not None
    return start, delta, final.usage.input_tokens, whole.usage.input_tokens


async def test_smollm2_message_start_counts_the_templated_prompt():
    engine, _ = load_gguf_engine(require_smollm2(), TinyEngineConfig(num_blocks=64), "smollm2")
    start, delta, final, whole = await input_tokens(engine)
    assert start == delta == final == whole
    # The template's role markers and its default system prompt are tokens too.
    assert start > engine.count_tokens(FLATTENED) + 5


@pytest.mark.parametrize("delay_ms", [0.0, 5.0])
async def test_simulated_message_start_counts_what_the_message_ends_with(delay_ms: float):
    engine = fast_engine(delay_ms=delay_ms, jitter_ms=0.0)
    start, delta, final, whole = await input_tokens(engine)
    assert start == delta == final == whole == engine.count_tokens(FLATTENED)


async def test_a_message_ended_before_its_first_token_still_counts_the_templated_prompt():
    """A streamed message queued behind another when the server shuts down ends before the
    engine's first delta counted its prompt: its ``message_start`` still says what
    ``count_tokens`` says, not an estimate of the messages' text."""
    config = TinyEngineConfig(num_blocks=64, max_running=1)
    engine, _ = load_gguf_engine(require_smollm2(), config, "smollm2")
    gate = Gate(engine)  # the first reply holds the one place for seconds
    ask = {**ASK, "model": "smollm2"}
    try:
        async with serving(create_app(engine)) as server, aiohttp.ClientSession() as http:
            first = {"input": "x", "background": True, "max_output_tokens": 200}
            async with http.post(f"{server.url}/v1/responses", json=first) as started:
                assert started.status == 200
            await wait_for(lambda: engine.scheduler_stats().running == 1)
            unmade = {key: value for key, value in ask.items() if key != "max_tokens"}
            async with http.post(f"{server.url}/v1/messages/count_tokens", json=unmade) as n:
                expected = (await n.json())["input_tokens"]
            async with http.post(f"{server.url}/v1/messages", json={**ask, "stream": True}) as r:
                await wait_for(lambda: engine.scheduler_stats().waiting == 1)
                shutting = asyncio.create_task(server.shutdown(grace_s=0.05))
                events = EventParser().feed(await r.read())
            await shutting
    finally:
        gate.open.set()
    assert [event.type for event in events] == ["message_start", "error"]
    start = json.loads(events[0].data)["message"]["usage"]["input_tokens"]
    assert start == expected > engine.count_tokens(FLATTENED) + 5
