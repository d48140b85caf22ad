"""Resumable replies on one server with the in-memory reply log."""

import asyncio
import json
import logging
import random
from pathlib import Path

import aiohttp
import pytest

from replystream.client import ResumeFailed, ResumingReader
from replystream.client.resume import Backoff
from replystream.delivery.replay import MemoryReplayStore
from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from replystream.sse import Event
from tests.chaos_proxy import chaos_proxy, random_budget
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request
from tests.sse_client import post_events
from tests.stalling_proxy import (
    host_port,
    proxy_stalling_its_first_connection,
    server_cutting_stalled_readers,
)
from tests.test_resume_past_end import producer_and_reader

FAST_RETRY = Backoff(base_s=0.005, cap_s=0.05, max_attempts=50)


async def read_text(reader: ResumingReader) -> tuple[str, list[int]]:
    text, ids = [], []
    async for event in reader.events():
        if event.type == "token":
            text.append(json.loads(event.data)["text"])
            ids.append(int(event.id or 0))
    return "".join(text), ids


async def test_100_disconnects_at_random_points_each_resumed_without_gap_or_duplicate():
    engine = fast_engine(delay_ms=2, jitter_ms=1)
    rng = random.Random(7)
    async with running(create_app(engine)) as url:
        expected = (await post_events(f"{url}/v1/replies", {"prompt": "x", "seed": 0})).text
        # Each connection passes 260-1200 response bytes: past the headers (which carry the
        # reply id), then anywhere, mid-event included.
        async with chaos_proxy(lambda: host_port(url), random_budget(rng, 260, 1200)) as (
            proxied,
            proxy,
        ):
            replies = 0
            while proxy.cuts < 100:
                reader = ResumingReader(
                    f"{proxied}/v1/replies",
                    json_body={"prompt": "x", "seed": 0, "resumable": True},
                    backoff=FAST_RETRY,
                    seed=replies,
                )
                text, ids = await read_text(reader)
                replies += 1
                assert text == expected  # byte for byte: nothing lost, nothing twice
                assert ids == sorted(set(ids))
    assert proxy.cuts >= 100


async def test_resume_after_the_reply_finished_until_it_expires_then_404():
    store = MemoryReplayStore(ttl_after_end_s=0.5)
    engine = fast_engine(delay_ms=1, jitter_ms=0)
    async with running(create_app(engine, store=store)) as url:
        first = await post_events(
            f"{url}/v1/replies", {"prompt": "x", "resumable": True, "max_tokens": 10}
        )
        reply_id = first.headers["x-reply-id"]
        late = await raw_request(
            f"{url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "3"}
        )
        late_body = await late.read_body()
        from_start = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        whole = await from_start.read_body()
        await asyncio.sleep(0.7)
        gone = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        gone_body = json.loads(await gone.read_body())
    assert first.raw == whole  # a replay from the start is the same bytes
    assert late_body.startswith(b"event: token\nid: 4\n")
    assert late_body == whole[whole.index(b"event: token\nid: 4\n") :]
    assert gone.status == 404 and gone_body["error"]["code"] == "reply_not_found"


async def test_unknown_ids_bad_last_event_ids_and_non_resumable_replies():
    async with running(create_app(fast_engine(delay_ms=1, jitter_ms=0))) as url:
        unknown = await raw_request(f"{url}/v1/replies/not-a-reply/stream")
        assert unknown.status == 404
        await unknown.read_body()
        done = await post_events(f"{url}/v1/replies", {"prompt": "x", "max_tokens": 3})
        reply_id = done.headers["x-reply-id"]
        bad = await raw_request(
            f"{url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "abc"}
        )
        assert bad.status in (400, 404)
        await bad.read_body()
        # Not resumable: its log is dropped once it ended and its reader is done.
        await asyncio.sleep(0.05)
        after = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        assert after.status == 404
        await after.read_body()


