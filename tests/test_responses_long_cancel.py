"""A background response longer than its log holds (its newest 10,000 events) is polled to its
end, cancelled, refused as a previous response, and its input taken by reference, while it
runs, as a short one is, over a real server."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai

from replystream.delivery.replay import MAX_LOG_ENTRIES
from tests.processes import replica

TOKENS = MAX_LOG_ENTRIES + 20_000  # 0.3 ms each: some 9 s in all


async def past_its_logs_length(http: aiohttp.ClientSession, url: str, response_id: str) -> None:
    """Poll the response until its log no longer holds its first events (one event a token):
    its object, which no longer has its text so far, is then still in progress, output-less."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with http.get(f"{url}/v1/responses/{response_id}") as state:
            shown = await state.json()
            assert state.status == 200, shown
        assert shown["status"] in ("queued", "in_progress"), shown["status"]
        if shown["status"] == "in_progress" and not shown["output"]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the response never went past its log's length")


async def test_a_background_response_past_its_logs_length_is_polled_to_its_end() -> None:
    """OpenAI's way to wait for a background response: retrieve it until it is neither queued
    nor in progress. Past its log's length its object was a 410 (``reply_evicted``) until it
    ended, and the SDK's loop raised on a response that was doing fine."""
    tokens = MAX_LOG_ENTRIES + 5_000
    args = ("--engine", "simulated", "--tokens", str(tokens), "--delay-ms", "0.3")
    async with (
        replica(*args) as (_, url),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        response = await client.responses.create(
            model="simulated", input="a long one", background=True, max_output_tokens=tokens
        )
        polls, output_less = 0, 0
        async with asyncio.timeout(120):
            while response.status in ("queued", "in_progress"):
                await asyncio.sleep(0.05)
                response = await client.responses.retrieve(response.id)
                polls += 1
                output_less += response.status == "in_progress" and not response.output
    assert response.status == "completed", response
    assert len(response.output_text.split()) == tokens  # its terminal object is whole
    assert output_less > 0, f"no poll of {polls} came past the log's length"


async def test_a_background_response_past_its_logs_length_is_cancelled() -> None:
    args = ("--engine", "simulated", "--tokens", str(TOKENS), "--delay-ms", "0.3")
    async with replica(*args) as (_, url), aiohttp.ClientSession() as http:
        body = {"input": "a long one", "background": True, "max_output_tokens": TOKENS}
        async with http.post(f"{url}/v1/responses", json=body) as made:
            response_id = (await made.json())["id"]
        await past_its_logs_length(http, url, response_id)
        # Continued while it runs, it is a response that has not finished, as a short one.
        follow = {"input": "and then?", "previous_response_id": response_id}
        for route, body in (("", {**follow, "max_output_tokens": 2}), ("/input_tokens", follow)):
            async with http.post(f"{url}/v1/responses{route}", json=body) as refused:
                error = (await refused.json())["error"]
                assert refused.status == 400, error
            assert (error["code"], error["param"]) == ("invalid_value", "previous_response_id")
            assert error["message"] == f"response {response_id} has not finished yet"
        # Its input, which its conversation keeps whole, is taken by reference (it was a 410:
        # its output, read first, can no longer be told).
        async with http.get(f"{url}/v1/responses/{response_id}/input_items") as listed:
            [asked] = (await listed.json())["data"]
        referred = [{"type": "item_reference", "id": asked["id"]}]
        body = {"input": referred, "max_output_tokens": 1}
        async with http.post(f"{url}/v1/responses", json=body) as taken:
            assert taken.status == 200, await taken.text()
        async with http.post(f"{url}/v1/responses/{response_id}/cancel") as cancel:
            answer = await cancel.json()
            assert cancel.status == 200, answer
        assert (answer["status"], answer["error"], answer["background"]) == (
            "cancelled",
            None,
            True,
        )
        async with http.get(f"{url}/v1/responses/{response_id}") as read:
            assert (await read.json())["status"] == "cancelled"
