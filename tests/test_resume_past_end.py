"""A resume at or past a finished reply's last event says so, instead of an empty 200 that
looks like a cut stream; on one server (memory store) and on a replica reading Redis."""

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from replystream.client import ResumingReader
from replystream.client.resume import Backoff
from replystream.delivery.redis_store import RedisReplayStore
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.rawhttp import raw_request
from tests.redis_server import redis_server
from tests.sse_client import post_events


@contextlib.asynccontextmanager
async def producer_and_reader(
    kind: str, tmp_path: Path, delay_ms: float = 1
) -> AsyncIterator[tuple[str, str]]:
    """(the URL that starts replies, the URL that resumes them); ``delay_ms`` a token."""
    engine = fast_engine(delay_ms=delay_ms, jitter_ms=0)
    if kind == "memory":
        async with running(create_app(engine)) as url:
            yield url, url
        return
    with redis_server(tmp_path) as redis:
        producer = create_app(engine, store=RedisReplayStore(redis.url))
        reader = create_app(fast_engine(), store=RedisReplayStore(redis.url))
        async with running(producer) as a, running(reader) as b:
            yield a, b


async def resume(url: str, reply_id: str, last_event_id: str) -> tuple[int, Any, bytes]:
    response = await raw_request(
        f"{url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": last_event_id}
    )
    body = await response.read_body()
    parsed = json.loads(body) if response.status != 200 else {}
    return response.status, parsed, body


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_resume_at_the_last_event_is_409_and_past_it_is_400(kind: str, tmp_path: Path):
    async with producer_and_reader(kind, tmp_path) as (start, other):
        first = await post_events(
            f"{start}/v1/replies", {"prompt": "x", "resumable": True, "max_tokens": 3}
        )
        reply_id = first.headers["x-reply-id"]
        last = int(first.events[-1].id or 0)
        assert first.types[-1] == "done" and last == 6
        # Stores written in the background (Redis) have it all once the reader ended.
        before_end = await resume(other, reply_id, str(last - 1))
        at_end = await resume(other, reply_id, str(last))
        past_end = await resume(other, reply_id, str(last + 1))
        far_past = await resume(other, reply_id, "9" * 19)
    assert before_end[0] == 200 and before_end[2].startswith(b"event: done\nid: 6\n")
    status, body, _ = at_end
    assert status == 409
    assert body["error"]["code"] == "reply_ended" and body["error"]["param"] == "last_event_id"
    assert "6" in body["error"]["message"]
    for status, body, _ in (past_end, far_past):
        assert status == 400
        assert body["error"]["code"] == "invalid_value"
        assert body["error"]["param"] == "last_event_id"


async def test_a_resuming_reader_holding_the_last_event_finishes_instead_of_retrying():
    async with running(create_app(fast_engine(delay_ms=1, jitter_ms=0))) as url:
        first = await post_events(
            f"{url}/v1/replies", {"prompt": "x", "resumable": True, "max_tokens": 2}
        )
        reader = ResumingReader(
            f"{url}/v1/replies", backoff=Backoff(base_s=0.001, cap_s=0.01, max_attempts=3)
        )
        # As after a drop that came right after the last event, before the reader saw it end.
        reader.reply_id = first.headers["x-reply-id"]
        reader.last_event_id = first.events[-1].id or ""
        events = [event async for event in reader.events()]
    assert events == [] and reader.finished and reader.reconnects == 0


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_resume_past_the_last_event_of_a_live_reply_made_here_is_400(
    kind: str, tmp_path: Path
):
    # The server making a live reply knows its last event exactly (no replica's log to wait
    # for): an id past it is not one of this reply's, said at once, not as an empty 200 sent
    # once the reply has ended.
    async with producer_and_reader(kind, tmp_path) as (start, _):
        live = await raw_request(
            f"{start}/v1/replies", "POST", b'{"prompt": "x", "resumable": true, "max_tokens": 500}'
        )
        reply_id = live.headers["x-reply-id"]
        status, body, _ = await resume(start, reply_id, "999999")
        await live.aclose()
    assert status == 400
    assert body["error"]["code"] == "invalid_value" and body["error"]["param"] == "last_event_id"
    assert "999999" in body["error"]["message"]


