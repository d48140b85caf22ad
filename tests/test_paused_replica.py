"""A server that stops and comes back (a VM frozen, a container throttled, ``kill -STOP``).

Two ``replystream serve`` processes share a real redis-server; the one producing a reply is
paused with SIGSTOP for longer than its liveness lasts, so that readers on the other replica
are told ``generator_lost``, then let go on with SIGCONT. What they were told must stay
true: the reply does not go on in Redis behind their backs (a resume finds no more events,
a response told ``failed`` is never ``completed`` later), and the producer, back, stops it
with the same ending for its own readers.

A process back from a pause finds every timer due meanwhile firing at once, before it has
read what its peers sent while it was stopped: its deadlines must not blame them for its own
pause (a relay calling its upstream stalled, a server closing connections whose requests
came in time).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.redis_writes import LOST_SCRIPT
from replystream.delivery.replay import LogEntry, ReplyInfo
from replystream.server import running
from replystream.sse import Event, EventParser
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import our_code
from tests.processes import replica, start_server, stop
from tests.redis_server import redis_server

# 50 ms a token, 1,000 tokens: the reply outlives the test, so what the paused producer
# does once it is back is seen while it is still making the reply.
SLOW = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "1000")


async def events_of(response: aiohttp.ClientResponse, into: list[Event]) -> None:
    parser = EventParser()
    async for chunk in response.content.iter_any():
        into.extend(parser.feed(chunk))


async def first_event(response: aiohttp.ClientResponse) -> Event:
    """The first event of a stream (the rest is left unread)."""
    parser = EventParser()
    async for chunk in response.content.iter_any():
        events = parser.feed(chunk)
        if events:
            return events[0]
    raise AssertionError("the stream ended with no event")


@asynccontextmanager
async def two_replicas(
    tmp_path: Path,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, str]]:
    """Replica A (its process, to pause) and B, sharing one Redis: A's process and both URLs."""
    with redis_server(tmp_path) as redis:
        a_proc, a_url = await start_server(*SLOW, "--redis-url", redis.url)
        try:
            async with replica(*SLOW, "--redis-url", redis.url) as (_, b_url):
                yield a_proc, a_url, b_url
        finally:
            a_proc.send_signal(signal.SIGCONT)
            await stop(a_proc)


async def test_a_reply_whose_paused_producer_was_told_lost_stays_lost_once_it_is_back(
    tmp_path: Path,
):
    async with two_replicas(tmp_path) as (a_proc, a_url, b_url), aiohttp.ClientSession() as http:
        body = {"prompt": "x", "resumable": True}
        async with http.post(f"{a_url}/v1/replies", json=body) as own:
            reply_id = own.headers["X-Reply-Id"]
            own_events: list[Event] = []
            own_reading = asyncio.create_task(events_of(own, own_events))
            async with http.get(f"{b_url}/v1/replies/{reply_id}/stream") as elsewhere:
                await asyncio.sleep(1.0)
                a_proc.send_signal(signal.SIGSTOP)
                # Its liveness lapses in 3 s, confirmed in 2.5 s more: told within ~6 s.
                async with asyncio.timeout(15):
                    told = EventParser().feed(await elsewhere.read())
            a_proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(2.0)  # back, the producer makes the tokens it owes at once
            seen = max(int(e.id) for e in told if e.id)
            # Resumed where the reader on B was told the reply is lost: still lost, no more.
            async with (
                asyncio.timeout(15),
                http.get(
                    f"{b_url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(seen)}
                ) as resumed,
            ):
                again = await first_event(resumed)
            assert again.type == "error", again
            async with asyncio.timeout(15):
                await own_reading
    assert told[-1].type == "error"
    assert json.loads(told[-1].data)["error"]["code"] == "generator_lost"
    assert json.loads(again.data)["error"]["code"] == "generator_lost"
    # The producer's own reader: the reply ends for it as it did for the others.
    assert own_events[-1].type == "error"
    assert json.loads(own_events[-1].data)["error"]["code"] == "generator_lost"
    assert not [e for e in own_events if e.type == "done"]


