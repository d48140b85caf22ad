"""A relayed stream attached to a sink: the upstream connection's own reads deliver its deltas.

One upstream attempt's stream is a ``PushDeltaStream``: attached, no task reads it; each body
chunk aiohttp takes off the socket is parsed and handed to the sink in the same call. These
tests attach a recording sink to attempts of a real ``UpstreamEngine`` in front of a real
aiohttp upstream on a loopback socket (``test_upstream_faults``'s scripted one, and one here
that tells connections apart), and pin what attaching must keep: the same deltas as
iterating, the same named failures, a clean end that gives the connection back to the pool,
and a close from inside the sink's own call that stops delivery at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from aiohttp import web

from replystream.engine.base import (
    Delta,
    EngineError,
    GenerationRequest,
    PushDeltaStream,
    SamplingParams,
)
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.conftest import fast_engine, wait_for
from tests.test_upstream_faults import chunk, fake_upstream


class RecordingSink:
    """Keeps what a stream pushes; closes the stream after ``close_after`` deltas if asked."""

    def __init__(self, stream: PushDeltaStream | None = None, close_after: int = 0) -> None:
        self.deltas: list[Delta] = []
        self.calls = 0
        self.ended = asyncio.Event()
        self.error: EngineError | None = None
        self._stream = stream
        self._close_after = close_after

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        self.calls += 1
        self.deltas.extend(deltas)
        if self._stream is not None and len(self.deltas) >= self._close_after:
            self._stream.close()

    def on_end(self, error: EngineError | None) -> None:
        self.error = error
        self.ended.set()

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


def engine_for(url: str, **config: float) -> UpstreamEngine:
    return UpstreamEngine(UpstreamConfig((UpstreamTarget(url),), model="m", **config))  # type: ignore[arg-type]


async def attempt(
    engine: UpstreamEngine, request: GenerationRequest | None = None
) -> PushDeltaStream:
    """One attempt at the engine's (only) upstream, as a relayed reply opens it."""
    backend = engine.pool.plan(None)[0]
    return await engine.open_attempt(backend, request or GenerationRequest("hi"))


async def attached(
    engine: UpstreamEngine, request: GenerationRequest | None = None
) -> RecordingSink:
    stream = await attempt(engine, request)
    sink = RecordingSink()
    stream.attach(sink)
    async with asyncio.timeout(10):
        await sink.ended.wait()
    return sink


async def test_an_attached_stream_pushes_the_deltas_an_iterated_one_yields():
    async with fake_upstream() as (_, upstream):
        engine = engine_for(f"{upstream}/ok/v1")
        iterated = [delta async for delta in await attempt(engine)]
        sink = await attached(engine)
        await engine.aclose()
    assert sink.error is None
    assert [(d.text, d.tokens, d.finish_reason) for d in sink.deltas] == [
        (d.text, d.tokens, d.finish_reason) for d in iterated
    ]
    assert sink.text == "one two three " and sink.deltas[-1].finish_reason == "stop"
    assert engine.stats().finished == 2 and engine.stats().active == 0


async def test_an_attached_stream_pushes_the_upstreams_logprobs_as_an_iterated_one_yields():
    # The upstream is replystream itself (the simulated engine's seeded log probabilities),
    # so every chunk carries its own: they must come out of the parse on both paths alike.
    request = GenerationRequest("hi", SamplingParams(seed=3, logprobs=2, max_tokens=6))
    async with running(create_app(fast_engine())) as upstream:
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/v1"),)))
        iterated = [delta async for delta in await attempt(engine, request)]
        sink = await attached(engine, request)
        await engine.aclose()
    assert sink.error is None
    pushed = [(d.text, d.tokens, d.finish_reason, d.logprobs) for d in sink.deltas]
    assert pushed == [(d.text, d.tokens, d.finish_reason, d.logprobs) for d in iterated]
    text = [d for d in sink.deltas if d.text]
    assert len(text) == 6 and all(d.logprobs is not None and len(d.logprobs) == 1 for d in text)
    assert all(d.logprobs[0].token == d.text and len(d.logprobs[0].top) == 2 for d in text)  # type: ignore[index]