async def resume_live_elsewhere(tmp_path: Path, place: int) -> tuple[int, bytes, bytes]:
    """A 10-token reply made on one replica, resumed after ``place`` on another while it is
    live: (the resume's status, its body, the whole reply as its own client read it)."""
    async with producer_and_reader("redis", tmp_path, delay_ms=20) as (start, other):
        live = await raw_request(
            f"{start}/v1/replies",
            "POST",
            b'{"prompt": "x", "resumable": true, "max_tokens": 10}',
        )
        status, _, body = await resume(other, live.headers["x-reply-id"], str(place))
        whole = await live.read_body()
    return status, body, whole


async def test_a_place_past_the_end_of_a_reply_live_elsewhere_ends_with_an_error_not_nothing(
    tmp_path: Path,
):
    # Another replica cannot know a live reply's last event (the producer's log may be behind
    # what it sent): the place is followed live; when the reply ends with nothing after it,
    # the reader is told so in-band, not sent an empty 200 that looks like a cut stream.
    status, body, _ = await resume_live_elsewhere(tmp_path, 1000)
    assert status == 200
    text = body.decode()
    assert text.startswith("event: error\n"), text
    error = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])["error"]
    assert error["code"] == "invalid_value" and error["param"] == "last_event_id"
    assert error["message"].startswith("last_event_id 1000 is past this reply's last event (")


async def test_a_place_past_the_end_of_a_response_live_elsewhere_is_an_error_in_its_numbers(
    tmp_path: Path,
):
    # The same on the Responses API: said in the client's own numbers (sequence numbers,
    # naming starting_after), as the error alone: the response itself did not fail.
    async with producer_and_reader("redis", tmp_path, delay_ms=20) as (start, other):
        made = await raw_request(
            f"{start}/v1/responses",
            "POST",
            b'{"input": "x", "background": true, "max_output_tokens": 10}',
        )
        response_id = json.loads(await made.read_body())["id"]
        resumed = await raw_request(
            f"{other}/v1/responses/{response_id}?stream=true&starting_after=500"
        )
        status, body = resumed.status, await resumed.read_body()
        whole = await raw_request(f"{start}/v1/responses/{response_id}?stream=true")
        last = int(json.loads(whole_events(await whole.read_body())[-1])["sequence_number"])
    assert status == 200
    events = whole_events(body)
    assert [json.loads(data)["type"] for data in events] == ["error"], body
    error = json.loads(events[0])
    assert error["code"] == "invalid_value" and error["param"] == "starting_after"
    assert error["message"] == f"starting_after 500 is past this reply's last event ({last})"
    assert error["sequence_number"] == last


def whole_events(body: bytes) -> list[str]:
    """The data of each event of an SSE body."""
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


async def test_a_place_at_the_last_event_of_a_reply_live_elsewhere_ends_the_stream_quietly(
    tmp_path: Path,
):
    # The reader holds the whole reply: followed live on another replica, nothing comes
    # after its place, and that is no error (a place past the end is: above).
    last = 10 + 3  # its start, 10 tokens, its usage and its done, numbered from 1
    status, body, whole = await resume_live_elsewhere(tmp_path, last)
    assert whole.rstrip().split(b"\n")[-2] == f"id: {last}".encode()  # done's id
    assert status == 200 and b"event: error" not in body, body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
async def test_a_place_past_the_end_of_a_dialect_reply_live_elsewhere_names_the_place(
    tmp_path: Path, path: str, body: dict[str, Any]
):
    # Resumed in the dialect it was made in, the error still says the reader's request was
    # at fault and names the place, as the 400 a resume on the producer's replica is.
    request = {
        "model": "simulated",
        "stream": True,
        "max_tokens": 10,
        **body,
        **({"replystream": {"resumable": True}} if path == "/v1/messages" else {"resumable": True}),
    }
    async with producer_and_reader("redis", tmp_path, delay_ms=20) as (start, other):
        live = await raw_request(f"{start}{path}", "POST", json.dumps(request).encode())
        status, _, resumed = await resume(other, live.headers["x-reply-id"], "1000")
        await live.read_body()
    assert status == 200
    events = whole_events(resumed)
    assert len(events) == 1, resumed
    error = json.loads(events[0])["error"]
    assert error["code"] == "invalid_value" and error["param"] == "last_event_id", error
    assert error["type"] == "invalid_request_error", error
    assert error["message"].startswith("last_event_id 1000 is past this reply's last event (")