async def test_a_response_told_failed_while_its_producer_was_paused_never_completes(
    tmp_path: Path,
):
    async with two_replicas(tmp_path) as (a_proc, a_url, b_url), aiohttp.ClientSession() as http:
        body = {"input": "x", "background": True}
        async with http.post(f"{a_url}/v1/responses", json=body) as created:
            response_id = (await created.json())["id"]
        await asyncio.sleep(1.0)
        a_proc.send_signal(signal.SIGSTOP)

        async def status_on(url: str) -> dict[str, Any]:
            async with http.get(f"{url}/v1/responses/{response_id}") as answer:
                assert answer.status == 200, await answer.text()
                found: dict[str, Any] = await answer.json()
                return found

        async with asyncio.timeout(15):
            while (await status_on(b_url))["status"] != "failed":  # noqa: ASYNC110
                await asyncio.sleep(0.5)
        a_proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(3.0)  # the producer, back, has written (or tried to) meanwhile
        after = [await status_on(url) for url in (b_url, a_url)]
    for answer in after:
        assert answer["status"] == "failed", answer["status"]
        assert our_code(answer["error"]) == "generator_lost"
    # The same response on either replica: its producer's own replica does not answer from
    # its copy, which holds what it made before it heard (Redis took none of it).
    assert after[0]["output"] == after[1]["output"]


async def test_a_producer_back_after_its_reply_was_found_lost_writes_no_more_and_is_stopped(
    tmp_path: Path,
):
    with redis_server(tmp_path) as server:
        producer = RedisReplayStore(server.url, liveness_s=1.0)
        reader = RedisReplayStore(server.url)
        late = RedisReplayStore(server.url)
        lost: list[str] = []
        producer.on_lost(lost.append)
        try:
            await producer.create(ReplyInfo("r"))
            producer.append("r", [LogEntry(1, "token", "1")])
            await producer.flush()
            for task in producer._tasks:  # its process stops: no beat, no write
                task.cancel()
            await asyncio.sleep(1.5)  # its liveness lapses
            told = await reader.read("r", 1, wait_s=0.1)
            assert told is not None and told.producer_lost
            # Back: what it made meanwhile is refused, and it hears it was taken for lost.
            producer.append("r", [LogEntry(2, "token", "2")])
            await producer.flush()
            assert lost == ["r"]
            assert producer.failure("r") is not None
            await producer._heartbeat._beat_once()  # its liveness is not made again
            for store in (reader, late):
                first = await store.read("r", 0, wait_s=0.0)
                assert first is not None and [e.seq for e in first.entries] == [1]
                after = await store.read("r", 1, wait_s=0.1)
                assert after is not None and after.producer_lost and not after.entries
        finally:
            for store in (producer, reader, late):
                await store.aclose()


async def test_a_producer_that_moved_while_it_was_being_found_lost_is_not_marked(
    tmp_path: Path,
):
    with redis_server(tmp_path) as server:
        redis = Redis.from_url(server.url)
        settle = redis.register_script(LOST_SCRIPT)
        meta, live, stream = "m:{r}:meta", "m:{r}:live", "m:{r}"
        await redis.hset(meta, mapping={"owner": "", "beat": 5})
        await redis.xadd(stream, {"d": "1"}, id="0-3")
        try:
            # Its count moved past what the reader saw stand still; an event came past the
            # reader's place; its liveness key is back; it ended: none of these is lost.
            assert await settle(keys=[meta, live, stream], args=["4", 3]) == 0
            assert await settle(keys=[meta, live, stream], args=["5", 2]) == 0
            await redis.set(live, "1")
            assert await settle(keys=[meta, live, stream], args=["5", 3]) == 0
            await redis.delete(live)
            await redis.hset(meta, "end", "finished")
            assert await settle(keys=[meta, live, stream], args=["5", 3]) == 0
            assert not await redis.hexists(meta, "lost")
            await redis.hdel(meta, "end")
            assert await settle(keys=[meta, live, stream], args=["5", 3]) == 1
            assert await redis.hexists(meta, "lost")
        finally:
            await redis.aclose()


