"""What a client resuming on another replica is told when Redis evicted a reply's keys.

Two ``replystream serve`` replicas share one real Redis; a reply made on one ends, then one of
its keys is dropped (``DEL``, as a ``maxmemory`` Redis evicts: whole keys, any of them) and
the reply is resumed on the other: a stream evicted after its end gives a ``gap`` event for
what is missing and a properly ended stream (not ``generator_lost``), metadata evicted behind
its log answers ``410 reply_evicted`` in our error shape, and a reply with nothing left
answers ``404 reply_not_found``. The store-level cases, and a real small-``maxmemory`` Redis
under each eviction policy, are in ``tests/test_redis_eviction.py``.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from replystream.client.transport import http_request
from replystream.sse import EventParser
from tests.conftest import our_code
from tests.processes import replica, start_server, stop
from tests.redis_server import redis_server
from tests.sse_client import Received, post_events

ENGINE = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0", "--tokens", "20")
PREFIX = "replystream:reply:"


async def resume(url: str, after: int) -> tuple[Received, bytes]:
    """GET a reply's stream after event ``after``: its events, or its error body."""
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
    async with http_request(url, headers=headers) as response:
        got = Received(response.status, response.headers)
        parser, raw = EventParser(), bytearray()
        async for chunk in response:
            raw += chunk.data
            got.events.extend(parser.feed(chunk.data))
        return got, bytes(raw)


async def written_through(client: aioredis.Redis, reply_id: str) -> None:
    """Wait until the producer's last write (its ending, which the write script puts in the
    metadata with the stream's terminal entry) is in Redis. A local reader gets ``done``
    from the producing replica's own copy, a moment before its batched writes land: a key
    deleted before then would be made again by them."""
    meta = f"{PREFIX}{{{reply_id}}}:meta"
    async with asyncio.timeout(10):
        while not await client.hexists(meta, "end"):  # noqa: ASYNC110  (another process writes it)
            await asyncio.sleep(0.01)


async def test_a_resume_of_an_evicted_reply_is_told_what_is_gone(tmp_path: Path):
    with redis_server(tmp_path) as server:
        client = aioredis.Redis.from_url(server.url)
        args = (*ENGINE, "--redis-url", server.url)
        async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
            made = {}
            for name in ("stream", "meta", "all"):
                reply = await post_events(f"{a_url}/v1/replies", {"prompt": "x", "resumable": True})
                assert reply.types[-1] == "done"
                made[name] = reply.of_type("reply")[0]["reply_id"]
                await written_through(client, made[name])
            await client.delete(f"{PREFIX}{{{made['stream']}}}")
            await client.delete(f"{PREFIX}{{{made['meta']}}}:meta")
            await client.delete(f"{PREFIX}{{{made['all']}}}", f"{PREFIX}{{{made['all']}}}:meta")

            told, _ = await resume(f"{b_url}/v1/replies/{made['stream']}/stream", after=3)
            assert told.status == 200 and told.types == ["gap"], told.types
            gap = json.loads(told.events[0].data)
            assert gap["lost_from"] == 4 and gap["lost_to"] > 20  # its tokens and its done
            # The producing replica still holds its copy: there, the text is whole.
            whole, _ = await resume(f"{a_url}/v1/replies/{made['stream']}/stream", after=0)
            assert whole.types[-1] == "done" and "gap" not in whole.types

            gone, body = await resume(f"{b_url}/v1/replies/{made['meta']}/stream", after=3)
            error = json.loads(body)["error"]
            assert gone.status == 410, body
            assert (error["code"], error["type"]) == ("reply_evicted", "invalid_request_error")
            assert "evicted" in error["message"] and error["param"] == "reply_id"

            unknown, body = await resume(f"{b_url}/v1/replies/{made['all']}/stream", after=3)
            assert unknown.status == 404 and json.loads(body)["error"]["code"] == "reply_not_found"
        await client.aclose()


