"""Background responses across two replicas sharing one Redis, behind a real nginx.

A background response started on one replica is read in pieces through nginx, each piece
from wherever nginx sends it, resuming with ``starting_after``; and a replica killed while
it produces one is reported on the other, never a hang.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import signal
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from redis.asyncio import Redis

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo
from replystream.delivery.responses_objects import reply_id_of
from replystream.engine.simulated import SimulatedEngine
from replystream.server import create_app, running
from replystream.server.context import MANAGER_KEY
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, our_code, wait_for
from tests.processes import replica, start_server, stop
from tests.redis_server import redis_server
from tests.stalling_proxy import host_port, proxy_stalling_its_first_connection, small_send_buffer
from tests.test_scale_out import cluster

KEPT = json.dumps({"messages": []})  # the least conversation a stored response keeps


async def events_after(
    http: aiohttp.ClientSession, url: str, response_id: str, after: int, take: int
) -> list[tuple[int, str, dict[str, object]]]:
    """Up to ``take`` events after ``after`` (then the connection is cut)."""
    query = {"stream": "true", "starting_after": str(after)}
    seen: list[tuple[int, str, dict[str, object]]] = []
    parser = EventParser()
    async with http.get(f"{url}/v1/responses/{response_id}", params=query) as response:
        assert response.status == 200, await response.text()
        async for chunk in response.content.iter_any():
            for event in parser.feed(chunk):
                data = json.loads(event.data)
                seen.append((int(data["sequence_number"]), event.type, data))
            if len(seen) >= take:
                break
    return seen[:take]


async def test_100_cuts_of_a_background_response_resumed_on_either_replica(tmp_path: Path):
    rng = random.Random(7)
    async with cluster(tmp_path) as c, aiohttp.ClientSession() as http:
        body = {"input": "x", "background": True}
        async with http.post(f"{c.nginx}/v1/responses", json=body) as created:
            response_id = (await created.json())["id"]
        got: list[tuple[int, str, dict[str, object]]] = []
        cuts = 0
        while not got or got[-1][1] not in ("response.completed", "response.failed"):
            after = got[-1][0] if got else 0
            got += await events_after(http, c.nginx, response_id, after, rng.randint(1, 2))
            cuts += 1
        async with http.get(f"{c.replicas[1]}/v1/responses/{response_id}") as final:
            whole = await final.json()
    numbers = [number for number, _, _ in got]
    assert numbers == list(range(1, len(got) + 1))  # every event exactly once, in order
    assert cuts >= 100
    text = "".join(str(data["delta"]) for _, kind, data in got if kind.endswith(".delta"))
    assert whole["status"] == "completed"
    assert text == whole["output"][0]["content"][0]["text"]
    assert got[-1][2]["response"] == whole


async def test_a_killed_producer_is_reported_on_the_other_replica(tmp_path: Path):
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0")
    with redis_server(tmp_path) as redis:
        a_proc, a_url = await start_server(*slow, "--redis-url", redis.url)
        try:
            async with (
                replica(*slow, "--redis-url", redis.url) as (_, b_url),
                aiohttp.ClientSession() as http,
            ):
                body = {"input": "x", "background": True}
                async with http.post(f"{a_url}/v1/responses", json=body) as created:
                    response_id = (await created.json())["id"]
                await asyncio.sleep(0.5)
                a_proc.send_signal(signal.SIGKILL)
                await a_proc.wait()
                loop = asyncio.get_running_loop()
                began = loop.time()
                query = {"stream": "true"}
                async with asyncio.timeout(15):
                    async with http.get(
                        f"{b_url}/v1/responses/{response_id}", params=query
                    ) as stream:
                        events = EventParser().feed(await stream.read())
                    waited = loop.time() - began
                    async with http.get(f"{b_url}/v1/responses/{response_id}") as final:
                        failed = await final.json()
        finally:
            await stop(a_proc)
    assert [e.type for e in events].count("response.output_text.delta") >= 3
    # Decided by the reader, not in the log: OpenAI's error event, then response.failed.
    error, failed_event = (json.loads(e.data) for e in events[-2:])
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert error["code"] == "generator_lost" and "gone" in error["message"]
    assert failed_event["response"]["status"] == "failed"
    assert our_code(failed_event["response"]["error"]) == "generator_lost"
    # A whole response object, with the settings it opened with and the output the stream
    # told: what a GET tells of the response its producer left.
    told = failed_event["response"]
    assert set(told) == set(failed) and told["output"] == failed["output"]
    text = "".join(json.loads(e.data)["delta"] for e in events if e.type.endswith("text.delta"))
    assert told["output"][0]["content"][0]["text"] == text
    assert told["output"][0]["status"] == "incomplete"
    assert {k: told[k] for k in ("id", "model", "created_at")} == {
        k: failed[k] for k in ("id", "model", "created_at")
    }
    numbers = [json.loads(e.data)["sequence_number"] for e in events]
    # The reader's own two carry the number of the last event written before them.
    assert numbers == [*range(len(events) - 2), len(events) - 3, len(events) - 3]
    assert (failed["status"], our_code(failed["error"])) == ("failed", "generator_lost")
    assert waited < 10  # liveness expires after 3 s; never a hang


async def test_a_killed_producers_response_is_told_failed_by_get_and_cancel_as_soon_as_known(
    tmp_path: Path,
):
    """A replica dies (SIGKILL) while it makes two background responses. On the other one,
    a GET polled meanwhile says ``in_progress`` until the death is known, then ``failed``
    (``generator_lost``), within the bound docs/api.md gives (its liveness key lapses at
    most 3 s after its last heartbeat, then its heartbeat count stands still 2.5 s: 5.5 s);
    and a cancel asked then answers ``failed`` as soon as that is known too. It answered
    7.6 s after it was asked: its wait for the ending, cut at 5 s while it made sure the
    producer had died, made sure again for its answer."""
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "2000")
    with redis_server(tmp_path) as redis:
        a_proc, a_url = await start_server(*slow, "--redis-url", redis.url)
        try:
            async with (
                replica(*slow, "--redis-url", redis.url) as (_, b_url),
                aiohttp.ClientSession() as http,
                Redis.from_url(redis.url) as client,
            ):
                made = []
                for _ in range(2):
                    body = {"input": "x", "background": True}
                    async with http.post(f"{a_url}/v1/responses", json=body) as created:
                        made.append((await created.json())["id"])
                polled, cancelled = made
                await asyncio.sleep(0.5)
                a_proc.send_signal(signal.SIGKILL)
                await a_proc.wait()
                loop = asyncio.get_running_loop()
                killed_at = loop.time()
                # As if A had died half a second after its last beat: the cancel's wait finds
                # the key gone at its third read, and makes sure across its 5 s.
                live = f"replystream:reply:{{{reply_id_of(cancelled)}}}:live"
                assert await client.pexpire(live, 2500)

                async def poll() -> list[tuple[float, dict[str, Any]]]:
                    answers: list[tuple[float, dict[str, Any]]] = []
                    while not answers or answers[-1][1]["status"] == "in_progress":
                        async with http.get(f"{b_url}/v1/responses/{polled}") as read:
                            assert read.status == 200, await read.text()
                            answers.append((loop.time() - killed_at, await read.json()))
                        await asyncio.sleep(0.2)
                    return answers

                async def cancel() -> tuple[float, dict[str, Any]]:
                    asked = loop.time()
                    async with http.post(f"{b_url}/v1/responses/{cancelled}/cancel") as told:
                        assert told.status == 200, await told.text()
                        return loop.time() - asked, await told.json()

                async with asyncio.timeout(30):
                    answers, (cancel_took, after_cancel) = await asyncio.gather(poll(), cancel())
                    again = loop.time()
                    async with http.get(f"{b_url}/v1/responses/{polled}") as read:
                        assert (await read.json())["status"] == "failed"
                    again = loop.time() - again
        finally:
            await stop(a_proc)
    statuses = [shown["status"] for _, shown in answers]
    assert statuses == ["in_progress"] * (len(answers) - 1) + ["failed"], statuses
    known_after, failed = answers[-1]
    assert our_code(failed["error"]) == "generator_lost"
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"]
    assert known_after < 5.5 + 3.5, known_after  # the documented bound, generously
    assert again < 1.0  # the producer is known lost now: no need to make sure again
    assert (after_cancel["status"], our_code(after_cancel["error"])) == ("failed", "generator_lost")
    # Known at about 5.5 s (its key gone at 2.5 s, found at the next read, then 2.5 s).
    print(f"GET failed {known_after:.2f} s after the kill, cancel took {cancel_took:.2f} s")
    assert cancel_took < 7.0, cancel_took


@asynccontextmanager
async def two_slow_replicas(
    tmp_path: Path,
) -> AsyncIterator[tuple[str, str, str, aiohttp.ClientSession]]:
    """Two ``serve`` processes on one Redis, a token every 50 ms: A's and B's URLs, the
    Redis URL and a client session."""
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0")
    with redis_server(tmp_path) as redis:
        async with (
            replica(*slow, "--redis-url", redis.url) as (_, a_url),
            replica(*slow, "--redis-url", redis.url) as (_, b_url),
            aiohttp.ClientSession() as http,
        ):
            yield a_url, b_url, redis.url, http


@asynccontextmanager
async def deleted_elsewhere(
    tmp_path: Path, after_s: float = 0.0
) -> AsyncIterator[tuple[str, str, str, str, aiohttp.ClientSession]]:
    """A background response made on replica A and deleted on replica B ``after_s`` later
    (both on one Redis); yields A's and B's URLs, the Redis URL, the response's id and a
    client session."""
    async with two_slow_replicas(tmp_path) as (a_url, b_url, redis_url, http):
        body = {"input": "x", "background": True}
        async with http.post(f"{a_url}/v1/responses", json=body) as created:
            response_id = (await created.json())["id"]
        await asyncio.sleep(after_s)
        async with http.delete(f"{b_url}/v1/responses/{response_id}") as deleted:
            assert deleted.status == 200
            assert (await deleted.json())["deleted"] is True
        yield a_url, b_url, redis_url, response_id, http


async def test_a_response_deleted_on_one_replica_while_the_other_makes_it_stays_deleted(
    tmp_path: Path,
):
    made = deleted_elsewhere(tmp_path, after_s=0.5)  # while A makes it
    async with made as (a_url, b_url, redis_url, response_id, http):
        # A hears of it at its next heartbeat and stops; no heartbeat or write of its makes
        # the response again.
        await asyncio.sleep(3)
        for url in (a_url, b_url):
            async with http.get(f"{url}/v1/responses/{response_id}") as gone:
                assert gone.status == 404, await gone.text()
        async with http.get(f"{a_url}/metrics") as metrics:
            text = await metrics.text()
        reply_id = str(reply_id_of(response_id))
        async with Redis.from_url(redis_url) as client:
            keys = [key async for key in client.scan_iter(f"*{reply_id}*")]
            mark = await client.hgetall(f"replystream:reply:{{{reply_id}}}:meta")
    assert 'outcome="cancelled"} 1.0' in text, text
    # What is left is the mark of the delete, until its TTL.
    assert keys == [f"replystream:reply:{{{reply_id}}}:meta".encode()]
    assert mark == {b"deleted": b"1"}


async def test_a_response_deleted_on_another_replica_is_404_at_once_where_it_is_made(
    tmp_path: Path,
):
    # Its producer hears of the delete at its next heartbeat: until then, its replica read
    # the response from its own copy, and answered it (200, and its stream) after the
    # DELETE had been answered.
    async with deleted_elsewhere(tmp_path) as (a_url, _, _, response_id, http):
        for query in ("", "?stream=true"):
            async with http.get(f"{a_url}/v1/responses/{response_id}{query}") as gone:
                assert gone.status == 404, await gone.text()
        async with http.get(f"{a_url}/v1/replies/{reply_id_of(response_id)}/stream") as gone:
            assert gone.status == 404, await gone.text()


async def test_a_response_made_elsewhere_is_followed_before_its_first_event_is_logged(
    tmp_path: Path,
):
    """A replica knows a reply from its metadata as soon as the producer created it, but
    the producer logs its events a moment after it sends them: a resume in between (the
    client dropped after its first events and came back at once, on the other replica) is
    followed, not told the response does not exist."""
    with redis_server(tmp_path) as redis:
        producer, reader = RedisReplayStore(redis.url), RedisReplayStore(redis.url)
        async with (
            running(create_app(fast_engine(), ServerConfig(), reader)) as url,
            aiohttp.ClientSession() as http,
        ):
            # What a replica's start writes for a stored response: its kept conversation.
            await producer.create(ReplyInfo("made-on-a", context=KEPT))
            opened = {"id": "resp_made-on-a", "object": "response", "status": "in_progress"}
            created = json.dumps({"type": "response.created", "response": opened})

            async def log_later() -> None:
                await asyncio.sleep(0.3)
                producer.append("made-on-a", [LogEntry(1, "response.created", created)])
                producer.end("made-on-a", "finished")

            logging = asyncio.create_task(log_later())
            query = {"stream": "true"}
            async with http.get(f"{url}/v1/responses/resp_made-on-a", params=query) as got:
                status, body = got.status, await got.read()
            await logging
            await producer.aclose()
    assert status == 200, body
    assert [e.type for e in EventParser().feed(body)] == ["response.created"]


async def test_a_response_whose_log_expires_while_its_lost_producer_is_confirmed_is_gone(
    tmp_path: Path,
):
    """A response whose producer died: reading its object waits a moment to confirm the
    producer is lost. Its keys expiring meanwhile (here deleted, as an expiry does) leave no
    response: a 404, never the object read before the wait as if it were still in progress."""
    with redis_server(tmp_path) as redis:
        producer = RedisReplayStore(redis.url, liveness_s=1.0)
        reader = RedisReplayStore(redis.url)
        await producer.create(ReplyInfo("dead", context=KEPT))
        opened = {"id": "resp_dead", "object": "response", "status": "in_progress"}
        created = json.dumps({"type": "response.created", "response": opened})
        producer.append("dead", [LogEntry(1, "response.created", created)])
        await producer.flush()
        for task in producer._tasks:  # it dies: no more heartbeats, its liveness lapses
            task.cancel()
        await asyncio.sleep(1.5)
        keys = Redis.from_url(redis.url)

        async def expire_meanwhile() -> None:
            await asyncio.sleep(0.5)  # the reader is confirming the producer is lost
            await keys.delete(*await keys.keys("*dead*"))

        async with (
            running(create_app(fast_engine(), ServerConfig(), reader)) as url,
            aiohttp.ClientSession() as http,
        ):
            expiring = asyncio.create_task(expire_meanwhile())
            async with http.get(f"{url}/v1/responses/resp_dead") as got:
                status, body = got.status, await got.json()
            await expiring
        await keys.aclose()
        await producer.aclose()
        await reader.aclose()
    assert status == 404, body
    assert body["error"]["code"] == "reply_not_found"


async def test_a_reader_on_the_other_replica_held_back_takes_a_closing_larger_than_the_limit(
    tmp_path: Path,
):
    """A Responses reply's closing events repeat its whole text and log probabilities: one
    append larger than ``slow_client_bytes``. A reader of it on the other replica, held back
    (its write blocked, its backlog under the limit) while the reply ends there, hears of no
    append: it finds the closing in Redis when it looks while its write waits. It has had no
    chance to take it, so it is not cut for it, and then reading as fast as it can it gets
    the end, as a reader on the producer's replica does."""
    engine = fast_engine(reply_text="word " * 2000, delay_ms=1.5, jitter_ms=0.0)
    limit = 768 << 10
    config = ServerConfig(policy=DeliveryPolicy(slow_client_bytes=limit))
    ask: dict[str, Any] = {"model": "simulated", "input": "x", "max_output_tokens": 2000}
    ask.update(include=["message.output_text.logprobs"], top_logprobs=20)
    release = asyncio.Event()
    with redis_server(tmp_path) as redis:
        a = create_app(engine, config, RedisReplayStore(redis.url))
        b = create_app(fast_engine(), config, RedisReplayStore(redis.url))
        b.on_response_prepare.append(small_send_buffer)
        async with (
            running(a) as url_a,
            running(b) as url_b,
            proxy_stalling_its_first_connection(host_port(url_b), release) as proxied,
            openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key="-") as maker,
            openai.AsyncOpenAI(base_url=f"{proxied}/v1", api_key="-", max_retries=0) as reader,
        ):
            queued = await maker.responses.create(background=True, **ask)

            async def read() -> list[Any]:
                stream = await reader.responses.retrieve(queued.id, stream=True)
                return [event async for event in stream]

            reading = asyncio.ensure_future(read())
            replies = a[MANAGER_KEY].replies
            await wait_for(lambda: not replies, timeout_s=30)  # made to its end on A
            # B's follower, blocked on its write, looks at the log every second meanwhile.
            await asyncio.sleep(2.5)
            assert not reading.done()  # held back, not cut
            release.set()
            async with asyncio.timeout(30):
                events = await reading
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert events[-1].type == "response.completed"
    closing = sum(len(event.model_dump_json()) for event in events[-4:])
    sent_before = sum(len(event.model_dump_json()) for event in deltas)
    assert sent_before < limit < closing and len(deltas) == 2000
    assert "".join(event.delta for event in deltas) == events[-1].response.output_text


