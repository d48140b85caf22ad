"""One reply, every way of reading it, tells the same story: streamed on its own request,
whole, read back as a stored object, by the official SDKs and by the measuring client. Each
case reads one ending over a real server on loopback and compares what each reading says of
the text, the ending and the output's items.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import pytest

from replystream.client import measure_reply
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig

REPLY = "one two three four five six seven eight nine ten"
# Batches of three tokens; the phrase begins inside "five", so the last batch, "four fi", is
# released with the ending, cut where the match begins.
RELEASED = "one two three four fi"
CHAT = {"model": "simulated", "messages": [{"role": "user", "content": "Hi"}]}
MESSAGES = {**CHAT, "max_tokens": 64}
COMPLETION = {"model": "simulated", "prompt": "Hi"}


@asynccontextmanager
async def moderated_in_batches() -> AsyncIterator[str]:
    engine = SimulatedEngine(SimulatedConfig(reply_text=REPLY, delay_ms=5.0, jitter_ms=1.0))
    checks = (BannedPhrases(["ve si"]),)
    policy = DeliveryPolicy(holdback_tokens=2, batch_tokens=3, checks=checks)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        yield url


async def test_a_response_moderated_with_text_still_batched_is_one_message_in_every_reading():
    async with (
        moderated_in_batches() as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        stream = await client.responses.create(model="simulated", input="Hi", stream=True)
        events = [event async for event in stream]
        whole = await client.responses.create(model="simulated", input="Hi")
        stored = await client.responses.retrieve(events[0].response.id)  # type: ignore[union-attr]
    # Numbered as written, from 0, no number twice or skipped: what starting_after counts.
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0]  # one message: the last text is no new item after its ending
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete"
    told = last.response
    assert deltas == told.output_text == whole.output_text == stored.output_text == RELEASED
    for response in (told, whole, stored):
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "content_filter"
        assert [item.status for item in response.output] == ["incomplete"]  # type: ignore[union-attr]


async def test_a_message_moderated_with_text_still_batched_is_one_text_block_streamed_or_whole():
    async with (
        moderated_in_batches() as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        ask = {
            "model": "simulated",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        async with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
            events = [event async for event in stream]
            streamed = await stream.get_final_message()
        whole = await client.messages.create(**ask)  # type: ignore[call-overload]
    started = [e.index for e in events if e.type == "content_block_start"]
    stopped = [e.index for e in events if e.type == "content_block_stop"]
    assert started == stopped == [0]  # every block opened is closed, and there is one
    assert streamed.stop_reason == whole.stop_reason == "refusal"
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in whole.content
    ]
    assert [block.model_dump() for block in whole.content] == [
        {"type": "text", "text": RELEASED, "citations": None}
    ]


@pytest.mark.parametrize("limit", [50, 3])  # completed; incomplete at the token limit
async def test_the_measuring_client_reads_a_whole_response_as_it_reads_its_stream(limit: int):
    engine = SimulatedEngine(SimulatedConfig(reply_text=REPLY, delay_ms=5.0, jitter_ms=1.0))
    async with running(create_app(engine)) as url:
        timings = [
            await measure_reply(
                f"{url}/v1/responses",
                method="POST",
                json_body={"input": "Hi", "max_output_tokens": limit, "stream": stream},
            )
            for stream in (True, False)
        ]
    streamed, whole = timings
    assert not whole.streamed
    assert (whole.complete, whole.error) == (streamed.complete, streamed.error) == (True, None)
    assert whole.text == streamed.text == " ".join(REPLY.split()[:limit]) + " "
    assert whole.tokens == streamed.tokens == min(limit, 10)
    assert whole.tokens_counted and streamed.tokens_counted


async def test_the_measuring_client_says_a_cancelled_response_was_cancelled_in_either_reading():
    engine = SimulatedEngine(SimulatedConfig(reply_text=REPLY, delay_ms=50.0, jitter_ms=1.0))
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        body = {"input": "Hi", "background": True}
        async with http.post(f"{url}/v1/responses", json=body) as created:
            response_id = (await created.json())["id"]
        async with http.post(f"{url}/v1/responses/{response_id}/cancel") as cancelled:
            assert (await cancelled.json())["status"] == "cancelled"
        timings = [
            await measure_reply(f"{url}/v1/responses/{response_id}{query}")
            for query in ("?stream=true", "")
        ]
    streamed, whole = timings
    assert streamed.streamed and not whole.streamed
    for timing in timings:
        assert not timing.complete
        assert timing.error == "response.failed: cancelled"  # not its null ``error``


@pytest.mark.parametrize(
    ("path", "body", "said"),
    [
        ("/v1/replies", {"prompt": "Hi"}, "moderated: "),
        ("/v1/chat/completions", CHAT, "finish_reason: content_filter"),
        (
            "/v1/completions",
            {"model": "simulated", "prompt": "Hi"},
            "finish_reason: content_filter",
        ),
        ("/v1/responses", {"input": "Hi"}, "response.incomplete: content_filter"),
        ("/v1/messages", MESSAGES, "stop_reason: refusal"),
    ],
)
async def test_the_measuring_client_says_a_moderated_reply_is_no_whole_one_in_every_dialect(
    path: str, body: dict[str, object], said: str
):
    # A check here ended the reply and withheld the rest of its text: in every dialect, read
    # streamed or whole, it is no whole reply, and bench counts it so, whatever the API.
    async with moderated_in_batches() as url:
        timings = [
            await measure_reply(f"{url}{path}", method="POST", json_body={**body, "stream": s})
            for s in (True, False)
        ]
    streamed, whole = timings
    assert streamed.streamed and not whole.streamed
    for timing in timings:
        assert not timing.complete
        assert timing.error is not None and timing.error.startswith(said), timing.error
