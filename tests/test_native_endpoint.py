"""POST /v1/replies over a real loopback socket: events, bodies and validation."""

import io
import json
import re

import aiohttp
import pytest

from replystream.client import measure_reply
from replystream.delivery.policy import DeliveryPolicy
from replystream.server.app import create_app
from replystream.server.context import LOCAL_STORE_KEY, MANAGER_KEY
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, serve_engine, wait_for
from tests.rawhttp import raw_request
from tests.scripted_engine import GroupedPushEngine
from tests.sse_client import post_events


async def test_stream_has_named_token_usage_and_done_events():
    async with serve_engine(fast_engine(reply_text="one two three four")) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "say it", "seed": 1})
    assert got.status == 200
    assert got.headers["content-type"] == "text/event-stream"
    assert got.types == ["reply"] + ["token"] * 4 + ["usage", "done"]
    # Every event is numbered, the first names the reply, and the header does too.
    assert [e.id for e in got.events] == [str(n) for n in range(1, 8)]
    assert got.of_type("reply") == [{"reply_id": got.headers["x-reply-id"]}]
    assert len(got.headers["x-reply-id"]) >= 22  # at least 128 random bits, base64url
    assert got.text == "one two three four "
    assert got.of_type("token")[0] == {"text": "one ", "tokens": 1}
    assert got.of_type("usage") == [{"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}]
    assert got.of_type("done") == [{"finish_reason": "stop"}]


async def test_buffered_body_has_the_same_text_and_usage():
    async with serve_engine(fast_engine()) as url:
        streamed = await post_events(
            f"{url}/v1/replies", {"prompt": "x", "seed": 5, "max_tokens": 9}
        )
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "x", "seed": 5, "max_tokens": 9, "stream": False}
            async with http.post(f"{url}/v1/replies", json=body) as response:
                assert response.status == 200
                buffered = await response.json()
    assert buffered["text"] == streamed.text
    assert buffered["finish_reason"] == "length"
    assert buffered["usage"]["completion_tokens"] == 9


async def test_measuring_client_reads_the_native_stream_as_complete():
    async with serve_engine(fast_engine()) as url:
        timing = await measure_reply(f"{url}/v1/replies", method="POST", json_body={"prompt": "hi"})
    assert timing.complete and timing.tokens == 120


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": []}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "a", "temperature": 3}, "temperature"),
        ({"prompt": "a", "top_p": -0.1}, "top_p"),
        ({"prompt": "a", "stop": ["", "x"]}, "stop"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "batch_tokens": 0}, "batch_tokens"),
        ({"prompt": "a", "batch_ms": -5}, "batch_ms"),
        ({"prompt": "a", "holdback_tokens": -1}, "holdback_tokens"),
        ({"prompt": "a", "keepalive_s": 0}, "keepalive_s"),
        ({"prompt": "a", "tokens_per_event": 2}, "tokens_per_event"),
    ],
)
async def test_invalid_bodies_get_a_400_naming_the_field(body: dict[str, object], param: str):
    async with serve_engine(fast_engine()) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/replies", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]


async def test_malformed_json_oversized_body_and_wrong_method_are_client_errors():
    async with serve_engine(fast_engine()) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/replies", data=b"{not json") as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "invalid_json"
        async with http.post(f"{url}/v1/replies", data=b"[1, 2]") as response:
            assert response.status == 400
        huge = json.dumps({"prompt": "x" * (2 << 20)})
        async with http.post(f"{url}/v1/replies", data=io.BytesIO(huge.encode())) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "body_too_large"
        async with http.get(f"{url}/v1/replies") as response:
            assert response.status == 405
            assert "error" in await response.json()


async def test_generator_errors_before_and_after_the_first_byte():
    async with serve_engine(fast_engine(fail_after=0)) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "x"})
    assert got.status == 500
    assert json.loads(got.raw)["error"]["code"] == "generation_failed"
    async with serve_engine(fast_engine(fail_after=4)) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "x"})
        timing = await measure_reply(f"{url}/v1/replies", method="POST", json_body={"prompt": "x"})
    assert got.status == 200
    assert got.types == ["reply"] + ["token"] * 4 + ["error"]
    assert got.of_type("error")[0]["error"]["code"] == "generation_failed"
    assert not timing.complete and timing.error and "error" in timing.error


async def test_a_reader_past_its_limit_stops_a_late_burst_of_tokens_part_way():
    # One push of 200 tokens of 128 KB (25 MB) to a client that never reads. The kernel's
    # buffers take a few MB; past that, the slow-client limit must stop the reply within a
    # piece of the push, not after all of it has been logged.
    engine = GroupedPushEngine(["y" * (128 << 10)] * 200, group=200)
    config = ServerConfig(policy=DeliveryPolicy(slow_client_bytes=256 << 10, slow_client_s=5.0))
    app = create_app(engine, config)
    async with running(app) as url:
        response = await raw_request(f"{url}/v1/replies", "POST", b'{"prompt": "x"}')
        await wait_for(lambda: not app[MANAGER_KEY].replies, timeout_s=20)
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
        await response.aclose()
    assert b'outcome="slow_client"} 1.0' in metrics
    taken = re.search(
        rb'replystream_tokens_generated_total\{endpoint="/v1/replies"\} (\S+)', metrics
    )
    assert taken is not None and float(taken.group(1)) < 150  # all 200 without the pieces


async def test_a_live_stream_drops_sent_events_even_when_they_leave_several_at_a_time():
    # Pushes of 10 events put the last sent id at 11, 21, ..., 121: whatever a push carries,
    # what it wrote is dropped, so the log never holds more than the push in hand.
    engine = GroupedPushEngine([f"w{i} " for i in range(120)], group=10)
    app = create_app(engine)
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/replies", json={"prompt": "x"}) as response:
            tokens = 0
            kept: list[int] = []
            async for line in response.content:
                tokens += line == b"event: token\n"
                kept.append(app[LOCAL_STORE_KEY].stats().entries)
            assert tokens == 120
    assert max(kept) <= 10
