"""A relay in front of another replystream server, asked for stop strings on a route that
sends them upstream (chat, legacy completions, Responses): a reply that ends at its token
limit while its last characters could still begin a stop string comes whole. The upstream
withheld those characters, and sends them after its last token, in a chunk of their own,
before its finish: they are the reply's, not content past the limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.conftest import fast_engine, wait_for
from tests.sse_client import post_events
from tests.test_upstream_faults import CHAT as FAULTS_CHAT
from tests.test_upstream_faults import fake_upstream

# The simulated engine makes a word per token: two tokens are "one two ", whose last three
# characters could begin the stop string.
STOP = "wo ZZZ"
CHAT: Any = {"max_tokens": 2, "stop": [STOP], "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def relay_in_front_of_replystream() -> AsyncIterator[str]:
    async with AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(
            running(create_app(fast_engine(reply_text="one two three four")))
        )
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/v1"),), health_s=600))
        stack.push_async_callback(engine.aclose)
        yield await stack.enter_async_context(running(create_app(engine)))


async def _whole(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as answer:
        assert answer.status == 200, await answer.text()
        reply: dict[str, Any] = await answer.json()
        return reply


@pytest.mark.parametrize("logprobs", [False, True])
async def test_chat_keeps_the_withheld_tail_of_a_reply_at_its_limit(logprobs: bool) -> None:
    ask = {**CHAT, "logprobs": logprobs}
    async with relay_in_front_of_replystream() as url:
        whole = await _whole(url, "/v1/chat/completions", ask)
        streamed = await post_events(
            f"{url}/v1/chat/completions",
            {**ask, "stream": True, "stream_options": {"include_usage": True}},
        )
    [choice] = whole["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("one two ", "length")
    assert streamed.chat_text == "one two "
    if logprobs:  # each chunk lists its own tokens: the tail's lists none
        assert whole["usage"]["completion_tokens"] == 2
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert tokens == ["one ", "two "]


async def test_completions_and_responses_keep_it_too() -> None:
    async with relay_in_front_of_replystream() as url:
        legacy = await _whole(
            url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": STOP}
        )
        response = await _whole(
            url,
            "/v1/responses",
            {"input": "hi", "max_output_tokens": 2, "replystream": {"stop": [STOP]}},
        )
    assert legacy["choices"][0]["text"] == "one two "
    assert response["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "one two "


@pytest.mark.parametrize(("stop", "text"), [("ZZZ", "w0 w1 w2 "), ("w3 w4 x", "w0 w1 w2 w3 w4 ")])
async def test_an_upstream_writing_on_past_the_limit_is_still_cut(stop: str, text: str) -> None:
    # It ignores max_tokens: past the limit, only what may be the start of a stop string it
    # was sent passes (at most one character fewer than that string), then it is cut.
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/forever/v1"),)))
        async with running(create_app(engine)) as relay:
            got = await post_events(
                f"{relay}/v1/chat/completions", {**FAULTS_CHAT, "max_tokens": 3, "stop": [stop]}
            )
            await wait_for(fake.disconnected.is_set)
        await engine.aclose()
    assert got.chat_text == text and not got.of_type("error")
