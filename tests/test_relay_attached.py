"""A relayed reply attached to a sink: failover, the watchdog and continuation with no task.

A ``RelayedReply`` is a ``PushDeltaStream``: attached, it is the sink of its current
attempt's stream, an attempt's failure arrives in its ``on_end`` (or from its watchdog's
timer) and is decided there, and only opening the next attempt runs as a task. These tests
attach a recording sink to replies of a real ``UpstreamEngine`` in front of real aiohttp
upstreams on loopback sockets (``test_upstream_routing``'s, plus one here that makes a tool
call and then goes silent), and pin that the attached path keeps every gateway behaviour of
the iterated one: failover before the first text, the last failure when none is left, a
stall ended or continued behind its ``continued`` marker, no continuation after a tool
call, the counts and the access-log lines, and a close while the next attempt is being
opened. One test reads through our HTTP server and checks it runs no producer task.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replystream.engine.base import Caller, Delta, GenerationRequest, SamplingParams
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import running
from tests.conftest import wait_for
from tests.test_upstream_faults import chunk
from tests.test_upstream_push import RecordingSink
from tests.test_upstream_routing import Upstream, relay


class ToolThenSilent(Upstream):
    """Starts a tool call, then sends nothing but keep-alives."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}
        await response.write(chunk(None, tool_calls=[call]))
        for _ in range(300):
            await response.write(b": keep-alive\n\n")
            await asyncio.sleep(0.05)
        return response


class SlowHead(Upstream):
    """Takes its time before answering; notes when the caller gives up waiting."""

    def __init__(self) -> None:
        super().__init__(["m"])
        self.gone = asyncio.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.gone.set()
            raise
        return web.Response(status=500)


@asynccontextmanager
async def engine_over(upstreams: list[Upstream], **config: Any) -> AsyncIterator[UpstreamEngine]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = tuple(UpstreamTarget(f"{u}/v1") for u in urls)
        engine = UpstreamEngine(UpstreamConfig(targets, **config))
        try:
            yield engine
        finally:
            await engine.aclose()


async def attached(
    engine: UpstreamEngine, request: GenerationRequest | None = None
) -> RecordingSink:
    reply = await engine.start(request or GenerationRequest("hi"))
    sink = RecordingSink()
    reply.attach(sink)
    async with asyncio.timeout(10):
        await sink.ended.wait()
    return sink


def shape(deltas: list[Delta]) -> list[tuple[str, int, str | None, str | None]]:
    return [(d.text, d.tokens, d.finish_reason, d.continued) for d in deltas]


def attempts(engine: UpstreamEngine) -> list[dict[str, int]]:
    return [{k: v for k, v in b.attempts.items() if v} for b in engine.pool.backends]


async def test_after_a_failover_an_attached_reply_delivers_what_an_iterated_one_yields(caplog):
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with engine_over([Upstream(["m"], mode="busy"), Upstream(["m"])]) as engine:
        iterated = [
            d async for d in await engine.start(GenerationRequest("hi", caller=Caller("i")))
        ]
        # The round robin's next turn is the healthy upstream's (a failover took none).
        [d async for d in await engine.start(GenerationRequest("hi", caller=Caller("t")))]
        sink = await attached(engine, GenerationRequest("hi", caller=Caller("a")))
        stats = engine.stats()
    assert sink.error is None and sink.text == "w0 w1 w2 "
    assert shape(sink.deltas) == shape(iterated)
    assert sink.deltas[-1].finish_reason == "stop" and sink.deltas[-1].prompt_tokens == 11
    # The first and the third reply tried the refusing upstream first (its turns).
    assert attempts(engine) == [{"overloaded": 2}, {"ok": 3}]
    assert stats.failovers == 2 and stats.active == 0
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"attempt"' in r.getMessage()]
    assert [(line["request_id"], line["attempt"], line["result"]) for line in lines] == [
        ("i", 1, "overloaded"),
        ("i", 2, "ok"),
        ("a", 1, "overloaded"),
        ("a", 2, "ok"),
    ]
    # A failed attempt's line says why, as a client would be told; a served one has no error.
    assert lines[0]["error"] == "upstream_overloaded" and "answered 503" in lines[0]["reason"]
    assert "error" not in lines[1] and "reason" not in lines[1]


async def test_a_reply_that_moved_twice_is_one_failover():
    # The metric counts replies moved ("replystream_upstream_failovers"), not moves.
    upstreams = [Upstream(["m"], mode="busy"), Upstream(["m"], mode="busy"), Upstream(["m"])]
    async with engine_over(upstreams) as engine:
        sink = await attached(engine)
        stats = engine.stats()
    assert sink.error is None and sink.text == "w0 w1 w2 "
    assert sorted(map(str, attempts(engine))) == sorted(
        ["{'overloaded': 1}", "{'overloaded': 1}", "{'ok': 1}"]
    )
    assert stats.failovers == 1


async def test_no_text_within_the_ttft_limit_moves_an_attached_reply_to_the_next_upstream():
    async with engine_over([Upstream(["m"], mode="silent"), Upstream(["m"])], ttft_s=0.3) as engine:
        sink = await attached(engine)
    assert sink.error is None and sink.text == "w0 w1 w2 "
    assert all(d.continued is None for d in sink.deltas)  # nothing was relayed: no seam
    assert attempts(engine) == [{"ttft_timeout": 1}, {"ok": 1}]
    assert engine.stats().failovers == 1 and engine.stats().continuations == 0


