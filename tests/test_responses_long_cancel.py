"""A background response longer than its log holds (its newest 10,000 events) is cancelled,
and refused as a previous response, while it runs, as a short one is, over a real server."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from replystream.delivery.replay import MAX_LOG_ENTRIES
from tests.processes import replica

TOKENS = MAX_LOG_ENTRIES + 20_000  # 0.3 ms each: some 9 s in all


async def test_a_background_response_past_its_logs_length_is_cancelled() -> None:
    args = ("--engine", "simulated", "--tokens", str(TOKENS), "--delay-ms", "0.3")
    async with replica(*args) as (_, url), aiohttp.ClientSession() as http:
        body = {"input": "a long one", "background": True, "max_output_tokens": TOKENS}
        async with http.post(f"{url}/v1/responses", json=body) as made:
            response_id = (await made.json())["id"]
        # Until the log no longer holds the response's first events (one event a token):
        # its object, told from them while it runs, is then a 410.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with http.get(f"{url}/v1/responses/{response_id}") as state:
                if state.status == 410:
                    break
                assert (await state.json())["status"] in ("queued", "in_progress")
            await asyncio.sleep(0.2)
        # Continued while it runs, it is a response that has not finished, as a short one.
        follow = {"input": "and then?", "previous_response_id": response_id}
        for route, body in (("", {**follow, "max_output_tokens": 2}), ("/input_tokens", follow)):
            async with http.post(f"{url}/v1/responses{route}", json=body) as refused:
                error = (await refused.json())["error"]
                assert refused.status == 400, error
            assert (error["code"], error["param"]) == ("invalid_value", "previous_response_id")
            assert error["message"] == f"response {response_id} has not finished yet"
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
