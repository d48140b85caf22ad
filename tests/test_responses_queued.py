"""A background response is ``queued`` while the engine keeps it waiting (the tiny engine's
scheduler, a relay's line for room at its upstreams), then ``in_progress`` once it is taken
up, polled or streamed, as OpenAI's is."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
from aiohttp import web
from openai.types.responses import (
    Response,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponseQueuedEvent,
    ResponseStreamEvent,
)

from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream import UpstreamEngine
from replystream.server import create_app, running
from tests.conftest import our_code, wait_for
from tests.test_upstream_queue import HoldingUpstream, relay


class Gate:
    """Slows the tiny engine's forward pass (on its worker thread) while closed, to a step
    every 20 ms: the request the scheduler took up stays at work for seconds, and the
    scheduler keeps any other waiting."""

    def __init__(self, engine: TinyEngine) -> None:
        self.open = threading.Event()
        forward: Callable[..., Any] = engine.model.forward

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.open.wait(0.02)
            return forward(*args, **kwargs)

        engine.model.forward = gated  # type: ignore[method-assign]


@asynccontextmanager
async def one_at_a_time() -> AsyncIterator[tuple[openai.AsyncOpenAI, TinyEngine, Gate]]:
    """The real server, on loopback, over a tiny engine that runs one sequence at a time
    (``--max-running 1``), its forward pass held until the test opens the gate."""
    engine = load_default_engine(TinyEngineConfig(max_running=1, seed=1))
    gate = Gate(engine)
    try:
        async with (
            running(create_app(engine)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        ):
            yield client, engine, gate
    finally:
        gate.open.set()  # the worker is not left waiting, whatever the test did


async def status(client: openai.AsyncOpenAI, response_id: str) -> Response:
    return await client.responses.retrieve(response_id)


async def until_status(client: openai.AsyncOpenAI, response_id: str, wanted: str) -> Response:
    for _ in range(500):
        found = await status(client, response_id)
        if found.status == wanted:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} never became {wanted}: {found.status}")


async def until_ended(client: openai.AsyncOpenAI, response_id: str) -> Response:
    for _ in range(1000):
        found = await status(client, response_id)
        if found.status not in ("queued", "in_progress"):
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} never ended")


def told(event: ResponseStreamEvent) -> tuple[str, str | None, float]:
    """An opening event, as the SDK typed it: its type, and the status and creation time of
    the response it carries."""
    assert isinstance(event, ResponseCreatedEvent | ResponseQueuedEvent | ResponseInProgressEvent)
    return event.type, event.response.status, event.response.created_at


# The first response's length: at a step every 20 ms, seconds of work while the gate is shut.
LONG = 200


async def running_first(client: openai.AsyncOpenAI) -> Response:
    """A long background response, taken up by the engine at once (its forward pass is held
    by the gate): in progress, not queued, and the engine's one running sequence."""
    first = await client.responses.create(
        model="tiny", input="In the beginning", background=True, max_output_tokens=LONG
    )
    await until_status(client, first.id, "in_progress")
    return first


async def test_a_background_response_waiting_for_the_scheduler_is_queued_until_taken_up() -> None:
    async with one_at_a_time() as (client, engine, gate):
        first = await running_first(client)
        second = await client.responses.create(
            model="tiny", input="And God said", background=True, max_output_tokens=8
        )
        assert second.status == "queued"
        for _ in range(5):  # the engine runs one sequence at a time: the second waits
            assert (await status(client, second.id)).status == "queued"
            assert (await status(client, first.id)).status == "in_progress"
            await asyncio.sleep(0.05)
        assert engine.scheduler_stats().waiting == 1
        gate.open.set()
        done = [await until_ended(client, r.id) for r in (first, second)]
        # Its time in the queue is the server's queue time (not the moment ``start`` returned).
        async with aiohttp.ClientSession() as http:
            async with http.get(str(client.base_url).replace("/v1/", "/metrics")) as answer:
                metrics = await answer.text()
        waited = re.search(
            r'replystream_queue_seconds_sum\{endpoint="/v1/responses"\} (\S+)', metrics
        )
        assert waited is not None and float(waited[1]) >= 0.25  # the five polls' 50 ms sleeps
        assert [r.status for r in done] == ["incomplete", "incomplete"]  # (no end token)
        assert [r.created_at for r in done] == [first.created_at, second.created_at]
        events = await client.responses.retrieve(second.id, stream=True)
        kinds = [event async for event in events]
    assert [told(e) for e in kinds[:3]] == [
        ("response.created", "queued", second.created_at),
        ("response.queued", "queued", second.created_at),
        ("response.in_progress", "in_progress", second.created_at),
    ]
    assert kinds[3].type == "response.output_item.added"
    assert kinds[-1].type == "response.incomplete"
    assert [e.sequence_number for e in kinds] == list(range(len(kinds)))


async def test_a_streamed_background_response_says_queued_then_in_progress_when_taken_up():
    async with one_at_a_time() as (client, _, gate):
        await running_first(client)
        stream = await client.responses.create(
            model="tiny", input="And God said", background=True, stream=True, max_output_tokens=8
        )
        events = aiter(stream)
        opening = [await anext(events), await anext(events)]
        created_at = told(opening[0])[2]
        assert [told(e) for e in opening] == [
            ("response.created", "queued", created_at),
            ("response.queued", "queued", created_at),
        ]
        # Nothing more while the engine keeps it waiting.
        waiting = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        gate.open.set()
        started = await waiting
        rest = [event async for event in events]
    assert told(started) == ("response.in_progress", "in_progress", created_at)
    assert rest[0].type == "response.output_item.added"
    assert rest[-1].type == "response.incomplete"
    numbers = [e.sequence_number for e in [*opening, started, *rest]]
    assert numbers == list(range(len(numbers)))


