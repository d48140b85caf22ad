"""Replies nobody may resume, reached from another connection while they run.

Such a reply's log drops what its one reader has sent. A second reader that joins it on
``GET /v1/replies/{id}/stream`` finds those events gone: the native stream says so with a
``gap`` and goes on, and every other dialect ends with its own ``events_lost`` error, even
when the log holds no event at that moment to tell the dialect by. And a response made
with ``store: false`` is no stored response: the Responses API's retrieve, cancel and delete
answer it 404 whatever its log holds at the moment, and never stop it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from replystream.delivery import openai_formats
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry, ReplyInfo
from replystream.server import create_app, running
from replystream.server.context import STORE_KEY
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request
from tests.stalling_proxy import small_send_buffer

CHAT = {
    "model": "simulated",
    "messages": [{"role": "user", "content": "x"}],
    "max_tokens": 12,
    "stream": True,
}
COMPLETION = {"model": "simulated", "prompt": "x", "max_tokens": 12, "stream": True}
RESPONSE = {
    "model": "simulated",
    "input": "x",
    "max_output_tokens": 12,
    "stream": True,
    "store": False,
}


async def joined_events(route: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """Start a reply nobody may resume on ``route`` and read its first events; then join it
    from another connection while its first reader still reads (between two tokens, 200 ms
    apart: its log holds nothing then). The joiner's events, as (type, data)."""
    engine = fast_engine(delay_ms=200, jitter_ms=0)
    async with running(create_app(engine)) as url:
        first = await raw_request(f"{url}{route}", "POST", json.dumps(body).encode())
        reply_id = first.headers["x-reply-id"]
        for _ in range(3):  # the opening events and the first token, sent and so released
            await first.reader.readuntil(b"\n\n")
        joined = await raw_request(f"{url}/v1/replies/{reply_id}/stream")
        assert joined.status == 200
        async with asyncio.timeout(30):
            raw = await joined.read_body()
        await first.aclose()
    return [(event.type, event.data) for event in EventParser().feed(raw)]


@pytest.mark.parametrize(
    ("route", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
    ids=["chat", "completions"],
)
async def test_a_chat_or_completion_joined_after_its_sent_events_ends_with_events_lost(
    route: str, body: dict[str, Any]
):
    events = await joined_events(route, body)
    # Not a native ``gap`` and then the rest as if whole: OpenAI's in-band error, no [DONE].
    assert len(events) == 1, events
    kind, data = events[0]
    assert kind == "error"
    assert json.loads(data)["error"]["code"] == "events_lost"


async def test_an_unstored_response_joined_after_its_sent_events_ends_with_events_lost():
    events = await joined_events("/v1/responses", RESPONSE)
    assert len(events) == 1, events
    kind, data = events[0]
    assert kind == "error"
    error = json.loads(data)
    assert (error["type"], error["code"]) == ("error", "events_lost")


async def test_an_unstored_response_is_not_found_by_the_responses_routes_while_it_runs():
    # Its reader stops reading while its long tokens are made: what the server cannot write
    # stays in its log, the moment in which a retrieve, a cancel or a delete found it.
    engine = fast_engine(reply_text=("r" * 4000 + " ") * 400, delay_ms=5, jitter_ms=0)
    patient = DeliveryPolicy(slow_client_bytes=1 << 30, slow_client_s=60.0)
    app = create_app(engine, ServerConfig(policy=patient))
    app.on_response_prepare.append(small_send_buffer)
    async with running(app) as url:
        body = json.dumps({**RESPONSE, "max_output_tokens": 400}).encode()
        first = await raw_request(f"{url}/v1/responses", "POST", body)
        reply_id = first.headers["x-reply-id"]
        # 800 KB made: far more than the socket buffers of a reader that does not read.
        await wait_for(lambda: engine.stats().steps >= 200, timeout_s=30)
        answers = {}
        for method, path in (
            ("GET", f"/v1/responses/resp_{reply_id}"),
            ("GET", f"/v1/responses/resp_{reply_id}?stream=true"),
            ("POST", f"/v1/responses/resp_{reply_id}/cancel"),
            ("DELETE", f"/v1/responses/resp_{reply_id}"),
        ):
            answer = await raw_request(f"{url}{path}", method)
            async with asyncio.timeout(30):
                answers[f"{method} {path}"] = (answer.status, await answer.read_body())
        async with asyncio.timeout(30):
            rest = await first.read_body()
    for asked, (status, body) in answers.items():
        assert status == 404, (asked, status, body[:300])
        assert json.loads(body)["error"]["code"] == "reply_not_found", (asked, body)
    # Neither stopped nor deleted: its own reader gets it to its end.
    assert rest.rstrip().split(b"\n\n")[-1].startswith(b"event: response.completed\n")
    assert b'"code":"deleted"' not in rest


async def joined_when_its_log_keeps_its_last(
    info: ReplyInfo, sent: list[LogEntry], last: LogEntry, ending: str
) -> list[tuple[str, str]]:
    """The events a joiner reads of a reply nobody may resume whose reader was ``sent`` all
    but its ``last`` event (the log keeps that one alone), as (type, data)."""
    app = create_app(fast_engine())
    async with running(app) as url:
        store = app[STORE_KEY]
        await store.create(info)
        store.append(info.reply_id, [*sent, last])
        store.release(info.reply_id, sent[-1].seq)
        store.end(info.reply_id, ending)
        joined = await raw_request(f"{url}/v1/replies/{info.reply_id}/stream")
        assert joined.status == 200
        async with asyncio.timeout(30):
            raw = await joined.read_body()
    return [(event.type, event.data) for event in EventParser().feed(raw)]


async def test_a_chat_reply_whose_log_keeps_only_its_done_is_still_read_as_chat():
    # The moment between a chat reply's last chunk sent and its ``[DONE]`` sent: the log of a
    # reply nobody may resume keeps the ``[DONE]`` alone, which tells no dialect by itself.
    chunks = [LogEntry(n, None, '{"id":"chatcmpl-r1","choices":[]}') for n in range(1, 7)]
    info = ReplyInfo("r1", dialect=openai_formats.DIALECT)
    events = await joined_when_its_log_keeps_its_last(
        info, chunks, LogEntry(7, None, "[DONE]"), "done"
    )
    assert len(events) == 1, events
    assert json.loads(events[0][1])["error"]["code"] == "events_lost"


async def test_a_native_reply_whose_log_keeps_only_its_error_is_still_read_as_native():
    # A native reply's ``error`` event is named as Anthropic's is: kept alone (what came
    # before it released to its reader), it was taken for a Messages reply's, and a joiner
    # was told of the hole in Anthropic's shape, as an end, with the reply's own error unsent.
    tokens = [LogEntry(n, "token", f'{{"text": "t{n} "}}') for n in range(1, 6)]
    failed = '{"error": {"message": "the engine failed", "code": "engine_error"}}'
    events = await joined_when_its_log_keeps_its_last(
        ReplyInfo("r2"), tokens, LogEntry(6, "error", failed), "error"
    )
    assert [kind for kind, _ in events] == ["gap", "error"], events
    assert json.loads(events[0][1]) == {"lost_from": 1, "lost_to": 5}
    assert json.loads(events[1][1])["error"]["code"] == "engine_error"
