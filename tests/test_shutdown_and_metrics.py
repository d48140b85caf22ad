"""SIGTERM with streams open, and /metrics counting exactly what happened."""

import asyncio
import json
import re
import signal
from typing import Any

import aiohttp
import pytest

from replystream.client import measure_reply
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, wait_for
from tests.processes import replica
from tests.rawhttp import raw_request


async def test_sigterm_with_50_open_streams_ends_each_with_a_reply_or_an_error_event():
    # Replies take about 3 s; the grace period is 1 s, so some finish and most are told.
    async with replica(
        "--engine",
        "simulated",
        "--tokens",
        "100",
        "--delay-ms",
        "30",
        "--jitter-ms",
        "0",
        "--shutdown-grace-s",
        "1",
    ) as (process, url):
        tasks = [
            asyncio.create_task(measure_reply(f"{url}/stream?max_tokens={20 + 2 * i}"))
            for i in range(50)
        ]
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        timings = await asyncio.gather(*tasks)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finished = [t for t in timings if t.complete]
    told = [t for t in timings if not t.complete and t.error and "shutdown" in t.error]
    assert len(finished) + len(told) == 50, [t.error for t in timings if not t.complete]
    assert finished and told  # short replies made it within the grace period, long ones not


@pytest.mark.parametrize("mode", [("--loop", "uvloop"), ("--loop", "asyncio"), ("--workers", "2")])
async def test_from_sigterm_on_a_new_connection_is_refused_while_replies_drain(
    mode: tuple[str, str],
) -> None:
    # A reply of about 12 s, a grace of 5 s: the server is still draining when we connect.
    async with replica(
        "--engine",
        "simulated",
        "--tokens",
        "400",
        "--delay-ms",
        "30",
        "--shutdown-grace-s",
        "5",
        *mode,
    ) as (process, url):
        port = int(url.rsplit(":", 1)[1])
        reply = asyncio.create_task(measure_reply(f"{url}/stream"))
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        # Not queued by the kernel until the process exits: refused, as a load balancer
        # needs to see the replica gone.
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        except ConnectionRefusedError:
            pass
        else:
            writer.close()
            pytest.fail("a new connection was taken while the server drained")
        timing = await reply
        assert timing.error and "shutdown" in timing.error
        assert await asyncio.wait_for(process.wait(), 15) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_sighup_with_nothing_to_read_again_drains_as_sigterm_does(workers: str) -> None:
    # A closed terminal, or a reload asked of a server with no file to read again: the open
    # reply is told it was cut (it outlives the 1 s grace), and the server exits cleanly.
    async with replica(
        "--engine",
        "simulated",
        "--tokens",
        "400",
        "--delay-ms",
        "30",
        "--shutdown-grace-s",
        "1",
        "--workers",
        workers,
    ) as (process, url):
        reply = asyncio.create_task(measure_reply(f"{url}/stream"))
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGHUP)
        timing = await reply
        assert timing.error and "shutdown" in timing.error, timing.error
        assert await asyncio.wait_for(process.wait(), 15) == 0


async def test_from_sigterm_on_healthz_on_a_kept_alive_connection_says_unavailable():
    async with replica(
        "--engine", "simulated", "--tokens", "400", "--delay-ms", "30", "--shutdown-grace-s", "5"
    ) as (process, url):
        reply = asyncio.create_task(measure_reply(f"{url}/stream"))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            async with session.get(f"{url}/healthz") as response:
                assert response.status == 200
                await response.read()
            await asyncio.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with session.get(f"{url}/healthz") as response:  # the same connection
                assert response.status == 503
                assert (await response.json())["reason"] == "shutting down"
        await reply
        assert await asyncio.wait_for(process.wait(), 15) == 0