async def test_detached_reply_keeps_generating_and_an_explicit_cancel_stops_it():
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    async with running(create_app(engine)) as url:
        response = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
        )
        reply_id = response.headers["x-reply-id"]
        await response.aclose()
        steps = engine.stats().steps
        await asyncio.sleep(0.1)
        assert engine.stats().steps > steps + 3  # still generating with nobody connected
        cancel = await raw_request(f"{url}/v1/replies/{reply_id}/cancel", "POST")
        assert cancel.status == 200
        assert json.loads(await cancel.read_body())["cancel_requested"] is True
        await wait_for(lambda: engine.stats().active == 0)
        assert engine.stats().cancelled == 1
        resumed = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        body = await resumed.read_body()
    assert body.rstrip().endswith(b'"code": "cancelled"}}')


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_cancel_of_a_reply_that_has_ended_says_none_was_asked_for_and_leaves_it(
    kind: str, tmp_path: Path
):
    # On Redis, asked of the replica that did not make it: it knows the reply ended from
    # the shared log.
    async with producer_and_reader(kind, tmp_path) as (start, other):
        done = await raw_request(
            f"{start}/v1/replies", "POST", b'{"prompt": "x", "resumable": true, "max_tokens": 3}'
        )
        reply_id = done.headers["x-reply-id"]
        whole = await done.read_body()
        assert b"event: done" in whole
        cancel = await raw_request(f"{other}/v1/replies/{reply_id}/cancel", "POST")
        assert cancel.status == 200
        answer = json.loads(await cancel.read_body())
        assert answer == {"reply_id": reply_id, "cancel_requested": False}
        resumed = await raw_request(f"{other}/v1/replies/{reply_id}/stream")
        assert await resumed.read_body() == whole  # still the reply as it ended


def events_of(body: bytes) -> list[tuple[str, str]]:
    """(event name, data) of each event of an SSE body."""
    events = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            events.append((fields.get("event", "message"), fields["data"]))
    return events


@pytest.mark.parametrize("route", ["http", "websocket"])
async def test_a_detached_reply_is_resumable_without_saying_so(route: str):
    """``disconnect: "detach"`` keeps the reply for its client to come back to: its whole log
    is kept, after it ended too, and read back from the start without a gap."""
    engine = fast_engine(delay_ms=3, jitter_ms=0)
    async with running(create_app(engine)) as url:
        expected = (await post_events(f"{url}/v1/replies", {"prompt": "x", "seed": 1})).text
        ask = {"prompt": "x", "seed": 1, "disconnect": "detach"}
        if route == "http":
            response = await raw_request(f"{url}/v1/replies", "POST", json.dumps(ask).encode())
            reply_id = response.headers["x-reply-id"]
            await response.reader.readuntil(b'"text"')  # a token was sent, then the client left
            await response.aclose()
        else:
            async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/ws") as ws:
                await ws.send_json({"type": "reply", "id": "d", **ask})
                reply_id = (await ws.receive_json())["data"]["reply_id"]
                assert (await ws.receive_json())["type"] == "token"
        await wait_for(lambda: engine.stats().finished == 2)  # it went on to its end
        resumed = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        body = await resumed.read_body()
    assert resumed.status == 200, body
    events = events_of(body)
    names = [name for name, _ in events]
    assert names[0] == "reply" and names[-1] == "done" and "gap" not in names
    assert "".join(json.loads(data)["text"] for name, data in events if name == "token") == expected


async def test_detached_reply_stops_when_nobody_comes_back_within_the_grace_period():
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    app = create_app(engine, ServerConfig(detach_grace_s=0.2))
    async with running(app) as url:
        response = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt":"x","resumable":true}'
        )
        await response.aclose()
        await wait_for(lambda: engine.stats().cancelled == 1)
    assert engine.stats().steps < 60


async def test_resumable_lab_stream_and_an_interrupted_reader_resumes():
    engine = fast_engine(delay_ms=3, jitter_ms=0)
    async with running(create_app(engine)) as url:
        reader = ResumingReader(
            f"{url}/stream?resumable=1&seed=4", method="GET", backoff=FAST_RETRY
        )
        seen = []
        async for event in reader.events():
            seen.append(event)
            if len(seen) == 10:
                break  # the consumer walks away mid-reply
        rest = ResumingReader(f"{url}/stream", method="GET", backoff=FAST_RETRY)
        rest.reply_id, rest.last_event_id = reader.reply_id, reader.last_event_id
        remaining = [e async for e in rest.events()]
    data = [json.loads(e.data) for e in seen[1:] + remaining if e.data != "[DONE]"]
    assert len(data) == 120
    assert remaining[-1].data == "[DONE]"


