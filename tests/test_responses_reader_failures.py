"""A Responses stream ended by its reader (a slow client cut), read with the openai SDK."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import openai

from replystream.server import running
from tests.conftest import our_code, wait_for
from tests.stalling_proxy import (
    host_port,
    proxy_stalling_its_first_connection,
    server_cutting_stalled_readers,
)


def assembled_output(events: list[Any]) -> list[dict[str, Any]]:
    """The output items as a client puts them together from the events it read."""
    items: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.type in ("response.output_item.added", "response.output_item.done"):
            items[event.output_index] = event.item.model_dump(exclude_none=True)
        elif event.type == "response.content_part.added":
            items[event.output_index]["content"] = [event.part.model_dump(exclude_none=True)]
        elif event.type == "response.output_text.delta":
            items[event.output_index]["content"][0]["text"] += event.delta
    return [items[index] for index in sorted(items)]


async def test_a_slow_client_cut_fails_the_response_with_the_output_it_was_sent(caplog):
    # The reader decides this failure alone; its response.failed still carries every output
    # item the stream had sent (the open one cut: incomplete), numbered on after them.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    app = server_cutting_stalled_readers()
    release = asyncio.Event()
    async with running(app) as url:
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            client = openai.AsyncOpenAI(base_url=f"{proxied}/v1", api_key="-", max_retries=0)
            async with client:

                async def read() -> list[Any]:
                    manager = client.responses.stream(model="simulated", input="x")
                    async with manager as stream:
                        return [event async for event in stream]

                reading = asyncio.ensure_future(read())
                await wait_for(
                    lambda: any("cut: socket" in r.getMessage() for r in caplog.records),
                    timeout_s=30,
                )
                release.set()
                async with asyncio.timeout(30):
                    events = await reading
                # Resumed after the last number the client saw: the response's next event.
                last_seen = events[-1].sequence_number
                resumed = await client.responses.retrieve(
                    events[-1].response.id, stream=True, starting_after=last_seen
                )
                rest = [event async for event in resumed]
    assert [event.type for event in events[-2:]] == ["error", "response.failed"]
    # Nothing skipped: the event after the last one this stream wrote.
    assert rest and rest[0].sequence_number == last_seen + 1 == events[-3].sequence_number + 1
    failed = events[-1].response
    assert (failed.status, our_code(failed.error)) == ("failed", "slow_client")
    assert [event.type for event in events].count("response.output_text.delta") >= 1
    told = [item.model_dump(exclude_none=True) for item in failed.output]
    sent = assembled_output(events)
    assert [item["status"] for item in told] == ["incomplete"]
    assert told[0]["content"][0]["text"] == sent[0]["content"][0]["text"]
    assert {**sent[0], "status": "incomplete"} == told[0]
    # Every event once, in order; the reader's own two carry the last one written's number.
    numbers = [event.sequence_number for event in events]
    assert numbers == [*range(len(events) - 2), len(events) - 3, len(events) - 3]


async def test_a_resumed_reader_cut_fails_the_response_with_the_output_before_its_place_too(
    caplog,
):
    # The client resumed after event 6 (its first text was told by an earlier connection):
    # the failure carries the whole message so far, not only what this connection sent.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    app = server_cutting_stalled_readers()
    release = asyncio.Event()
    async with running(app) as url, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-") as direct:
        queued = await direct.responses.create(model="simulated", input="x", background=True)
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            client = openai.AsyncOpenAI(base_url=f"{proxied}/v1", api_key="-", max_retries=0)
            async with client:

                async def read() -> list[Any]:
                    stream = await client.responses.retrieve(
                        queued.id, stream=True, starting_after=6
                    )
                    return [event async for event in stream]

                reading = asyncio.ensure_future(read())
                await wait_for(
                    lambda: any("cut: socket" in r.getMessage() for r in caplog.records),
                    timeout_s=30,
                )
                release.set()
                async with asyncio.timeout(30):
                    events = await reading
        whole = [event async for event in await direct.responses.retrieve(queued.id, stream=True)]
    assert [event.type for event in events[-2:]] == ["error", "response.failed"]
    assert events[0].sequence_number == 7
    numbers = [event.sequence_number for event in events]
    assert numbers == [*range(7, 5 + len(events)), 4 + len(events), 4 + len(events)]
    told_upto = events[-3].sequence_number
    text = "".join(
        event.delta
        for event in whole
        if event.type == "response.output_text.delta" and event.sequence_number <= told_upto
    )
    assert any(e.type == "response.output_text.delta" and e.sequence_number <= 6 for e in whole)
    failed = events[-1].response
    assert [(item.type, item.status) for item in failed.output] == [("message", "incomplete")]
    assert failed.output[0].content[0].text == text


async def test_a_closing_larger_than_the_byte_limit_reaches_a_reader_that_takes_it():
    """A Responses reply's closing events repeat its whole text and log probabilities: one
    append larger than ``slow_client_bytes``. A reader held back for a while (its backlog
    under the limit) that then reads as fast as it can gets the end, not a slow-client cut:
    what it is writing, and the append that came while it wrote, are not falling behind."""
    from replystream.delivery.policy import DeliveryPolicy
    from replystream.server import create_app
    from replystream.server.context import MANAGER_KEY
    from replystream.server.server_config import ServerConfig
    from tests.conftest import fast_engine
    from tests.stalling_proxy import small_send_buffer

    engine = fast_engine(reply_text="word " * 1000, delay_ms=0.1, jitter_ms=0.0)
    limit = 256 << 10
    app = create_app(engine, ServerConfig(policy=DeliveryPolicy(slow_client_bytes=limit)))
    app.on_response_prepare.append(small_send_buffer)
    release = asyncio.Event()
    ask: dict[str, Any] = {"model": "simulated", "input": "x", "max_output_tokens": 600}
    ask.update(include=["message.output_text.logprobs"], top_logprobs=20)
    async with running(app) as url:
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            client = openai.AsyncOpenAI(base_url=f"{proxied}/v1", api_key="-", max_retries=0)
            async with client:

                async def read() -> list[Any]:
                    stream = await client.responses.create(stream=True, **ask)
                    return [event async for event in stream]

                reading = asyncio.ensure_future(read())
                replies = app[MANAGER_KEY].replies
                await wait_for(lambda: bool(replies), timeout_s=30)
                await wait_for(lambda: not replies, timeout_s=30)  # made to its end
                release.set()
                async with asyncio.timeout(30):
                    events = await reading
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"
    closing = sum(len(event.model_dump_json()) for event in events[-4:])
    sent_before = sum(len(event.model_dump_json()) for event in deltas)
    assert sent_before < limit < closing and len(deltas) == 600
    assert "".join(event.delta for event in deltas) == events[-1].response.output_text
