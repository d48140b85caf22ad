"""A replica stopped (SIGTERM's drain) while clients read: what each reader gets, and when
the replica is done. The drain's grace covers every stream being sent, not only the replies
being made: a reply that ended may still be on its way to its client, and a reader may be
following a reply another replica makes."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app
from replystream.server.context import MANAGER_KEY
from replystream.server.serve import serving
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, wait_for
from tests.processes import replica, serving_with_stderr
from tests.redis_server import redis_server
from tests.stalling_proxy import small_send_buffer
from tests.test_delivery_server import stalled_post

# Words of 2,000 characters: a reply of megabytes, so a client that stops reading holds
# the server's writes up long after the reply was made.
LONG_WORDS = ("w" * 2000 + " ") * 2000


async def test_a_reply_made_whole_whose_slow_client_still_reads_it_is_sent_whole_in_the_grace():
    engine = fast_engine(reply_text=LONG_WORDS, delay_ms=0.05, jitter_ms=0)
    # Limits far past the reply, so the slow client is not cut for being slow.
    policy = DeliveryPolicy(slow_client_bytes=64 << 20, slow_client_s=60)
    app = create_app(engine, ServerConfig(policy=policy))
    app.on_response_prepare.append(small_send_buffer)
    manager = app[MANAGER_KEY]
    async with serving(app) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        body["max_tokens"] = 2000
        response = await stalled_post(
            f"{server.url}/v1/chat/completions", json.dumps(body).encode()
        )
        # The reply is made (it left the manager) while its reader still has it to send.
        await wait_for(lambda: len(manager) == 0, 20)
        assert manager.readers
        started = time.monotonic()
        stopping = asyncio.create_task(server.shutdown(30))
        await asyncio.sleep(0.5)  # the drain has begun; the client reads again
        events = EventParser().feed(await response.read_body())
        await asyncio.wait_for(stopping, 30)
        took = time.monotonic() - started
    assert events[-1].data == "[DONE]", events[-1]
    text = "".join(
        choice["delta"].get("content", "")
        for event in events[:-1]
        for choice in json.loads(event.data)["choices"]
    )
    assert text == LONG_WORDS
    assert took < 20, took  # done once its last reader was, not at the grace's end


async def test_a_reader_of_another_replicas_reply_reads_on_to_its_end_in_the_grace(
    tmp_path: Path,
) -> None:
    args = ("--engine", "simulated", "--tokens", "60", "--delay-ms", "50", "--jitter-ms", "0")
    with redis_server(tmp_path / "redis") as redis:
        async with (
            replica(*args, "--redis-url", redis.url, "--shutdown-grace-s", "30") as (a, a_url),
            replica(*args, "--redis-url", redis.url) as (_, b_url),
            aiohttp.ClientSession() as http,
        ):
            asked = {"prompt": "hi", "resumable": True}
            async with http.post(f"{b_url}/v1/replies", json=asked) as made:
                reply_id = made.headers["X-Reply-Id"]
                # Followed on A from the start while B makes it (about 3 s).
                async with http.get(f"{a_url}/v1/replies/{reply_id}/stream") as followed:
                    await followed.content.readuntil(b"event: token")
                    started = time.monotonic()
                    a.send_signal(signal.SIGTERM)
                    events = EventParser().feed(await followed.read())
                await made.read()
            assert await asyncio.wait_for(a.wait(), 30) == 0
            took = time.monotonic() - started
    assert events[-1].type == "done", events[-1]
    assert took < 15, took  # the reply's end, not the grace's


async def test_a_second_sigterm_during_the_grace_ends_it_and_tells_the_replies_in_band():
    args = ("--engine", "simulated", "--tokens", "400", "--delay-ms", "50", "--jitter-ms", "0")
    async with (
        replica(*args, "--shutdown-grace-s", "60") as (process, url),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/v1/replies", json={"prompt": "hi"}) as response:
            await response.content.readuntil(b"event: token")
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)  # draining: the reply (20 s) would outlast its wait
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            events = EventParser().feed(await response.read())
        assert await asyncio.wait_for(process.wait(), 30) == 0
        took = time.monotonic() - started
    assert events[-1].type == "error", events[-1]
    assert json.loads(events[-1].data)["error"]["code"] == "shutdown"
    assert took < 10, took  # not the 60 s grace


async def test_a_websocket_whose_client_leaves_as_the_server_stops_does_not_break_the_stop(
    tmp_path: Path,
):
    # The client's socket closes, and SIGTERM comes while the session is winding down (its
    # reply's reader ends with a call to Redis): the shutdown asked that session to say
    # goodbye on a task group already ending, which raised out of the shutdown, and the
    # server died with a traceback (exit status 1), its other replies told nothing.
    with redis_server(tmp_path) as redis:
        args = ("--engine", "simulated", "--delay-ms", "5", "--tokens", "50")
        async with serving_with_stderr(*args, "--redis-url", redis.url) as (process, url, _):
            http = aiohttp.ClientSession()
            try:
                socket = await http.ws_connect(f"{url}/v1/ws")
                await socket.send_json({"type": "reply", "id": "q", "prompt": "x"})
                async with asyncio.timeout(10):
                    while (await socket.receive_json())["type"] not in ("done", "error"):
                        pass
            finally:
                await http.close()  # the client leaves without a close handshake
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                status = await process.wait()
            assert process.stderr is not None
            said = (await process.stderr.read()).decode()
    assert status == 0, said
    assert "Traceback" not in said