async def test_a_response_whose_log_redis_evicted_is_told_as_evicted_on_every_route(
    tmp_path: Path,
):
    """A stored response made on one replica ends; Redis evicts its stream (its metadata,
    which keeps whose it is, its input and its ending, stays). Asked on the other replica,
    its object is a 410 ``reply_evicted`` (it was a 404, as if it had never been), its
    stream says its events are lost, its input is listed, and it can be deleted; on its own
    replica its copy still tells it whole. With every key of it gone, nothing is left to
    tell it from a response that never was: a 404 there."""
    with redis_server(tmp_path) as server:
        client = aioredis.Redis.from_url(server.url)
        args = (*ENGINE, "--redis-url", server.url)
        async with (
            replica(*args) as (_, a_url),
            replica(*args) as (_, b_url),
            aiohttp.ClientSession() as http,
        ):

            async def ended_response() -> tuple[str, str]:
                body = {"input": "why stream?", "background": True}
                async with http.post(f"{a_url}/v1/responses", json=body) as made:
                    response_id = (await made.json())["id"]
                reply_id = response_id.removeprefix("resp_")
                await written_through(client, reply_id)
                return response_id, reply_id

            async def error_of(method: str, url: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
                async with http.request(method, url, **kwargs) as answer:
                    return answer.status, (await answer.json())["error"]

            evicted, reply_id = await ended_response()
            await client.delete(f"{PREFIX}{{{reply_id}}}")  # its stream: every event
            status, error = await error_of("GET", f"{b_url}/v1/responses/{evicted}")
            assert status == 410, error
            assert (error["code"], error["param"], error["type"]) == (
                "reply_evicted",
                "response_id",
                "invalid_request_error",
            )
            assert "no longer kept" in error["message"]
            # Ended: a cancel has nothing to stop (no cancel is asked of anyone), and no
            # object to answer with.
            status, error = await error_of("POST", f"{b_url}/v1/responses/{evicted}/cancel")
            assert (status, error["code"]) == (410, "reply_evicted"), error
            assert not await client.exists(f"{PREFIX}{{{reply_id}}}:cancel")
            # Continued, or an output item of it referred to: the field naming it is named.
            follow = {"input": "and?", "previous_response_id": evicted}
            status, error = await error_of("POST", f"{b_url}/v1/responses", json=follow)
            assert (status, error["code"], error["param"]) == (
                410,
                "reply_evicted",
                "previous_response_id",
            )
            referred = {"input": [{"type": "item_reference", "id": f"msg_{reply_id}"}]}
            status, error = await error_of("POST", f"{b_url}/v1/responses", json=referred)
            assert (status, error["code"], error["param"]) == (410, "reply_evicted", "input[0]")
            # Its stream: what is lost is said, in the dialect, not that it never was.
            async with http.get(f"{b_url}/v1/responses/{evicted}?stream=true") as streamed:
                parsed = EventParser().feed(await streamed.read())
                assert streamed.status == 200
            assert [event.type for event in parsed] == ["error"]
            assert json.loads(parsed[0].data)["code"] == "events_lost"
            # Its input is kept with its metadata, whole.
            async with http.get(f"{b_url}/v1/responses/{evicted}/input_items") as listed:
                items = await listed.json()
                assert listed.status == 200, items
            assert items["data"][0]["content"] == [{"type": "input_text", "text": "why stream?"}]
            # On its own replica, its copy tells it whole.
            async with http.get(f"{a_url}/v1/responses/{evicted}") as whole:
                assert (await whole.json())["status"] == "completed"
            async with http.delete(f"{b_url}/v1/responses/{evicted}") as deleted:
                assert deleted.status == 200 and (await deleted.json())["deleted"] is True
            status, error = await error_of("GET", f"{b_url}/v1/responses/{evicted}")
            assert (status, error["code"]) == (404, "reply_not_found"), error

            forgotten, reply_id = await ended_response()
            await client.delete(f"{PREFIX}{{{reply_id}}}", f"{PREFIX}{{{reply_id}}}:meta")
            status, error = await error_of("GET", f"{b_url}/v1/responses/{forgotten}")
            assert (status, error["code"]) == (404, "reply_not_found"), error
            async with http.get(f"{a_url}/v1/responses/{forgotten}") as whole:
                assert (await whole.json())["status"] == "completed"
        await client.aclose()


async def test_a_dead_producers_response_whose_log_redis_evicted_is_failed_not_unknown(
    tmp_path: Path,
):
    """A replica dies while it makes a background response, and Redis then evicts the
    response's stream (an idle reply's keys are the least recently used): its metadata
    still says whose it is, and its stream's readers are told the producer is gone. A GET
    answered 404, as if it had never been; it is the object the response was created as,
    failed (``generator_lost``), as the stream's ``response.failed`` tells it, and so is a
    cancel's answer."""
    slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "2000")
    with redis_server(tmp_path) as server:
        client = aioredis.Redis.from_url(server.url)
        a_proc, a_url = await start_server(*slow, "--redis-url", server.url)
        try:
            async with (
                replica(*slow, "--redis-url", server.url) as (_, b_url),
                aiohttp.ClientSession() as http,
            ):
                made = []
                for _ in range(2):
                    body = {"input": "x", "background": True}
                    async with http.post(f"{a_url}/v1/responses", json=body) as created:
                        made.append((await created.json())["id"])
                await asyncio.sleep(0.5)
                a_proc.send_signal(signal.SIGKILL)
                await a_proc.wait()
                for response_id in made:
                    await client.delete(f"{PREFIX}{{{response_id.removeprefix('resp_')}}}")
                read, cancelled = made
                async with asyncio.timeout(30):
                    # In progress, as far as anyone can tell, until the death is known.
                    shown: dict[str, Any] = {"status": "in_progress"}
                    while shown["status"] == "in_progress":
                        async with http.get(f"{b_url}/v1/responses/{read}") as got:
                            shown = await got.json()
                            assert got.status == 200, shown
                    async with http.post(f"{b_url}/v1/responses/{cancelled}/cancel") as told:
                        answer = await told.json()
                        assert told.status == 200, answer
                    # Continued: what it said is gone, and it will never finish.
                    follow = {"input": "and?", "previous_response_id": read}
                    async with http.post(f"{b_url}/v1/responses", json=follow) as refused:
                        error = (await refused.json())["error"]
                        status = refused.status
        finally:
            await stop(a_proc)
        await client.aclose()
    for response in (shown, answer):
        assert (response["status"], our_code(response["error"])) == ("failed", "generator_lost")
        assert response["output"] == [] and response["background"] is True
    assert (shown["id"], answer["id"]) == (read, cancelled)
    assert (status, error["code"], error["param"]) == (410, "reply_evicted", "previous_response_id")
