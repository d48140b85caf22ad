"""Consecutive messages of one role on ``POST /v1/messages`` are one turn, as Anthropic's API
combines them: the model reads the conversation a client would have sent with each turn in
one message (its blocks joined as one message's are), so a chat template that wants roles to
alternate renders it, and a prefill split over several assistant messages is continued whole.
Through the anthropic SDK, on the tiny model with such a template (the real tokenizer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.prompts import ChatPrompt
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.server import create_app, running

# The rule of Mistral's and Llama 2's templates: a user turn, then an assistant turn, in turn.
ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
ASK: Any = {"model": "tiny", "max_tokens": 6, "extra_body": {"replystream": {"seed": 7}}}


def said(role: str, *texts: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text} for text in texts]}


@pytest.fixture
async def client() -> AsyncIterator[anthropic.AsyncAnthropic]:
    default = load_default_engine()
    newline = default.tokenizer.encode("\n")[0]
    prompts = ChatPrompt(default.tokenizer, ChatTemplate(ALTERNATING), newline)
    engine = TinyEngine(default.model, default.tokenizer, prompts=prompts)
    async with (
        running(create_app(engine)) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as sdk,
    ):
        yield sdk


async def reply_and_count(client: anthropic.AsyncAnthropic, messages: Any) -> tuple[str, int]:
    message = await client.messages.create(**ASK, messages=messages)
    counted = await client.messages.count_tokens(model="tiny", messages=messages)
    assert message.usage.input_tokens == counted.input_tokens
    return "".join(block.text for block in message.content if block.type == "text"), (
        counted.input_tokens
    )


@pytest.mark.parametrize(
    ("split", "whole"),
    [
        # Two user messages are the one user turn they make together.
        (
            [said("user", "What is a"), said("user", " token?")],
            [said("user", "What is a", " token?")],
        ),
        # A turn of each role in two messages, the last a prefill continued from all its text.
        (
            [
                said("user", "Name a colour."),
                said("assistant", "Red."),
                said("user", "And another?"),
                said("assistant", "It is"),
                said("assistant", " blue and"),
            ],
            [
                said("user", "Name a colour."),
                said("assistant", "Red."),
                said("user", "And another?"),
                said("assistant", "It is", " blue and"),
            ],
        ),
    ],
)
async def test_consecutive_messages_of_one_role_are_the_turn_they_make_together(
    client: anthropic.AsyncAnthropic, split: list[dict[str, Any]], whole: list[dict[str, Any]]
):
    assert await reply_and_count(client, split) == await reply_and_count(client, whole)