async def test_a_relay_paused_past_its_stall_limit_reads_what_its_upstream_sent_meanwhile():
    # The upstream goes on sending while the relay's process is stopped; its text waits in
    # the socket. Back, the relay's watchdog (due long ago) must not call the upstream
    # stalled before the relay has read what came.
    upstream = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "80")
    async with replica(*upstream) as (_, upstream_url):
        relay_args = ("--engine", f"upstream:{upstream_url}/v1", "--upstream-stall-s", "1")
        async with replica(*relay_args) as (relay, relay_url), aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            async with http.post(f"{relay_url}/v1/chat/completions", json=body) as streamed:
                events: list[Event] = []
                reading = asyncio.create_task(events_of(streamed, events))
                await asyncio.sleep(1.0)
                relay.send_signal(signal.SIGSTOP)
                await asyncio.sleep(3.0)
                relay.send_signal(signal.SIGCONT)
                async with asyncio.timeout(15):
                    await reading
    said = [e.data for e in events]
    assert not [e for e in events if e.type == "error"], said[-1]
    assert said[-1] == "[DONE]"
    text = "".join(
        json.loads(d)["choices"][0]["delta"].get("content") or "" for d in said if d != "[DONE]"
    )
    assert len(text.split()) == 80


async def test_requests_sent_in_time_while_the_server_was_paused_are_answered_once_it_is_back():
    # Each deadline (a request's headers, its body, a kept-alive connection's idleness) is a
    # second; each server is stopped for three, and its client sends in time, meanwhile.
    statuses = await asyncio.gather(*(answer_across_a_pause(case) for case in CASES))
    assert [line.split(b" ")[1:2] for line in statuses] == [[b"200"]] * 3, statuses


CASES = ("headers sent in the pause", "body finished in the pause", "kept alive, asked again")
BODY = b'{"prompt": "x", "stream": false}'
REQUEST = (
    b"POST /v1/replies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def answer_across_a_pause(case: str) -> bytes:
    """The status line a server stopped for 3 s answers a request sent meanwhile (one server
    per case, so that its deadline is the only one due)."""
    limits = ("--header-timeout-s", "1", "--body-timeout-s", "1", "--idle-timeout-s", "1")
    args = ("--engine", "simulated", "--delay-ms", "1", "--tokens", "3", *limits)
    async with replica(*args) as (server, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        rest = REQUEST
        if case == CASES[1]:
            writer.write(REQUEST[:-5])  # the headers and some of the body
            rest = REQUEST[-5:]
        elif case == CASES[2]:
            writer.write(REQUEST)  # answered, the connection is kept alive, idle
            async with asyncio.timeout(5):
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                await reader.readuntil(b"}}")
        await writer.drain()
        await asyncio.sleep(0.2)
        server.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(0.2)
            writer.write(rest)
            await asyncio.sleep(3.0)
        finally:
            server.send_signal(signal.SIGCONT)
        try:
            async with asyncio.timeout(10):
                return await reader.readline() or b"closed"
        except ConnectionError as exc:
            return repr(exc).encode()
        finally:
            writer.close()


class SlowToAnswer(ChatUpstream):
    """Sends its response head a second after each chat, then one word."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1.0)
        return await reply_with(request, "sunny")


async def test_a_relay_paused_while_its_upstream_answered_takes_the_answer_once_it_is_back():
    # The upstream's head comes a second after the request, while the relay's process is
    # stopped for three; its head timeout, two seconds, fell due meanwhile.
    async with running(SlowToAnswer().app()) as upstream_url:
        relay_args = ("--engine", f"upstream:{upstream_url}/v1", "--upstream-timeout-s", "2")
        async with replica(*relay_args) as (relay, relay_url), aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            asked = asyncio.create_task(http.post(f"{relay_url}/v1/chat/completions", json=body))
            await asyncio.sleep(0.3)
            relay.send_signal(signal.SIGSTOP)
            await asyncio.sleep(3.0)
            relay.send_signal(signal.SIGCONT)
            async with asyncio.timeout(15):
                answer = await asked
                said = await answer.json()
    assert answer.status == 200, said
    assert said["choices"][0]["message"]["content"] == "sunny"
