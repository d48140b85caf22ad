"""SmolLM2's log probabilities through the chat route, with the official openai SDK: the model's
own distribution, streamed equal to whole, and no entry for the end-of-turn token that ends
the reply (it is never shown).

One model is loaded for the module (about 10 s and 0.5 GiB); each test serves it from a fresh
engine around the loaded weights, and the replies are short.
"""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest

from replystream.engine.gguf_engine import load_gguf_model, prompt_format
from replystream.engine.gguf_file import GGUFModel
from replystream.engine.model import TinyModel
from replystream.engine.tiny import TinyEngine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.tokenizer import ByteTokenizer
from replystream.server import create_app, running
from tests.services import require_smollm2
from tests.sse_client import post_events

Loaded = tuple[GGUFModel, TinyModel, ByteTokenizer]

ASK: dict[str, Any] = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 40,  # the answer ends well before: by the model's own end-of-turn token
    "logprobs": True,
    "top_logprobs": 4,
}


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    return load_gguf_model(require_smollm2())


def engine_of(loaded: Loaded) -> TinyEngine:
    gguf, model, tokenizer = loaded
    return TinyEngine(
        model,
        tokenizer,
        TinyEngineConfig(num_blocks=256),
        prompts=prompt_format(gguf, tokenizer),
        stop_tokens=gguf.vocabulary.stop_ids,
        name="smollm2",
    )


def entries(logprobs: Any) -> list[tuple[str, float, list[int], list[tuple[str, float]]]]:
    return [
        (e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in logprobs.content
    ]


async def test_smollm2_chat_logprobs_are_its_greedy_tokens_streamed_and_whole(loaded: Loaded):
    async with (
        running(create_app(engine_of(loaded))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        whole = await client.chat.completions.create(**ASK)
        chunks = [
            chunk
            async for chunk in await client.chat.completions.create(
                **ASK, stream=True, stream_options={"include_usage": True}
            )
        ]
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs is not None
    expected = entries(choice.logprobs)
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in entries(chunk.choices[0].logprobs)
    ]
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected and streamed_text == choice.message.content
    assert "Paris" in streamed_text
    # One entry per token shown, and their bytes are exactly the text: the end-of-turn token,
    # counted in the usage as a token made, has none.
    shown = b"".join(bytes(raw) for _, _, raw, _ in expected).decode("utf-8", "replace")
    assert shown == choice.message.content
    assert whole.usage is not None and len(expected) == whole.usage.completion_tokens - 1
    assert chunks[-1].usage == whole.usage
    for token, logprob, _, top in expected:
        values = [value for _, value in top]
        # Greedy: each made token is the model's likeliest, and the four are a distribution's.
        assert len(top) == 4 and top[0] == (token, logprob)
        assert values == sorted(values, reverse=True)
        assert logprob <= 0 and sum(math.exp(v) for v in values) <= 1 + 1e-9


async def test_no_event_carries_the_end_tokens_empty_text(loaded: Loaded):
    """The end-of-turn token that ends the reply has no text: no event is sent for it (no
    provider's API sends an empty text delta), directly or through the stages a stop string
    and log probabilities take; the usage counts it."""
    ask = {"messages": ASK["messages"], "temperature": 0, "max_tokens": 40, "stream": True}
    async with running(create_app(engine_of(loaded))) as url:
        direct = await post_events(f"{url}/v1/replies", ask)
        staged = await post_events(f"{url}/v1/replies", {**ask, "stop": ["never said"]})
        chat = await post_events(
            f"{url}/v1/chat/completions",
            {**ask, "logprobs": True, "stream_options": {"include_usage": True}},
        )
    for got in (direct, staged):
        tokens, [usage], [done] = got.of_type("token"), got.of_type("usage"), got.of_type("done")
        assert done["finish_reason"] == "stop" and all(token["text"] for token in tokens)
        # Every token made is in an event but the end token.
        assert sum(token["tokens"] for token in tokens) == usage["completion_tokens"] - 1
    chunks = [json.loads(e.data) for e in chat.events if e.data.startswith("{")]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]]  # the role's aside
    assert all(delta.get("content") != "" for delta in deltas), deltas
    assert chat.chat_text == direct.text == staged.text and "Paris" in direct.text


KANA: dict[str, Any] = {
    "model": "smollm2",
    "temperature": 0,
    "max_tokens": 2,  # く (e3 81 8f), in two tokens: each holds part of it
}
KANA_MESSAGES = [{"role": "user", "content": "Write the Japanese word for cat."}]


