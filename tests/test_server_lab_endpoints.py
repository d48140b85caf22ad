"""The lab endpoints over a real loopback socket: bytes, headers, cancellation, errors."""

import asyncio
import json

import aiohttp

from replystream.client import measure_reply
from replystream.engine.simulated import ARTICLE_REPLY, SimulatedEngine
from tests.conftest import fast_engine, serve_engine, wait_for
from tests.rawhttp import raw_request


async def test_article_reply_is_93_bytes_buffered_and_276_streamed():
    engine = fast_engine(reply_text=ARTICLE_REPLY)
    async with serve_engine(engine) as url:
        wait = await raw_request(f"{url}/wait")
        wait_body = await wait.read_body()
        # ids=0: the article's exact framing, without event ids or the opening reply event.
        stream = await raw_request(f"{url}/stream?ids=0")
        stream_body = await stream.read_body()
    assert wait.status == stream.status == 200
    assert len(wait_body) == 93
    assert json.loads(wait_body) == {"text": ARTICLE_REPLY + " "}
    assert len(stream_body) == 276
    assert stream_body.startswith(b'data: "A "\n\ndata: "model "\n\n')
    assert stream_body.endswith(b'data: "time. "\n\ndata: [DONE]\n\n')
    assert wait.headers["content-type"].startswith("application/json")


async def test_lab_stream_numbers_every_event_and_names_its_reply():
    engine = fast_engine(reply_text=ARTICLE_REPLY)
    async with serve_engine(engine) as url:
        stream = await raw_request(f"{url}/stream")
        body = await stream.read_body()
    reply_id = stream.headers["x-reply-id"]
    assert body.startswith(b'event: reply\nid: 1\ndata: {"reply_id": "%s"}\n\n' % reply_id.encode())
    assert b'id: 2\ndata: "A "\n\n' in body
    assert body.endswith(b"id: 20\ndata: [DONE]\n\n")


async def test_stream_headers_arrive_before_the_first_token_exists():
    engine = fast_engine(first_token_ms=1000)
    async with serve_engine(engine) as url:
        response = await raw_request(f"{url}/stream")
        # The status line and headers are here while the engine has not made a token yet.
        assert engine.stats().steps == 0
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        assert "content-encoding" not in response.headers
        await response.aclose()


async def _assert_generation_stops(engine: SimulatedEngine, tokens_before_leaving: int) -> None:
    # Stopped within about one token's time: nothing more is made after the disconnect.
    await wait_for(lambda: engine.stats().active == 0)
    stats = engine.stats()
    assert stats.active == 0
    assert stats.cancelled == 1
    assert stats.finished == 0
    steps = stats.steps
    await asyncio.sleep(0.2)
    assert engine.stats().steps == steps
    assert tokens_before_leaving <= steps < 60


async def test_client_leaving_a_stream_cancels_generation():
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    async with serve_engine(engine) as url:
        response = await raw_request(f"{url}/stream")
        for _ in range(3):  # the reply event and two tokens
            await response.reader.readuntil(b"\n\n")
        await response.aclose()
        await _assert_generation_stops(engine, 2)


async def test_client_leaving_a_buffered_request_cancels_generation():
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    async with serve_engine(engine) as url:
        response_task = asyncio.create_task(raw_request(f"{url}/wait"))
        await wait_for(lambda: engine.stats().steps >= 3)
        # Cancelling the reading task drops the connection mid-request.
        response_task.cancel()
        try:
            await response_task
        except asyncio.CancelledError:
            pass
        await _assert_generation_stops(engine, 3)


async def test_mid_stream_error_is_an_error_event_and_the_reply_is_incomplete():
    engine = fast_engine(fail_after=5)
    async with serve_engine(engine) as url:
        timing = await measure_reply(f"{url}/stream")
        raw = await raw_request(f"{url}/stream")
        body = await raw.read_body()
    assert timing.status == 200
    assert not timing.complete
    assert timing.error is not None and "error" in timing.error
    assert timing.tokens == 5
    assert b"event: error\nid: 7\ndata: " in body
    assert b"[DONE]" not in body


async def test_error_before_the_first_byte_is_a_500_with_a_json_body():
    engine = fast_engine(fail_after=0)
    async with serve_engine(engine) as url:
        for path in ("/wait", "/stream"):
            response = await raw_request(f"{url}{path}")
            body = json.loads(await response.read_body())
            assert response.status == 500
            assert response.headers["content-type"].startswith("application/json")
            assert body["error"]["code"] == "generation_failed"
        timing = await measure_reply(f"{url}/wait")
    assert not timing.complete and timing.error is not None and "500" in timing.error


async def test_buffered_failure_after_tokens_is_a_500_not_a_partial_reply():
    engine = fast_engine(fail_after=3)
    async with serve_engine(engine) as url:
        timing = await measure_reply(f"{url}/wait")
    assert timing.status == 500
    assert not timing.complete and timing.text == ""


async def test_bad_query_is_a_400_naming_the_field_and_unknown_paths_are_json_404s():
    async with serve_engine(fast_engine()) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/stream?seed=abc") as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "seed"
        async with http.get(f"{url}/wait?max_tokens=0") as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "max_tokens"
        async with http.get(f"{url}/nope") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "not_found"


async def test_sampling_the_lab_does_not_take_is_a_400_not_ignored():
    """A temperature (or any sampling field but seed and max_tokens) would be ignored: the
    reply sampled otherwise than asked. Other unknown parameters (a cache-buster) still are."""
    async with serve_engine(fast_engine()) as url, aiohttp.ClientSession() as http:
        for path in ("/wait?temperature=0", "/stream?max_tokens=2&top_p=0.5"):
            async with http.get(f"{url}{path}") as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert error["param"] == path.rsplit("&", 1)[-1].split("?")[-1].split("=")[0]
        async with http.get(f"{url}/wait?max_tokens=2&_=123") as response:
            assert response.status == 200


async def test_same_seed_same_text_in_both_modes_and_max_tokens():
    async with serve_engine(fast_engine()) as url:
        wait = await measure_reply(f"{url}/wait?seed=3&max_tokens=7")
        stream = await measure_reply(f"{url}/stream?seed=3&max_tokens=7")
    assert wait.complete and stream.complete
    assert wait.text == stream.text
    assert len(stream.text.split()) == 7