async def test_when_every_upstream_failed_an_attached_reply_ends_with_the_last_failure():
    async with engine_over([Upstream(["m"], mode="silent")], ttft_s=0.3) as engine:
        sink = await attached(engine)
    assert sink.deltas == []
    assert sink.error is not None and sink.error.code == "upstream_ttft_timeout"
    assert "sent no text within 0.3 s" in str(sink.error)
    assert attempts(engine) == [{"ttft_timeout": 1}] and engine.stats().active == 0


async def test_an_attached_stall_is_continued_behind_a_marker_at_another_upstream():
    stalling, other = Upstream(["m"], mode="stall"), Upstream(["m"], words=5)
    async with engine_over([stalling, other], stall_s=0.4, continuation=True) as engine:
        sink = await attached(engine)
        stats = engine.stats()
    assert sink.error is None
    assert shape(sink.deltas)[:4] == [
        ("w0 ", 1, None, None),
        ("w1 ", 1, None, None),
        ("w2 ", 1, None, None),
        ("", 0, None, "upstream_stalled"),  # the seam: then the other upstream's text
    ]
    assert sink.text == "w0 w1 w2 " + "w0 w1 w2 w3 w4 "
    assert other.bodies[0]["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 "}
    assert attempts(engine) == [{"stalled": 1}, {"ok": 1}]
    assert stats.continuations == 1 and stats.failovers == 0 and stats.active == 0


async def test_a_reply_continued_twice_is_one_continuation():
    # Two stalling upstreams, then one that finishes: two seams, one reply continued.
    upstreams = [Upstream(["m"], mode="stall"), Upstream(["m"], mode="stall"), Upstream(["m"])]
    async with engine_over(upstreams, stall_s=0.4, continuation=True) as engine:
        sink = await attached(engine)
        stats = engine.stats()
    assert sink.error is None
    assert [d.continued for d in sink.deltas if d.continued] == ["upstream_stalled"] * 2
    assert stats.continuations == 1 and stats.failovers == 0


async def test_an_attached_stall_without_continuation_ends_the_reply_with_its_error():
    stalling, other = Upstream(["m"], mode="stall"), Upstream(["m"])
    async with engine_over([stalling, other], stall_s=0.4) as engine:
        sink = await attached(engine)
    assert sink.text == "w0 w1 w2 "
    assert sink.error is not None and sink.error.code == "upstream_stalled"
    assert "sent no text for 0.4 s mid-reply" in str(sink.error)
    assert other.bodies == [] and attempts(engine) == [{"stalled": 1}, {}]


async def test_an_attached_reply_that_made_a_tool_call_is_never_continued():
    tool, other = ToolThenSilent(["m"]), Upstream(["m"])
    async with engine_over([tool, other], stall_s=0.4, continuation=True) as engine:
        sink = await attached(engine)
    assert [d.tool_call.name for d in sink.deltas if d.tool_call is not None] == ["f"]
    assert sink.error is not None and sink.error.code == "upstream_stalled"
    assert other.bodies == [] and engine.stats().continuations == 0


async def test_closing_an_attached_reply_while_its_next_attempt_opens_stops_the_opening():
    slow = SlowHead()
    async with engine_over([Upstream(["m"], mode="silent"), slow], ttft_s=0.3) as engine:
        reply = await engine.start(GenerationRequest("hi"))
        sink = RecordingSink()
        reply.attach(sink)
        await wait_for(lambda: slow.bodies != [])  # the silent one timed out: the next opens
        reply.close()
        async with asyncio.timeout(10):
            await slow.gone.wait()  # the request to it was abandoned
        await asyncio.sleep(0.1)
        assert not sink.ended.is_set()  # a closed reply tells its sink nothing more
        assert attempts(engine) == [{"ttft_timeout": 1}, {"cancelled": 1}]
        assert [b.outstanding for b in engine.pool.backends] == [0, 0]


async def test_the_server_relays_a_continued_reply_with_no_producer_task():
    stalling, other = Upstream(["m"], mode="stall"), Upstream(["m"], words=5)
    async with (
        relay([stalling, other], stall_s=0.4, continuation=True) as url,
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/replies", json={"prompt": "hi"}) as response,
    ):
        body = b""
        tasks: set[str] = set()
        async for data in response.content.iter_any():
            body += data
            tasks |= {t.get_name() for t in asyncio.all_tasks()}
    assert body.count(b"event: continued") == 1 and b"event: done" in body
    assert not any(name.startswith("reply-") for name in tasks), tasks


@pytest.mark.parametrize(("mode", "read"), [("stall", "attached"), ("cut", "iterated")])
async def test_a_reply_that_spent_its_token_budget_ends_at_length_rather_than_go_on(
    mode: str, read: str
):
    # Its upstream sent every token the request allows, then failed before it finished: a
    # continuation could only send more than the client asked for.
    failing, other = Upstream(["m"], mode=mode), Upstream(["m"], words=5)
    async with engine_over([failing, other], stall_s=0.4, continuation=True) as engine:
        request = GenerationRequest("hi", SamplingParams(max_tokens=3))
        if read == "attached":
            sink = await attached(engine, request)
            assert sink.error is None
            deltas = sink.deltas
        else:
            reply = await engine.start(request)
            async with asyncio.timeout(10):
                deltas = [delta async for delta in reply]
        stats = engine.stats()
    assert shape(deltas) == [
        ("w0 ", 1, None, None),
        ("w1 ", 1, None, None),
        ("w2 ", 1, None, None),
        ("", 0, "length", None),
    ]
    assert other.bodies == [] and stats.continuations == 0 and stats.active == 0