async def test_a_buffered_request_at_shutdown_gets_a_503():
    async with replica(
        "--engine", "simulated", "--delay-ms", "30", "--shutdown-grace-s", "0.3"
    ) as (process, url):
        task = asyncio.create_task(measure_reply(f"{url}/wait"))
        await asyncio.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        timing = await task
        await asyncio.wait_for(process.wait(), 15)
    assert timing.status == 503 and not timing.complete


async def test_a_response_collected_whole_at_shutdown_is_its_failed_object_with_its_text():
    """As OpenAI answers a response that failed: 200 with the object, ``failed`` with its
    error, and the text made before the server went down; stored or not (the other routes'
    whole replies are a 503)."""
    async with replica(
        "--engine", "simulated", "--delay-ms", "30", "--jitter-ms", "0", "--shutdown-grace-s", "0.3"
    ) as (process, url):  # fmt: skip
        async with aiohttp.ClientSession() as http:

            async def whole(store: bool) -> tuple[int, dict[str, Any]]:
                asked = {"model": "simulated", "input": "hi", "store": store}
                async with http.post(f"{url}/v1/responses", json=asked) as answer:
                    return answer.status, await answer.json()

            both = asyncio.gather(whole(True), whole(False))
            await asyncio.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            answers = await both
        await asyncio.wait_for(process.wait(), 15)
    for status, response in answers:
        assert status == 200, response
        assert response["status"] == "failed", response
        assert response["error"] == {
            "code": "server_error",
            "message": "the server is shutting down (shutdown)",
        }
        [message] = response["output"]
        assert message["status"] == "incomplete"
        assert message["content"][0]["text"].startswith("A language model ")


async def test_an_anthropic_stream_cut_by_shutdown_ends_overloaded_as_anthropics_would():
    """Mid-stream, the server going down was Anthropic's api_error; before the stream it is
    its 529 overloaded_error, and the SDK reads either by the error's type."""
    async with replica(
        "--engine", "simulated", "--delay-ms", "30", "--jitter-ms", "0", "--shutdown-grace-s", "0.3"
    ) as (process, url):  # fmt: skip
        body = {"model": "simulated", "max_tokens": 100, "stream": True}
        body["messages"] = [{"role": "user", "content": "hi"}]
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/messages", json=body) as response:
                await response.content.readuntil(b"content_block_delta")
                process.send_signal(signal.SIGTERM)
                events = EventParser().feed(await response.read())
        await asyncio.wait_for(process.wait(), 15)
    error = json.loads(events[-1].data)
    assert events[-1].type == "error", [e.type for e in events[-3:]]
    assert (error["error"]["type"], error["error"]["code"]) == ("overloaded_error", "shutdown")


def replies_count(metrics: bytes, endpoint: str, outcome: str) -> float:
    found = re.search(
        rb'replystream_replies_total\{endpoint="%s",outcome="%s"\} ([0-9.e+]+)'
        % (endpoint.encode(), outcome.encode()),
        metrics,
    )
    return float(found.group(1)) if found else 0.0


