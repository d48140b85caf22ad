"""A Responses stream ended by its reader (a slow client cut), read with the openai SDK."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import openai

from replystream.delivery.replay import LogEntry, MemoryReplayStore
from replystream.delivery.responses_log import ReaderNotices
from replystream.server import create_app, running
from replystream.server.resume_dialects import notices_of
from tests.conftest import fast_engine, wait_for
from tests.stalling_proxy import (
    host_port,
    proxy_stalling_its_first_connection,
    server_cutting_stalled_readers,
)


async def test_a_slow_client_cut_ends_its_stream_with_an_error_and_the_response_its_log(caplog):
    # The reader decides this ending alone: OpenAI's error event, no response.failed (the
    # response did not fail with it). Its end is its producer's, in its log, where a resume
    # after the last number seen finds it: completed when the reply was made before the cut
    # (300 tokens 1 ms apart, the cut 0.5 s after the socket fills), else stopped for want
    # of a reader, as when its client leaves (cancelled, no error).
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
                response_id = events[0].response.id
                resumed = await client.responses.retrieve(
                    response_id, stream=True, starting_after=last_seen
                )
                rest: list[Any] = [event async for event in resumed]
                stored = await client.responses.retrieve(response_id)
    *told, error = events
    assert (error.type, error.code) == ("error", "slow_client")
    assert "response.failed" not in [event.type for event in events]
    assert [event.type for event in told].count("response.output_text.delta") >= 1
    # Every event once, in order; the reader's own carries the last one written's number.
    numbers = [event.sequence_number for event in events]
    assert numbers == [*range(len(told)), len(told) - 1]
    # Nothing skipped: the event after the last one this stream wrote, to the end the
    # response's producer gave it.
    assert rest and rest[0].sequence_number == last_seen + 1
    ended = rest[-1]
    assert ended.response.model_dump() == stored.model_dump()
    if ended.type == "response.failed":
        assert (ended.response.status, ended.response.error) == ("cancelled", None)
    else:
        assert ended.type == "response.completed"
    text = "".join(e.delta for e in [*told, *rest] if e.type == "response.output_text.delta")
    assert stored.output_text == text


async def test_a_resumed_reader_cut_ends_its_stream_and_the_background_response_goes_on(
    caplog,
):
    # The client resumed after event 6 of a background response, and was cut: its stream
    # ends with the error alone, in the response's numbers; the response, which no reader's
    # leaving stops, completes, and a resume after the error's number reads it to its end.
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
        *told, error = events
        resumed = await direct.responses.retrieve(
            queued.id, stream=True, starting_after=error.sequence_number
        )
        rest: list[Any] = [event async for event in resumed]
        whole = [event async for event in await direct.responses.retrieve(queued.id, stream=True)]
    assert (error.type, error.code) == ("error", "slow_client")
    assert "response.failed" not in [event.type for event in events]
    assert told[0].sequence_number == 7
    numbers = [event.sequence_number for event in events]
    assert numbers == [*range(7, 7 + len(told)), 6 + len(told)]
    assert [event.model_dump() for event in [*whole[:7], *told, *rest]] == [
        event.model_dump() for event in whole
    ]
    assert whole[-1].type == "response.completed"


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


def _entry(seq: int, kind: str, **fields: Any) -> LogEntry:
    return LogEntry(seq, kind, json.dumps({"type": kind, "sequence_number": seq - 1, **fields}))


def test_a_lost_producer_fails_the_response_with_the_output_told_before_and_after_a_place():
    # Its producer gone, nobody will write the response's end: the reader's response.failed
    # is it, with the whole message so far, the part told by an earlier connection (before
    # the resumed reader's place) as well as what this one sent.
    opened = {"id": "resp_r", "object": "response", "status": "in_progress", "model": "m"}
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant"}
    before = [
        _entry(1, "response.created", response=opened),
        _entry(2, "response.output_item.added", output_index=0, item={**item, "content": []}),
        _entry(3, "response.output_text.delta", item_id="msg_1", delta="Hello"),
    ]
    notices = ReaderNotices("r", opened, told=before)
    notices.sent([_entry(4, "response.output_text.delta", item_id="msg_1", delta=", world")])
    lost = json.dumps({"error": {"message": "the replica is gone", "code": "generator_lost"}})
    (kind, said), (ended, failed) = notices("error", lost, 4)
    assert (kind, ended) == ("error", "response.failed")
    assert json.loads(said) == {
        "type": "error",
        "sequence_number": 3,
        "code": "generator_lost",
        "message": "the replica is gone",
        "param": None,
    }
    response = json.loads(failed)["response"]
    assert (response["status"], response["model"], response["usage"]) == ("failed", "m", None)
    assert response["error"]["message"].endswith("(generator_lost)")
    [message] = response["output"]
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "Hello, world")
    # Any other ending a reader decides is its stream's alone: the error, in the same numbers.
    for code in ("slow_client", "shutdown", "events_lost", "replay_store_unavailable"):
        cut = json.dumps({"error": {"message": "cut", "code": code}})
        [(kind, said)] = notices("error", cut, 4)
        assert kind == "error" and json.loads(said)["sequence_number"] == 3


async def test_a_lost_producer_fails_a_response_past_its_logs_length_as_it_was_created():
    # A resumed reader of a response whose log no longer holds its ``response.created``: the
    # response.failed it would send for a lost producer carries the object the response was
    # created as, from what its conversation keeps, as a GET of it answers, not a bare id.
    store = MemoryReplayStore(max_entries=20)
    engine = fast_engine(reply_text="one two three " * 20, delay_ms=0, jitter_ms=0)
    async with (
        running(create_app(engine, store=store)) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-") as client,
    ):
        made = await client.responses.create(model="simulated", input="x", background=True)
        async with asyncio.timeout(30):
            while made.status in ("queued", "in_progress"):
                made = await client.responses.retrieve(made.id)
        reply_id = made.id.removeprefix("resp_")
        kept = await store.read(reply_id, 0, 0.0)
        assert kept is not None and kept.lost is not None  # its first events are gone
        first = kept.entries[0]
        notices, _ = await notices_of(first, reply_id, store, first.seq)
    assert isinstance(notices, ReaderNotices)
    lost = json.dumps({"error": {"message": "gone", "code": "generator_lost"}})
    _, (_, failed) = notices("error", lost, first.seq)
    told = json.loads(failed)["response"]
    assert told["id"] == made.id and told["status"] == "failed"
    assert (told["model"], told["background"]) == ("simulated", True)
    assert told["created_at"] == made.created_at
