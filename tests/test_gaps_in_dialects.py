"""Events lost before a reader got them, as each dialect's own client is told, through the SDKs.

A reply's log keeps a bounded number of events; a reader held up long enough (here: a client
that stops reading while a long reply is made into a log of 20 events) finds the next events
it needs gone. The native stream says so with a ``gap`` event and goes on; no other API has
such an event, and its client cannot be given the missing text: a chat or completion stream
ends with OpenAI's in-band error, an Anthropic stream with its ``error`` event, a Responses
stream with OpenAI's ``error`` event (the response itself did not fail: no
``response.failed``), each with the code ``events_lost``, so the client knows its text has a
hole instead of taking it for the whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anthropic
import openai
import pytest

from replystream.client import measure_reply
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import MemoryReplayStore
from replystream.delivery.responses_log import TERMINAL
from replystream.engine.simulated import SimulatedEngine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request
from tests.stalling_proxy import host_port, proxy_stalling_its_first_connection, small_send_buffer

T = TypeVar("T")
LONG = ("r" * 2000 + " ") * 300  # 300 tokens of 2 kB: far more than the socket buffers hold
KEPT = 20  # events each reply's log keeps
# Never cut for being slow: the reader is to be held up, not cut.
PATIENT = DeliveryPolicy(slow_client_bytes=1 << 30, slow_client_s=60.0)


async def read_while_held_up(
    read: Callable[[str], Awaitable[T]], engine: SimulatedEngine | None = None
) -> T:
    """Run ``read`` (given the server's URL) through a proxy that passes nothing back until
    the whole reply has been made into a log that keeps ``KEPT`` events, then lets it read."""
    engine = engine or fast_engine(reply_text=LONG, delay_ms=1, jitter_ms=0)
    config = ServerConfig(policy=PATIENT, resumable_by_default=True)
    app = create_app(engine, config, store=MemoryReplayStore(max_entries=KEPT))
    app.on_response_prepare.append(small_send_buffer)
    release = asyncio.Event()
    async with (
        running(app) as url,
        proxy_stalling_its_first_connection(host_port(url), release) as proxied,
    ):
        reading = asyncio.ensure_future(read(proxied))
        await wait_for(lambda: engine.stats().finished == 1, timeout_s=30)
        release.set()
        async with asyncio.timeout(30):
            return await reading


async def test_a_chat_stream_with_lost_events_ends_with_an_events_lost_error():
    text: list[str] = []

    async def read(url: str) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="simulated",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=300,
                stream=True,
            )
            async for chunk in stream:
                text.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError) as raised:
        await read_while_held_up(read)
    assert raised.value.code == "events_lost", raised.value.body
    assert "no longer kept" in raised.value.message
    assert 0 < len("".join(text)) < len(LONG)  # what came before the hole, and no more


async def test_an_anthropic_stream_with_lost_events_ends_with_an_events_lost_error():
    kinds: list[str] = []

    async def read(url: str) -> None:
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as client:
            ask: Any = {"role": "user", "content": "x"}
            async with client.messages.stream(
                model="simulated", max_tokens=300, messages=[ask]
            ) as stream:
                async for event in stream:
                    kinds.append(event.type)

    with pytest.raises(anthropic.APIStatusError) as raised:
        await read_while_held_up(read)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["error"]["code"] == "events_lost", body
    assert "message_start" in kinds and "message_stop" not in kinds


def events_lost(events: list[Any]) -> None:
    """A Responses stream ended by lost events: OpenAI's ``error`` event alone (its reader's
    ending, not the response's), and no terminal event."""
    *told, error = events
    assert (error.type, error.code) == ("error", "events_lost"), [e.type for e in events[-5:]]
    assert not TERMINAL & {event.type for event in told}
    # Not in the log: it carries the number of the last event written before it.
    assert not told or error.sequence_number == told[-1].sequence_number


async def test_a_responses_stream_with_lost_events_ends_with_events_lost():
    async def read(url: str) -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            stream = await client.responses.create(
                model="simulated", input="x", max_output_tokens=300, stream=True
            )
            return [event async for event in stream]

    events = await read_while_held_up(read)
    events_lost(events)
    assert any(event.type == "response.output_text.delta" for event in events)


async def test_a_responses_resume_from_before_what_is_kept_ends_with_events_lost():
    engine = fast_engine(reply_text="one two three four five six " * 5, delay_ms=0, jitter_ms=0)
    app = create_app(engine, store=MemoryReplayStore(max_entries=KEPT))
    async with (
        running(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        made = await client.responses.create(model="simulated", input="x")
        assert made.status == "completed"  # its 30 text events and more: the first are gone
        resumed = await client.responses.retrieve(made.id, stream=True, starting_after=1)
        events = [event async for event in resumed]
    assert len(events) == 1
    events_lost(events)
    assert events[0].sequence_number == 1  # the reader's place: nothing was written after it


async def test_the_native_stream_still_tells_a_gap_and_goes_on():
    engine = fast_engine(reply_text="one two three four five six " * 5, delay_ms=0, jitter_ms=0)
    app = create_app(engine, store=MemoryReplayStore(max_entries=KEPT))
    async with running(app) as url:
        first = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true, "stream": true}'
        )
        reply_id = first.headers["x-reply-id"]
        await first.read_body()
        again = await raw_request(f"{url}/v1/replies/{reply_id}/stream?last_event_id=1")
        body = (await again.read_body()).decode()
    assert body.startswith("event: gap\n")
    gap = json.loads(body.split("\n")[1].removeprefix("data: "))
    assert gap["lost_from"] == 2
    assert body.rstrip().endswith('{"finish_reason": "length"}') or "event: done" in body


async def test_the_measuring_client_does_not_take_a_reply_with_a_gap_for_whole():
    engine = fast_engine(reply_text="one two three four five six " * 5, delay_ms=0, jitter_ms=0)
    app = create_app(engine, store=MemoryReplayStore(max_entries=KEPT))
    async with running(app) as url:
        live = await measure_reply(
            f"{url}/v1/replies", method="POST", json_body={"prompt": "x", "resumable": True}
        )
        again = await measure_reply(f"{url}/v1/replies/{live.headers['x-reply-id']}/stream")
    assert live.complete and live.error is None
    assert not again.complete
    assert again.error is not None and again.error.startswith("gap: events 1 to ")
    assert 0 < len(again.text) < len(live.text)  # what was kept is read, and no more


@pytest.mark.parametrize(
    ("route", "body", "ends_with"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "openai"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100}, "openai"),
        (
            "/v1/messages",
            {
                "model": "simulated",
                "max_tokens": 100,
                "messages": [{"role": "user", "content": "x"}],
            },
            "anthropic",
        ),
        (
            "/v1/responses",
            {"model": "simulated", "input": "x", "max_output_tokens": 100},
            "responses",
        ),
    ],
    ids=["chat", "completions", "anthropic", "responses"],
)
async def test_a_reply_of_another_dialect_resumed_natively_ends_at_a_gap_in_its_own_words(
    route: str, body: dict[str, Any], ends_with: str
):
    """GET /v1/replies/{id}/stream resumes a reply from any route: its events stay in that
    route's dialect, and so does what the reader is told of events no longer kept (no native
    ``gap`` and then ``[DONE]``, as if the text were whole)."""
    engine = fast_engine(reply_text="one two three four five six " * 5, delay_ms=0, jitter_ms=0)
    config = ServerConfig(resumable_by_default=True)
    app = create_app(engine, config, store=MemoryReplayStore(max_entries=KEPT))
    async with running(app) as url:
        first = await raw_request(
            f"{url}{route}", "POST", json.dumps({**body, "stream": True}).encode()
        )
        reply_id = first.headers["x-reply-id"]
        await first.read_body()
        again = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        text = (await again.read_body()).decode()
    assert again.status == 200
    assert "event: gap" not in text and "[DONE]" not in text and "message_stop" not in text
    last = json.loads(text.rstrip().rsplit("data: ", 1)[1])
    if ends_with == "anthropic":
        assert "event: error\n" in text
        assert last["type"] == "error" and last["error"]["code"] == "events_lost"
    elif ends_with == "responses":
        assert (last["type"], last["code"]) == ("error", "events_lost"), last
        assert not any(f"event: {kind}\n" in text for kind in TERMINAL)
    else:
        assert last["error"]["code"] == "events_lost"


async def test_a_resume_past_the_kept_events_is_no_warning_in_the_log(
    caplog: pytest.LogCaptureFixture,
):
    """Any client may ask, as often as it likes, for events a log no longer keeps: that is
    what it is told (``events_lost``), and at INFO in the log, as a slow client's cut is; a
    WARNING per request would let clients fill the log with lines an operator must read."""
    caplog.set_level(logging.INFO, logger="replystream.follower")
    engine = fast_engine(reply_text="one two three four five six " * 5, delay_ms=0, jitter_ms=0)
    config = ServerConfig(resumable_by_default=True)
    app = create_app(engine, config, store=MemoryReplayStore(max_entries=KEPT))
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    async with running(app) as url:
        first = await raw_request(f"{url}/v1/chat/completions", "POST", json.dumps(chat).encode())
        reply_id = first.headers["x-reply-id"]
        await first.read_body()
        for _ in range(3):
            again = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
            assert "events_lost" in (await again.read_body()).decode()
    told = [r for r in caplog.records if r.name == "replystream.follower"]
    assert len(told) == 3 and all(r.levelno == logging.INFO for r in told), told
    assert all("no longer kept" in r.getMessage() for r in told)