async def test_resume_of_an_expired_reply_fails_clearly():
    async with running(create_app(fast_engine())) as url:
        reader = ResumingReader(f"{url}/v1/replies", backoff=FAST_RETRY)
        reader.reply_id, reader.last_event_id = "expired-or-never-existed", "4"
        with pytest.raises(ResumeFailed, match="gone"):
            async for _ in reader.events():
                pass


async def test_a_gap_with_nothing_logged_after_it_yet_is_sent_once():
    # A reply nobody may resume: its one reader's events are released as they are sent, so a
    # second reader joining finds them gone, and nothing after them until the next token
    # (a second away: room for the join to arrive on a loaded machine). It is told of the
    # gap once, then waits for that token.
    engine = fast_engine(delay_ms=1000, jitter_ms=0)
    async with running(create_app(engine)) as url:
        first = await raw_request(f"{url}/v1/replies", "POST", b'{"prompt": "x", "max_tokens": 2}')
        reply_id = first.headers["x-reply-id"]
        await first.reader.readuntil(b"\n\n")  # its first event was sent, and so released
        resumed = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        body = await resumed.read_body()
        await first.aclose()
    assert body.startswith(
        b'event: gap\ndata: {"lost_from": 1, "lost_to": 1}\n\nevent: token\nid: 2\n'
    )
    assert body.count(b"event: gap") == 1
    assert body.rstrip().endswith(b'{"finish_reason": "length"}')


async def test_a_resume_refused_for_now_is_tried_again_after_its_retry_after():
    # One open request per client: while another stream of the client holds its slot, a
    # resume is refused with 429 and Retry-After. The reader waits as told and tries again,
    # rather than give up on a reply that goes on.
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    config = ServerConfig(guard=GuardConfig(max_concurrent=1))
    async with running(create_app(engine, config)) as url:
        whole = await post_events(f"{url}/v1/replies", {"prompt": "x", "max_tokens": 80})
        first = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true, "max_tokens": 80}'
        )
        reply_id = first.headers["x-reply-id"]
        await first.aclose()  # the connection drops; the reply goes on (detached)
        while (other := await raw_request(f"{url}/stream?max_tokens=40")).status == 429:
            await other.read_body()  # until the server has seen the first one go
        reader = ResumingReader(f"{url}/v1/replies", backoff=FAST_RETRY)
        reader.reply_id, reader.last_event_id = reply_id, "1"
        text, ids = await read_text(reader)
        await other.read_body()
    assert reader.reconnects >= 1 and reader.finished
    assert ids == list(range(2, 82))
    assert text == whole.text


async def test_a_responses_stream_cut_as_a_slow_client_is_resumed_not_ended(caplog):
    # The first connection stops reading: the server cuts it as a slow client with a
    # Responses-shaped notice (``code`` at the top of the ``error`` event's data). That is
    # about the connection, not the response: the reader resumes, and reads it to its end.
    caplog.set_level(logging.INFO, logger="replystream.follower")
    app = server_cutting_stalled_readers()
    release = asyncio.Event()
    body = {"model": "simulated", "input": "x", "stream": True, "background": True}
    async with running(app) as url:
        async with proxy_stalling_its_first_connection(host_port(url), release) as proxied:
            reader = ResumingReader(f"{proxied}/v1/responses", json_body=body, backoff=FAST_RETRY)
            events = asyncio.ensure_future(_collect(reader))
            await wait_for(
                lambda: any("cut: socket did not drain" in r.getMessage() for r in caplog.records),
                timeout_s=30,
            )
            release.set()
            async with asyncio.timeout(60):
                seen = await events
    types = [event.type for event in seen]
    assert reader.reconnects >= 1 and reader.finished
    assert types[-1] == "response.completed" and "error" not in types
    text = "".join(json.loads(e.data)["delta"] for e in seen if e.type.endswith("text.delta"))
    assert text == json.loads(seen[-1].data)["response"]["output"][0]["content"][0]["text"]
    assert len(text) == 300 * 2001


async def _collect(reader: ResumingReader) -> list[Event]:
    return [event async for event in reader.events()]