async def test_metrics_count_what_happened():
    engine = fast_engine(reply_text="alpha beta gamma delta forbidden epsilon", delay_ms=5)
    policy = DeliveryPolicy(checks=(BannedPhrases(["forbidden"]),))
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        for _ in range(3):
            assert (await measure_reply(f"{url}/stream?max_tokens=3")).complete
        assert (await measure_reply(f"{url}/wait?max_tokens=2")).complete
        moderated = await measure_reply(
            f"{url}/v1/replies", method="POST", json_body={"prompt": "x"}
        )
        assert not moderated.complete
        response = await raw_request(f"{url}/stream")
        await response.reader.readuntil(b"\n\n")  # the reply event
        await response.reader.readuntil(b"\n\n")  # the first token
        await response.aclose()
        await wait_for(lambda: engine.stats().active == 0)
        bad = await raw_request(f"{url}/stream?seed=x")
        await bad.read_body()
        # The reply whose client left is counted when its handler has ended, which may be
        # after its engine's sequence was freed: a few scrapes, then the count is read.
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            metrics = await (await raw_request(f"{url}/metrics")).read_body()
            if replies_count(metrics, "/stream", "cancelled") or (
                asyncio.get_running_loop().time() > deadline
            ):
                break
            await asyncio.sleep(0.05)
    assert replies_count(metrics, "/stream", "finished") == 3
    assert replies_count(metrics, "/wait", "finished") == 1
    assert replies_count(metrics, "/v1/replies", "moderated") == 1
    assert replies_count(metrics, "/stream", "cancelled") == 1
    assert b"replystream_active_streams 0.0" in metrics
    # Tokens made: 3 x 3 + 2 + 5 (the fifth completes the phrase) + at least 1 before leaving.
    tokens = re.search(
        rb"replystream_tokens_generated_total\{endpoint=\"/stream\"\} (\d+)", metrics
    )
    assert tokens and int(float(tokens.group(1))) >= 10
    ttft = re.search(
        rb'replystream_time_to_first_token_seconds_count\{endpoint="/stream"\} (\S+)', metrics
    )
    assert ttft and float(ttft.group(1)) == 4


def sent_count(metrics: bytes, series: str, endpoint: str) -> float:
    found = re.search(
        rb'replystream_%s_total\{endpoint="%s"\} ([0-9.e+]+)'
        % (series.encode(), endpoint.encode()),
        metrics,
    )
    return float(found.group(1)) if found else 0.0


async def test_a_whole_reply_that_failed_counts_its_error_body_as_sent():
    """A reply collected whole that failed is answered with an error body: written to its
    client as a finished reply's body is, and counted the same way (one event, its bytes)."""
    async with running(create_app(fast_engine(fail_after=2))) as url:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        failed = await raw_request(
            f"{url}/v1/chat/completions", "POST", body, {"Content-Type": "application/json"}
        )
        answer = await failed.read_body()
        assert failed.status == 500 and b"simulated failure" in answer
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert replies_count(metrics, "/v1/chat/completions", "errored") == 1
    assert sent_count(metrics, "events_sent", "/v1/chat/completions") == 1
    assert sent_count(metrics, "bytes_sent", "/v1/chat/completions") == len(answer)


async def test_a_whole_anthropic_message_that_failed_counts_the_body_its_client_read():
    """The Messages route answers a failure in Anthropic's error shape (its own fields, the
    request's id): the body counted as sent is that one, byte for byte, not the body it was
    made from."""
    async with running(create_app(fast_engine(fail_after=2))) as url:
        ask = {
            "model": "simulated",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}],
        }
        failed = await raw_request(
            f"{url}/v1/messages",
            "POST",
            json.dumps(ask).encode(),
            {"Content-Type": "application/json"},
        )
        answer = await failed.read_body()
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert failed.status == 500 and json.loads(answer)["type"] == "error"
    assert replies_count(metrics, "/v1/messages", "errored") == 1
    assert sent_count(metrics, "events_sent", "/v1/messages") == 1
    assert sent_count(metrics, "bytes_sent", "/v1/messages") == len(answer)


async def test_an_engine_that_fails_before_its_first_token_is_counted_errored_not_rejected():
    """A request the engine failed to start (a 500 to its client) is an error, as a failure
    after the first token is: an alert on ``errored`` must see every request failing at
    once. A refusal (a 4xx, or a 503: no room now) stays ``rejected``."""
    async with running(create_app(fast_engine(fail_after=0))) as url:
        for path in ("/stream", "/v1/replies"):
            method, body = ("GET", b"") if path == "/stream" else ("POST", b'{"prompt": "x"}')
            failed = await raw_request(f"{url}{path}", method, body)
            await failed.read_body()
            assert failed.status == 500
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    for path in ("/stream", "/v1/replies"):
        assert replies_count(metrics, path, "errored") == 1
        assert replies_count(metrics, path, "rejected") == 0