async def test_a_reader_of_a_reply_made_elsewhere_reset_while_its_write_waits_leaves_no_trace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A reader on the other replica whose write waits on a full socket, and whose client
    then resets the connection: the write fails and the handler is cancelled in one turn.
    The follower ends quietly, its write's failure taken, not left for asyncio to log with a
    traceback, as a task exception nobody retrieved, when the task is freed."""
    engine = fast_engine(reply_text="word " * 2000, delay_ms=2, jitter_ms=0.0)
    ask = {"input": "x", "background": True, "max_output_tokens": 2000}
    with redis_server(tmp_path) as redis:
        a = create_app(engine, ServerConfig(), RedisReplayStore(redis.url))
        b = create_app(fast_engine(), ServerConfig(), RedisReplayStore(redis.url))
        b.on_response_prepare.append(small_send_buffer)
        async with running(a) as url_a, running(b) as url_b, aiohttp.ClientSession() as http:
            async with http.post(f"{url_a}/v1/responses", json=ask) as created:
                response_id = (await created.json())["id"]
            # A client that sends its request and reads nothing.
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, host_port(url_b))
            path = f"/v1/responses/{response_id}?stream=true"
            await loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: b\r\n\r\n".encode())
            readers = b[MANAGER_KEY].readers
            # Its follower is blocked in a write (under its slow-client deadline) and sends
            # nothing more.
            await wait_for(lambda: len(readers) == 1, timeout_s=30)
            (follower,) = readers
            place = -1
            async with asyncio.timeout(30):
                while place != follower.cursor.after or follower._deadline is None:
                    place = follower.cursor.after
                    await asyncio.sleep(0.3)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset, not a close: the blocked write fails
            await wait_for(lambda: not readers, timeout_s=30)
            del follower
            gc.collect()  # asyncio logs a task's unretrieved exception when the task is freed
    unretrieved = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unretrieved, unretrieved


@dataclass
class ReadElsewhere:
    """A streamed response (not in the background) made on replica A, its creator's stream
    still open, and a reader following it on replica B that has read its first event."""

    engine: SimulatedEngine
    a: web.Application
    a_url: str
    http: aiohttp.ClientSession
    response_id: str
    creator: aiohttp.ClientResponse
    read: aiohttp.ClientResponse


@asynccontextmanager
async def read_on_the_other_replica(tmp_path: Path, tokens: int) -> AsyncIterator[ReadElsewhere]:
    with redis_server(tmp_path) as redis:
        engine = fast_engine(delay_ms=20, jitter_ms=0, reply_text="word " * tokens)
        a = create_app(engine, ServerConfig(), RedisReplayStore(redis.url))
        b = create_app(fast_engine(), ServerConfig(), RedisReplayStore(redis.url))
        async with running(a) as a_url, running(b) as b_url, aiohttp.ClientSession() as http:
            body = {"input": "x", "stream": True, "max_output_tokens": tokens}
            creator = await http.post(f"{a_url}/v1/responses", json=body)
            first = json.loads((await creator.content.readuntil(b"\n\n")).split(b"data: ")[1])
            response_id = first["response"]["id"]
            query = {"stream": "true"}
            async with http.get(f"{b_url}/v1/responses/{response_id}", params=query) as read:
                await read.content.readuntil(b"\n\n")
                await asyncio.sleep(2.5)  # A's heartbeat has found B's reader by now
                yield ReadElsewhere(engine, a, a_url, http, response_id, creator, read)


async def test_a_response_read_on_the_other_replica_goes_on_when_its_own_client_leaves(
    tmp_path: Path,
):
    # A response not in the background stops when its last reader leaves. A reader on the
    # other replica is a reader too: on one replica a second reader keeps it going, so it
    # must across replicas, rather than being cancelled under that reader.
    async with read_on_the_other_replica(tmp_path, 200) as r:
        r.creator.close()  # the response's own client leaves, on A
        events = EventParser().feed(await r.read.read())
    assert events[-1].type == "response.completed", events[-1].data[:300]
    assert r.engine.stats().cancelled == 0


async def test_a_response_read_only_on_the_other_replica_stops_soon_after_that_reader_leaves(
    tmp_path: Path,
):
    async with read_on_the_other_replica(tmp_path, 2000) as r:
        r.creator.close()
        await asyncio.sleep(1.0)
        r.read.close()  # and then the reader on B
        loop = asyncio.get_running_loop()
        left = loop.time()
        await wait_for(lambda: not r.a[MANAGER_KEY].replies, timeout_s=20)
        stopped_after = loop.time() - left
        async with r.http.get(f"{r.a_url}/v1/responses/{r.response_id}") as final:
            stopped = await final.json()
    assert r.engine.stats().cancelled == 1  # stopped, not made to its 2,000 tokens
    assert stopped["status"] == "cancelled"
    assert stopped_after < 5, stopped_after  # about a beat and a half, on a loaded machine