async def test_a_response_not_in_the_background_is_in_progress_at_once_even_while_it_waits():
    """OpenAI's foreground responses are never queued: created in progress, then in
    progress, whatever the engine's queue; the text comes once the engine takes it up."""
    async with one_at_a_time() as (client, engine, gate):
        await running_first(client)
        stream = await client.responses.create(
            model="tiny", input="And God said", stream=True, max_output_tokens=8
        )
        events = aiter(stream)
        opening = [await anext(events), await anext(events)]
        await wait_for(lambda: engine.scheduler_stats().waiting == 1)
        gate.open.set()
        rest = [event async for event in events]
    assert [told(e)[:2] for e in opening] == [
        ("response.created", "in_progress"),
        ("response.in_progress", "in_progress"),
    ]
    assert rest[0].type == "response.output_item.added"
    assert rest[-1].type == "response.incomplete"


async def test_cancelling_a_queued_background_response_ends_it_unstarted_freeing_nothing_else():
    async with one_at_a_time() as (client, engine, gate):
        first = await running_first(client)
        second = await client.responses.create(
            model="tiny", input="And God said", background=True, max_output_tokens=8
        )
        await wait_for(lambda: engine.scheduler_stats().waiting == 1)
        cancelled = await client.responses.cancel(second.id)
        assert cancelled.status == "cancelled"
        assert cancelled.output == []
        await wait_for(lambda: engine.scheduler_stats().waiting == 0)
        # The running response keeps what it holds, and runs on.
        assert engine.scheduler_stats().running == 1
        assert (await status(client, first.id)).status == "in_progress"
        again = await status(client, second.id)
        assert (again.status, again.created_at) == ("cancelled", second.created_at)
        events = await client.responses.retrieve(second.id, stream=True)
        kinds = [event.type async for event in events]
        gate.open.set()
        ran = await until_ended(client, first.id)
        await wait_for(lambda: engine.stats().active == 0)
        stats = engine.stats()
    assert kinds == ["response.created", "response.queued", "response.failed"]
    assert ran.usage is not None and ran.usage.output_tokens == LONG  # run to its length
    assert (stats.finished, stats.cancelled) == (1, 1)
    timings = engine.timings(1)  # the second request's
    assert timings is not None and timings.scheduled is None  # never taken up
    assert engine.scheduler_stats().kv.used_blocks == 0


class SeenUpstream(HoldingUpstream):
    """A holding upstream that remembers every prompt it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((await request.json())["messages"][-1]["content"])
        return await super().chat(request)


@asynccontextmanager
async def full_relay(
    **config: Any,
) -> AsyncIterator[tuple[openai.AsyncOpenAI, UpstreamEngine, SeenUpstream]]:
    """A relay on loopback to one upstream that takes one request at a time."""
    upstream = SeenUpstream()
    async with (
        relay((upstream, 1), **config) as (url, engine),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client, engine, upstream


async def test_a_background_response_waiting_for_room_at_the_relays_upstream_is_queued():
    async with full_relay(queue_s=10.0) as (client, engine, upstream):
        first = await client.responses.create(model="m", input="first", background=True)
        await wait_for(lambda: upstream.held == ["first"])
        assert (await status(client, first.id)).status == "in_progress"
        began = time.monotonic()
        second = await client.responses.create(model="m", input="second", background=True)
        # Answered at once, not once room is found (the line holds it up to 10 s).
        assert time.monotonic() - began < 5.0
        assert second.status == "queued"
        for _ in range(5):
            assert (await status(client, second.id)).status == "queued"
            await asyncio.sleep(0.05)
        assert engine.stats().queued == 1 and upstream.seen == ["first"]
        upstream.release("first")
        await wait_for(lambda: upstream.held == ["second"])
        assert (await status(client, second.id)).status == "in_progress"
        upstream.release("second")
        done = await until_ended(client, second.id)
        events = await client.responses.retrieve(second.id, stream=True)
        kinds = [event async for event in events]
    assert (done.status, done.output_text, done.created_at) == (
        "completed",
        "re: second",
        second.created_at,
    )
    assert [told(e) for e in kinds[:3]] == [
        ("response.created", "queued", second.created_at),
        ("response.queued", "queued", second.created_at),
        ("response.in_progress", "in_progress", second.created_at),
    ]
    assert kinds[-1].type == "response.completed"


async def test_a_queued_relayed_response_cancelled_or_never_let_in_never_reaches_the_upstream():
    async with full_relay(queue_s=0.5) as (client, engine, upstream):
        first = await client.responses.create(model="m", input="first", background=True)
        await wait_for(lambda: upstream.held == ["first"])
        second = await client.responses.create(model="m", input="second", background=True)
        await wait_for(lambda: engine.stats().queued == 1)
        cancelled = await client.responses.cancel(second.id)
        assert (cancelled.status, cancelled.output) == ("cancelled", [])
        assert engine.stats().queued == 0  # out of the line, with nothing taken
        # One that waits longer than the line allows fails, as the 503 a chat gets says.
        third = await client.responses.create(model="m", input="third", background=True)
        assert third.status == "queued"
        ended = await until_ended(client, third.id)
        assert ended.status == "failed" and ended.error is not None
        assert our_code(ended.error) == "upstream_busy"
        assert engine.stats().failed == 1  # as a chat refused for want of room is counted
        assert (await status(client, first.id)).status == "in_progress"
        upstream.release("first")
        assert (await until_ended(client, first.id)).status == "completed"
        events = await client.responses.retrieve(second.id, stream=True)
        kinds = [event.type async for event in events]
    assert kinds == ["response.created", "response.queued", "response.failed"]
    assert upstream.seen == ["first"]
