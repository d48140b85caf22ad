"""Anthropic's ``message_start`` carries the prompt's real size, through the anthropic SDK.

Anthropic sends the input tokens in ``message_start``, and a client may read them there (the
SDK's stream keeps that usage until ``message_delta`` updates it). A chat model's prompt is
its chat template's rendering, many more tokens than the messages' text: the count is the
engine's own from the first event, equal to the one the message ends with and to the whole
message's. On SmolLM2 (its GGUF's chat template, the real tokenizer) and on the simulated
engine, with short replies.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from replystream.engine.base import Engine
from replystream.engine.gguf_engine import load_gguf_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.services import require_smollm2

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
