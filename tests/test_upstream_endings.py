"""How an upstream's finish reason ends the relayed reply in every dialect, over a real
aiohttp upstream and replystream's ``UpstreamEngine`` on loopback sockets: a reply the
upstream aborted (vLLM's and SGLang's ``abort``) or ended with a reason the relay does not
know is never reported as complete; its own filter (``content_filter``) makes a Responses
response ``incomplete``, as OpenAI's does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import anthropic
import pytest

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import RecordingUpstream
from tests.conftest import our_code
from tests.sse_client import post_events

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CLAUDE: Any = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}


@asynccontextmanager
async def relay_ending(finish_reason: str) -> AsyncIterator[tuple[str, str]]:
    """A relay in front of an upstream that streams "partial " and then ``finish_reason``;
    yields the relay's URL and the upstream's base URL."""
    upstream = RecordingUpstream("partial ", finish_reason)
    async with running(upstream.app()) as upstream_url:
        # Each failed reply counts on the upstream's circuit: kept closed for every dialect.
        config = UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), failures=100)
        engine = UpstreamEngine(config)
        try:
            async with running(create_app(engine)) as url:
                yield url, f"{upstream_url}/v1"
        finally:
            await engine.aclose()


async def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json()


def ours(message: str) -> str:
    """A failed response's message without the code of ours it ends with."""
    return message[: message.rindex(" (")]


async def errors_in_every_dialect(url: str) -> list[tuple[str, str, str]]:
    """Each dialect's report of the reply, streamed and whole: (where, code, message) of
    the error it ended with; the text before it was relayed wherever a dialect shows it."""
    ends: list[tuple[str, str, str]] = []

    native = await post_events(f"{url}/v1/replies", {"prompt": "hi"})
    assert native.text == "partial " and not native.of_type("done"), native.raw
    [error] = [e["error"] for e in native.of_type("error")]
    ends.append(("native", error["code"], error["message"]))
    status, whole = await post_json(f"{url}/v1/replies", {"prompt": "hi", "stream": False})
    assert status == 502, whole
    ends.append(("native whole", whole["error"]["code"], whole["error"]["message"]))

    chat = await post_events(f"{url}/v1/chat/completions", {**CHAT, "stream": True})
    assert chat.chat_text == "partial " and b"[DONE]" not in chat.raw, chat.raw
    finishes = [
        c["finish_reason"]
        for e in chat.events
        if e.type == "message"
        for c in json.loads(e.data)["choices"]
    ]
    assert set(finishes) == {None}, chat.raw  # no chunk says the reply finished
    [error] = [e["error"] for e in chat.of_type("error")]
    ends.append(("chat", error["code"], error["message"]))
    status, whole = await post_json(f"{url}/v1/chat/completions", CHAT)
    assert status == 502, whole
    ends.append(("chat whole", whole["error"]["code"], whole["error"]["message"]))

    responses = await post_events(f"{url}/v1/responses", {**RESPONSES, "stream": True})
    assert responses.types[-1] == "response.failed", responses.types
    assert "response.completed" not in responses.types
    failed = responses.of_type("response.failed")[-1]["response"]
    assert failed["status"] == "failed"
    ends.append(("responses", our_code(failed["error"]), ours(failed["error"]["message"])))
    status, whole = await post_json(f"{url}/v1/responses", RESPONSES)
    assert status == 200 and whole["status"] == "failed", whole
    ends.append(("responses whole", our_code(whole["error"]), ours(whole["error"]["message"])))

    claude = await post_events(f"{url}/v1/messages", {**CLAUDE, "stream": True})
    assert "message_stop" not in claude.types and "message_delta" not in claude.types
    [error] = [e["error"] for e in claude.of_type("error")]
    ends.append(("anthropic", error["type"], error["message"]))
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError) as raised:
            await client.messages.create(**CLAUDE)
    assert raised.value.status_code == 502
    body = cast(dict[str, Any], raised.value.body)
    ends.append(("anthropic whole", body["error"]["type"], raised.value.message))
    return ends


@pytest.mark.parametrize(
    ("reason", "code", "said"),
    [
        ("abort", "upstream_aborted", "aborted the reply (finish reason 'abort')"),
        ("error", "upstream_aborted", "aborted the reply (finish reason 'error')"),
        (
            "frobnicated",
            "upstream_unknown_finish",
            "ended the reply with a finish reason the relay does not know ('frobnicated')",
        ),
    ],
)
async def test_a_reply_the_upstream_did_not_finish_ends_as_an_error_in_every_dialect(
    reason: str, code: str, said: str
):
    async with relay_ending(reason) as (url, upstream):
        ends = await errors_in_every_dialect(url)
    for where, got_code, message in ends:
        if where.startswith("anthropic"):
            assert got_code == "api_error", (where, got_code)
        else:
            assert got_code == code, (where, got_code)
        assert f"the upstream at {upstream} {said}" in message, (where, message)


@pytest.mark.parametrize(
    ("reason", "chat", "claude"),
    [
        ("model_length", "length", "max_tokens"),  # Mistral's: the model's context is full
        ("end_turn", "stop", "end_turn"),  # Anthropic's words, passed on by some proxies
        ("eos_token", "stop", "end_turn"),  # TGI's
    ],
)
async def test_another_servers_spelling_of_a_finish_is_a_finish(
    reason: str, chat: str, claude: str
):
    async with relay_ending(reason) as (url, _):
        status, whole = await post_json(f"{url}/v1/chat/completions", CHAT)
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
            message = await client.messages.create(**CLAUDE)
    assert status == 200, whole
    assert whole["choices"][0]["finish_reason"] == chat
    assert message.stop_reason == claude


async def test_a_reply_aborted_before_any_text_goes_to_the_next_upstream():
    aborting, steady = RecordingUpstream("", "abort"), RecordingUpstream("sunny")
    async with running(aborting.app()) as first, running(steady.app()) as second:
        targets = (UpstreamTarget(f"{first}/v1", 100), UpstreamTarget(f"{second}/v1"))
        engine = UpstreamEngine(UpstreamConfig(targets))
        async with running(create_app(engine)) as url:
            got = await post_events(f"{url}/v1/chat/completions", {**CHAT, "stream": True})
        await engine.aclose()
    assert got.chat_text == "sunny" and not got.of_type("error"), got.raw
    assert len(aborting.bodies) == len(steady.bodies) == 1


async def test_an_upstreams_content_filter_makes_a_response_incomplete_streamed_and_whole():
    """Stored (the API's default: produced into its log) and not, streamed and whole."""
    ended = []
    async with relay_ending("content_filter") as (url, _):
        for store in (True, False):
            ask = {**RESPONSES, "store": store}
            streamed = await post_events(f"{url}/v1/responses", {**ask, "stream": True})
            assert streamed.types[-1] == "response.incomplete", (store, streamed.types)
            assert "response.completed" not in streamed.types
            ended.append(streamed.of_type("response.incomplete")[-1]["response"])
            status, whole = await post_json(f"{url}/v1/responses", ask)
            assert status == 200, whole
            ended.append(whole)
    for response in ended:
        assert response["status"] == "incomplete", response
        assert response["incomplete_details"] == {"reason": "content_filter"}
        [message] = response["output"]
        assert message["status"] == "incomplete"
        assert message["content"][0]["text"] == "partial "
