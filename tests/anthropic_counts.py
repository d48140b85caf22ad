"""A message's input tokens two ways, through the anthropic SDK: ``count_tokens``, and the
``message_start`` of the message with the same input; and the inputs to compare them on."""

from __future__ import annotations

from typing import Any

import anthropic

from replystream.engine.base import Engine
from replystream.server import create_app, running

USER: Any = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CALLED = {
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": "s"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ],
}
ANSWERED = {
    "role": "user",
    "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
        {"type": "text", "text": "And tomorrow?"},
    ],
}
# Each a message's input, as both routes take it (the message adds only ``max_tokens``).
INPUTS: dict[str, dict[str, Any]] = {
    "text": {"messages": [USER]},
    "system": {"system": "You are brief.", "messages": [USER]},
    "system blocks": {
        "system": [
            {"type": "text", "text": "You are brief."},
            {"type": "text", "text": " Be kind."},
        ],
        "messages": [USER],
    },
    "tools": {"messages": [USER], "tools": TOOLS, "tool_choice": {"type": "auto"}},
    "tool history": {
        "system": "You are brief.",
        "messages": [USER, CALLED, ANSWERED],
        "tools": TOOLS,
        "thinking": {"type": "disabled"},
    },
    "prefill": {
        "messages": [USER, {"role": "assistant", "content": "In Paris it is"}],
    },
}


def sdk(url: str, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def message_start_input_tokens(client: anthropic.AsyncAnthropic, ask: Any) -> int:
    """The ``usage.input_tokens`` of the streamed message's first event, ``message_start``.
    The two-token message is read to its end: returning from inside the SDK's iteration
    leaves its async generators suspended, to be finalized whenever the garbage collector
    next runs, on whatever thread runs it (once the Hugging Face engine's, where finalizing
    one failed with "async generator already executing")."""
    types = []
    input_tokens = None
    async with client.messages.stream(**ask, max_tokens=2) as stream:
        async for event in stream:
            types.append(event.type)
            if event.type == "message_start":
                input_tokens = event.message.usage.input_tokens
    assert types[:1] == ["message_start"] and input_tokens is not None, types
    return input_tokens


async def counts_and_starts(engine: Engine) -> dict[str, tuple[int, int]]:
    """Per input of ``INPUTS``: its count, and its message's ``message_start`` count."""
    found = {}
    async with running(create_app(engine)) as url, sdk(url) as client:
        for name, ask in INPUTS.items():
            ask = {**ask, "model": engine.name}
            counted = await client.messages.count_tokens(**ask)
            found[name] = (counted.input_tokens, await message_start_input_tokens(client, ask))
    return found


def assert_agree(found: dict[str, tuple[int, int]]) -> None:
    for name, (counted, started) in found.items():
        assert counted == started > 0, name
    counts = {name: counted for name, (counted, _) in found.items()}
    # Each part of the input is in the count: a system prompt (in place of a template's
    # default one, which may be longer), the history; the prefill (the assistant's final
    # text, left open) too.
    assert counts["system"] != counts["text"]
    assert counts["system blocks"] > counts["system"]
    assert counts["tool history"] > counts["system"]
    assert counts["prefill"] > counts["text"]