def openai_name(raw: list[int]) -> str:
    """OpenAI's name for a token of these bytes: its text, or, when they are not whole UTF-8
    characters, each byte past ASCII as ``\\xNN``."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "".join(chr(b) if b < 0x80 else f"\\x{b:02x}" for b in raw)


async def test_a_token_holding_part_of_a_character_is_named_by_its_escaped_bytes(loaded: Loaded):
    """As OpenAI's chat completions name it (``\\xe3\\x81``, bytes exact), made or listed as
    an alternative, streamed or whole, in chat and in a Responses ``output_text``; legacy
    completions prefix it ``bytes:``. Read as text, each would be U+FFFD."""
    async with (
        running(create_app(engine_of(loaded))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        ask = {**KANA, "messages": KANA_MESSAGES, "logprobs": True, "top_logprobs": 4}
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
        response = await client.responses.create(
            model="smollm2",
            input=KANA_MESSAGES,  # type: ignore[arg-type]
            temperature=0,
            max_output_tokens=2,
            include=["message.output_text.logprobs"],
            top_logprobs=4,
        )
        legacy = await client.completions.create(
            model="smollm2", prompt="x", max_tokens=1, logprobs=1, logit_bias={"7365": 100}
        )
    choice = whole.choices[0]
    assert choice.message.content == "く" and choice.logprobs is not None
    made = choice.logprobs.content or []
    assert [(e.token, e.bytes) for e in made] == [("\\xe3\\x81", [227, 129]), ("\\x8f", [143])]
    alternatives = [t for e in made for t in e.top_logprobs]
    assert len(alternatives) == 8 and all(
        t.bytes is not None and t.token == openai_name(t.bytes) for t in alternatives
    )
    assert "\\xe3\\x82" in [t.token for t in made[0].top_logprobs]  # a partial alternative
    streamed = [
        entry.model_dump()
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert streamed == [entry.model_dump() for entry in made]
    [message] = response.output
    assert message.type == "message" and message.content[0].type == "output_text"
    part = message.content[0].logprobs or []
    assert [(e.token, e.bytes) for e in part] == [(e.token, e.bytes) for e in made]
    assert [[t.token for t in e.top_logprobs] for e in part] == [
        [t.token for t in e.top_logprobs] for e in made
    ]
    legacy_logprobs = legacy.choices[0].logprobs
    assert legacy_logprobs is not None and legacy_logprobs.tokens == ["bytes:\\xe3\\x81"]


async def test_a_control_token_is_named_as_the_vocabulary_spells_it_but_is_no_text(
    loaded: Loaded,
):
    """``<|im_start|>`` made (a logit bias makes it) or ``<|im_end|>`` listed as an
    alternative: named as vLLM and llama.cpp's server name them, with that name's bytes, in
    chat and legacy completions, streamed and whole; the reply's text holds neither."""
    start = b"<|im_start|>"
    biased: dict[str, Any] = {"temperature": 0, "max_tokens": 3, "logit_bias": {"1": 100}}
    async with (
        running(create_app(engine_of(loaded))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        ask = {**ASK, **biased, "top_logprobs": 2}
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
        said = {**ASK, "messages": [{"role": "user", "content": "Say only the word yes"}]}
        ended = await client.chat.completions.create(**said)
        legacy = {"model": "smollm2", "prompt": "Hello", "logprobs": 2, **biased}
        text = await client.completions.create(**legacy)
        text_chunks = [c async for c in await client.completions.create(**legacy, stream=True)]
    choice = whole.choices[0]
    assert choice.message.content == "" and choice.logprobs is not None
    made = [(e.token, e.bytes) for e in choice.logprobs.content or []]
    assert made == [("<|im_start|>", list(start))] * 3
    streamed = [
        (e.token, e.bytes)
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert streamed == made
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert ended.choices[0].logprobs is not None
    alternatives = [t for e in ended.choices[0].logprobs.content or [] for t in e.top_logprobs]
    assert ("<|im_end|>", list(b"<|im_end|>")) in [(t.token, t.bytes) for t in alternatives]
    assert all(t.token and t.bytes == list(t.token.encode()) for t in alternatives)
    assert text.choices[0].text == "" and text.choices[0].logprobs is not None
    legacy_logprobs = text.choices[0].logprobs
    assert legacy_logprobs.tokens == ["<|im_start|>"] * 3
    assert legacy_logprobs.text_offset == [5, 5, 5]  # the prompt's 5 characters: no text after
    assert all("<|im_start|>" in top for top in legacy_logprobs.top_logprobs or [])
    streamed_tokens = [
        token
        for chunk in text_chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for token in chunk.choices[0].logprobs.tokens or []
    ]
    assert streamed_tokens == legacy_logprobs.tokens
    assert "".join(c.choices[0].text for c in text_chunks if c.choices) == ""
