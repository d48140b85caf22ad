"""Stop strings over a real server, in every dialect, streamed and whole, with the official
SDKs as clients: the reply ends before the first stop string, none of it is shown, the
finish says so, and usage counts the tokens made up to the one that completed it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.simulated import reply_of_length
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.sse_client import post_events

# The simulated engine's tokens: "one ", "two ", "three ", ... "ten ".
REPLY = "one two three four five six seven eight nine ten"
STOP = "ee fo"  # spans "three " and "four ": the reply ends "one two thr"
CUT = "one two thr"
MADE = 4  # "four " completes the stop string: four tokens made, no more


def openai_sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def anthropic_sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def engine() -> Any:
    return fast_engine(reply_text=REPLY)


async def test_chat_streamed_and_whole_end_before_a_stop_string_split_over_tokens():
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": [{"role": "user", "content": "count"}],
        "stop": ["zzz", STOP],
    }
    async with running(create_app(engine())) as url, openai_sdk(url) as client:
        whole = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content == CUT
    assert not any(STOP[:2] in p for p in pieces)  # no part of the stop string, ever
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and chunks[-1].usage is not None
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == MADE


async def test_legacy_completions_streamed_and_whole_end_before_the_stop_string():
    ask: dict[str, Any] = {"model": "simulated", "prompt": "count", "max_tokens": 50, "stop": STOP}
    async with running(create_app(engine())) as url, openai_sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == CUT
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == MADE


async def test_responses_extension_stop_ends_the_response_streamed_and_whole():
    ask: dict[str, Any] = {
        "model": "simulated",
        "input": "count",
        "extra_body": {"replystream": {"stop": [STOP]}},
    }
    async with running(create_app(engine())) as url, openai_sdk(url) as client:
        whole = await client.responses.create(**ask)
        events = [e async for e in await client.responses.create(**ask, stream=True)]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == CUT
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == CUT
    assert whole.status == "completed"
    assert whole.usage is not None and whole.usage.output_tokens == MADE


async def test_anthropic_stop_sequences_name_the_one_that_matched_streamed_and_whole():
    ask: dict[str, Any] = {
        "model": "simulated",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "count"}],
        "stop_sequences": ["nope", STOP],
    }
    async with running(create_app(engine())) as url, anthropic_sdk(url) as client:
        whole = await client.messages.create(**ask)
        async with client.messages.stream(**ask) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert whole.content[0].type == "text" and whole.content[0].text == text == CUT
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", STOP)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", STOP)
    assert whole.usage.output_tokens == final.usage.output_tokens == MADE


async def test_anthropic_without_a_stop_match_ends_its_turn_with_no_stop_sequence():
    ask: dict[str, Any] = {
        "model": "simulated",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "count"}],
        "stop_sequences": ["eleven"],
    }
    async with running(create_app(engine())) as url, anthropic_sdk(url) as client:
        whole = await client.messages.create(**ask)
    assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)


@pytest.mark.parametrize("stream", [True, False])
async def test_native_replies_end_at_the_stop_string_and_name_it(stream: bool):
    body = {"prompt": "count", "stop": [STOP], "stream": stream}
    async with running(create_app(engine())) as url:
        if stream:
            got = await post_events(f"{url}/v1/replies", body)
            assert got.text == CUT
            assert got.of_type("done") == [{"finish_reason": "stop", "stop_sequence": STOP}]
            assert got.of_type("usage")[0]["completion_tokens"] == MADE
            return
        async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/replies", json=body) as r:
            answer = await r.json()
    assert answer["text"] == CUT
    assert (answer["finish_reason"], answer["stop_sequence"]) == ("stop", STOP)
    assert answer["usage"]["completion_tokens"] == MADE


async def test_a_stop_string_stops_the_engine_too():
    simulated = engine()
    async with running(create_app(simulated)) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "x", "stop": "two"})
        assert got.text == "one "
    stats = simulated.stats()
    assert stats.active == 0 and stats.steps <= 3


async def test_a_long_stop_string_costs_a_token_little():
    # A long stop string is watched for in each token's text: done by trying every length
    # of it up to the text seen, a reply of 5,000 tokens and a stop string of 40,000
    # characters held the event loop for most of a minute, every other client waiting.
    stop = "zq" * 20_000
    ask = {"prompt": "x", "max_tokens": 5_000, "stop": [stop]}
    made = fast_engine(reply_text=reply_of_length(REPLY, 5_000), delay_ms=0.0, jitter_ms=0.0)
    async with running(create_app(made)) as url:
        async with asyncio.timeout(10):
            events = (await post_events(f"{url}/v1/replies", ask)).events
    assert events[-1].type == "done"
    assert sum(json.loads(e.data)["tokens"] for e in events if e.type == "token") == 5_000


@pytest.mark.parametrize("checked", [False, True])
async def test_a_reply_that_fails_shows_the_text_it_held_as_a_stop_strings_start(checked: bool):
    """The engine fails after ``three``, held as it could begin the stop string ``three fx``:
    none can complete now, so it goes out before the error, as a whole reply that failed
    shows it (with checks on, they read it as the text's end: the match after it never comes)."""
    made = fast_engine(delay_ms=1, jitter_ms=0, reply_text="one two three four", fail_after=3)
    checks = (BannedPhrases(["four"]),) if checked else ()
    config = ServerConfig(policy=DeliveryPolicy(holdback_tokens=2, checks=checks))
    async with running(create_app(made, config)) as url:
        streamed = await post_events(f"{url}/v1/replies", {"prompt": "x", "stop": ["three fx"]})
    texts = [json.loads(e.data)["text"] for e in streamed.events if e.type == "token"]
    assert "".join(texts) == "one two three "
    assert streamed.types[-1] == "error"