async def test_an_attached_stream_names_a_chunk_that_is_not_json():
    async with fake_upstream() as (_, upstream):
        engine = engine_for(f"{upstream}/notjson/v1")
        sink = await attached(engine)
        await engine.aclose()
    assert sink.text == "one "
    assert sink.error is not None and sink.error.code == "upstream_bad_chunk"


async def test_an_attached_stream_names_an_upstream_that_ended_early():
    async with fake_upstream() as (_, upstream):
        engine = engine_for(f"{upstream}/eof/v1")
        sink = await attached(engine)
        await engine.aclose()
    assert sink.error is not None and sink.error.code == "upstream_incomplete"


async def test_closing_from_inside_the_sink_stops_delivery_and_aborts_the_upstream():
    async with fake_upstream() as (fake, upstream):
        engine = engine_for(f"{upstream}/forever/v1")
        stream = await attempt(engine)
        sink = RecordingSink(stream, close_after=3)
        stream.attach(sink)
        await wait_for(fake.disconnected.is_set)
        calls = sink.calls
        await asyncio.sleep(0.1)  # the upstream wrote every 10 ms: nothing more may arrive
        await engine.aclose()
    assert sink.calls == calls and len(sink.deltas) >= 3
    assert not sink.ended.is_set()  # a closed stream tells its sink nothing more
    assert engine.stats().cancelled == 1 and engine.stats().active == 0


@asynccontextmanager
async def upstream_by_connection() -> AsyncIterator[tuple[list[object], str]]:
    """A two-chunk upstream that records each request's client address (its connection)."""
    peers: list[object] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("hello "))
        await response.write(chunk(None, "stop") + b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the reply is complete; the body's end comes later
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with running(app) as url:
        yield peers, f"{url}/v1"


async def test_a_finished_reply_gives_its_upstream_connection_back_for_the_next():
    async with upstream_by_connection() as (peers, url):
        engine = engine_for(url)
        for _ in range(3):
            sink = await attached(engine)
            assert sink.error is None and sink.text == "hello "
            await asyncio.sleep(0.05)  # the body's end, written after [DONE], arrives
        await engine.aclose()
    assert len(peers) == 3 and len(set(peers)) == 1  # one connection served all three


class FailingSink(RecordingSink):
    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        raise RuntimeError("a bug in the sink")


async def test_a_sink_that_fails_ends_its_own_stream_and_no_other(caplog):
    async with fake_upstream() as (_, upstream):
        engine = engine_for(f"{upstream}/ok/v1")
        failing, healthy = FailingSink(), RecordingSink()
        for sink in (failing, healthy):
            stream = await attempt(engine)
            stream.attach(sink)
        async with asyncio.timeout(10):
            await failing.ended.wait()
            await healthy.ended.wait()
        await engine.aclose()
    assert failing.error is not None and failing.error.code == "upstream_broken"
    assert healthy.error is None and healthy.text == "one two three "
    assert "delivering a relayed reply's deltas failed" in caplog.text
    assert engine.stats().active == 0


async def test_a_burst_of_tiny_http_chunks_pauses_the_connection_and_is_delivered_whole():
    """An upstream whose body comes one byte per HTTP chunk, written at once: a single socket
    read holds more chunks than aiohttp's body reader takes before it pauses the connection,
    which the attached stream must resume as it reads (or the reply would stall)."""
    words = [f"w{i} " for i in range(300)]
    body = b"".join(chunk(word) for word in words) + chunk(None, "stop") + b"data: [DONE]\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(len(body)):
            await response.write(body[i : i + 1])  # each write is one HTTP chunk
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with running(app) as url:
        engine = engine_for(f"{url}/v1")
        sink = await attached(engine)
        await engine.aclose()
    assert sink.error is None
    assert [d.text for d in sink.deltas[:-1]] == words and sink.deltas[-1].finish_reason == "stop"
