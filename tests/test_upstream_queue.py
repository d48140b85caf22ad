"""An upstream's limit of requests at once (``max_outstanding``) through a real relay: no
upstream is sent more than its limit, requests past every limit wait for room first come
first served, a wait past ``queue_s`` is a 503 that says when to try again, and a client that
leaves while it waits takes no room with it.

The upstreams are aiohttp apps in this process on loopback ports that hold each chat request
until the test lets it go; the relay is ``create_app(UpstreamEngine(...))`` on another port,
read over real sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.engine.upstream_pool import Backend
from replystream.engine.upstream_queue import RoomQueue
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import wait_for


class HoldingUpstream(ChatUpstream):
    """An OpenAI-compatible upstream that answers each chat request only when released:
    ``held`` are the requests it holds now (by their prompt), in the order they came."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.most_at_once = 0
        self._gates: dict[str, asyncio.Event] = {}

    def release(self, prompt: str) -> None:
        self._gates[prompt].set()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["messages"][-1]["content"]
        gate = self._gates[prompt] = asyncio.Event()
        self.held.append(prompt)
        self.most_at_once = max(self.most_at_once, len(self.held))
        try:
            await gate.wait()
        finally:
            self.held.remove(prompt)
        return await reply_with(request, f"re: {prompt}")


@asynccontextmanager
async def relay(
    *upstreams: tuple[ChatUpstream, int | None], **config: Any
) -> AsyncIterator[tuple[str, UpstreamEngine]]:
    async with AsyncExitStack() as stack:
        targets = []
        for upstream, limit in upstreams:
            url = await stack.enter_async_context(running(upstream.app()))
            targets.append(UpstreamTarget(f"{url}/v1", max_outstanding=limit))
        engine = UpstreamEngine(UpstreamConfig(tuple(targets), **config))
        url = await stack.enter_async_context(running(create_app(engine)))
        try:
            yield url, engine
        finally:
            await engine.aclose()


async def ask(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, Any, str]:
    """Status, Retry-After and the whole text (or error code) of one streamed chat reply."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            error = (await response.json())["error"]["code"]
            return response.status, response.headers.get("Retry-After"), error
        text = ""
        async for line in response.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
        return response.status, None, text


def queued(engine: UpstreamEngine, count: int) -> Callable[[], bool]:
    return lambda: engine.stats().queued == count


def holding(prompt: str, *upstreams: HoldingUpstream) -> Callable[[], bool]:
    return lambda: any(prompt in upstream.held for upstream in upstreams)


async def test_no_upstream_gets_more_than_its_limit_and_the_rest_wait_first_come_first_served():
    a, b = HoldingUpstream(), HoldingUpstream()
    async with relay((a, 2), (b, 1)) as (url, engine), aiohttp.ClientSession() as session:
        replies = {}
        for i in range(3):  # every limit reached
            replies[f"r{i}"] = asyncio.create_task(ask(session, url, f"r{i}"))
        await wait_for(lambda: len(a.held) + len(b.held) == 3)
        assert (len(a.held), len(b.held)) == (2, 1)
        for i in range(3, 6):  # these wait, in this order
            replies[f"r{i}"] = asyncio.create_task(ask(session, url, f"r{i}"))
            await wait_for(queued(engine, i - 2))
        assert len(a.held) + len(b.held) == 3
        assert engine.stats().active == 6  # the engine holds them all: 3 running, 3 waiting
        # Each reply that ends lets the oldest waiter in, at the upstream it left.
        for waiter in ("r3", "r4", "r5"):
            first = (a.held + b.held)[0]
            (a if first in a.held else b).release(first)
            assert await replies[first] == (200, None, f"re: {first}")
            await wait_for(holding(waiter, a, b))
        assert engine.stats().queued == 0
        for prompt in list(a.held + b.held):
            (a if prompt in a.held else b).release(prompt)
        for prompt in ("r3", "r4", "r5"):
            assert await replies[prompt] == (200, None, f"re: {prompt}")
        assert (a.most_at_once, b.most_at_once) == (2, 1)


async def test_an_upstream_taken_out_and_put_back_keeps_the_replies_it_is_running():
    """Two reloads, the first taking an upstream out while it runs replies, the second
    putting it back: it came back as a fresh upstream with nothing under way, so it was sent
    past its limit while its gauge said less."""
    a, b = HoldingUpstream(), HoldingUpstream()
    async with relay((a, 2), (b, 1)) as (url, engine), aiohttp.ClientSession() as session:
        full = engine.config
        replies = {p: asyncio.create_task(ask(session, url, p)) for p in ("r0", "r1", "r2")}
        await wait_for(lambda: (len(a.held), len(b.held)) == (2, 1))  # every limit reached
        await engine.reroute(replace(full, targets=full.targets[1:]))  # a taken out
        await engine.reroute(full)  # and put back, its two replies still running there
        assert engine.stats().backends[0].outstanding == 2
        replies["r3"] = asyncio.create_task(ask(session, url, "r3"))
        await wait_for(queued(engine, 1))  # no room anywhere: it waits
        for prompt in list(a.held + b.held):
            (a if prompt in a.held else b).release(prompt)
        await wait_for(holding("r3", a, b))
        (a if "r3" in a.held else b).release("r3")
        for prompt, reply in replies.items():
            assert await reply == (200, None, f"re: {prompt}")
    assert (a.most_at_once, b.most_at_once) == (2, 1)


async def test_a_wait_past_queue_s_is_a_503_that_says_when_to_try_again():
    a = HoldingUpstream()
    async with relay((a, 1), queue_s=0.3) as (url, engine), aiohttp.ClientSession() as session:
        first = asyncio.create_task(ask(session, url, "first"))
        await wait_for(lambda: a.held == ["first"])
        assert await ask(session, url, "second") == (503, "1", "upstream_busy")
        assert engine.stats().queued == 0 and a.held == ["first"]
        a.release("first")
        assert await first == (200, None, "re: first")
    async with relay((a, 1), queue_s=0) as (url, _), aiohttp.ClientSession() as session:
        first = asyncio.create_task(ask(session, url, "first"))
        await wait_for(lambda: a.held == ["first"])
        assert await ask(session, url, "second") == (503, "1", "upstream_busy")  # no wait
        a.release("first")
        await first


async def test_a_503_after_the_wait_for_room_says_how_long_it_waited():
    a = HoldingUpstream()
    async with relay((a, 1), queue_s=0.3) as (url, _), aiohttp.ClientSession() as session:
        first = asyncio.create_task(ask(session, url, "first"))
        await wait_for(lambda: a.held == ["first"])
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "next"}]}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 503
            message = (await response.json())["error"]["message"]
        a.release("first")
        await first
    waited = re.search(r"\(waited ([0-9.]+) s for room\)", message)
    assert waited is not None and float(waited[1]) >= 0.3, message


async def ask_choices(session: aiohttp.ClientSession, url: str, n: int) -> tuple[int, Any]:
    """Status and body of one chat request for ``n`` choices, not streamed."""
    body = {"model": "m", "n": n, "messages": [{"role": "user", "content": "pick"}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, await response.json()


async def test_more_choices_than_the_upstreams_take_at_once_are_refused_at_once():
    """n=2 where the upstreams take one request at once: each choice is a request upstream,
    and the first would hold the only room while the second waits for it. The request is
    refused at once, naming n, and no upstream is asked."""
    a = HoldingUpstream()
    async with relay((a, 1), queue_s=5) as (url, engine), aiohttp.ClientSession() as session:
        started = time.monotonic()
        status, body = await ask_choices(session, url, 2)
        took = time.monotonic() - started
        assert engine.stats().active == 0
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "n" and "at most 1 at once" in error["message"], error
    assert took < 4 and a.most_at_once == 0  # not a wait for room past queue_s, nothing sent


async def test_as_many_choices_as_the_upstreams_take_at_once_are_served_within_the_limits():
    a, b = HoldingUpstream(), HoldingUpstream()
    async with relay((a, 1), (b, 1)) as (url, _), aiohttp.ClientSession() as session:
        reply = asyncio.create_task(ask_choices(session, url, 2))
        for upstream in (a, b):  # one choice each (the next is sent once one's head came)
            await wait_for(holding("pick", upstream))
            upstream.release("pick")
        status, body = await reply
    assert status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == ["re: pick"] * 2
    assert (a.most_at_once, b.most_at_once) == (1, 1)


async def test_a_client_that_leaves_while_it_waits_takes_no_room_with_it():
    a = HoldingUpstream()
    async with relay((a, 1)) as (url, engine), aiohttp.ClientSession() as session:
        first = asyncio.create_task(ask(session, url, "first"))
        await wait_for(lambda: a.held == ["first"])
        gone = asyncio.create_task(ask(session, url, "gone"))
        await wait_for(lambda: engine.stats().queued == 1)
        stays = asyncio.create_task(ask(session, url, "stays"))
        await wait_for(lambda: engine.stats().queued == 2)
        gone.cancel()  # its connection closes: the relay stops its wait
        await wait_for(lambda: engine.stats().queued == 1)
        a.release("first")
        await first
        await wait_for(lambda: a.held == ["stays"])
        a.release("stays")
        assert await stays == (200, None, "re: stays")
        assert engine.stats().queued == 0
        # Gone before its reply existed, it is still a reply that ended: cancelled.
        async with session.get(f"{url}/metrics") as response:
            metrics = await response.text()
    endpoint = 'endpoint="/v1/chat/completions"'
    for outcome, count in (("finished", 2), ("cancelled", 1)):
        assert f'replystream_replies_total{{{endpoint},outcome="{outcome}"}} {count}.0' in metrics
    assert f"replystream_end_to_end_seconds_count{{{endpoint}}} 3.0" in metrics


async def test_a_waiter_woken_then_gone_passes_the_room_to_the_next():
    queue, backend = RoomQueue(), Backend("http://a/v1", max_outstanding=1)
    first = asyncio.create_task(queue.wait("m", 10.0, 0.0))
    second = asyncio.create_task(queue.wait("m", 10.0, 0.0))
    other_model = asyncio.create_task(queue.wait("n", 10.0, 0.0))
    await wait_for(lambda: len(queue) == 3)
    backend.models = ("m",)
    queue.freed(backend)  # the first is woken...
    first.cancel()  # ...and its client leaves before it takes the room
    assert await second is True  # so the next waiter for a model it serves gets it
    assert not other_model.done() and len(queue) == 1
    queue.wake_all()
    assert await other_model is True and len(queue) == 0
    assert first.cancelled()


@asynccontextmanager
async def relays_sharing(
    upstream: ChatUpstream, limit: int, folder: Path, count: int = 2, **config: Any
) -> AsyncIterator[list[tuple[str, UpstreamEngine]]]:
    """``count`` relays to one upstream, holding its limit together in ``folder`` as the
    workers of one server do (each its own engine, files and locks)."""
    async with AsyncExitStack() as stack:
        base = await stack.enter_async_context(running(upstream.app()))
        relays = []
        for _ in range(count):
            target = UpstreamTarget(f"{base}/v1", max_outstanding=limit)
            engine = UpstreamEngine(UpstreamConfig((target,), **config), shared_limits=folder)
            stack.push_async_callback(engine.aclose)
            url = await stack.enter_async_context(running(create_app(engine)))
            relays.append((url, engine))
        yield relays


def slots_taken(engine: UpstreamEngine) -> int | None:
    return engine.stats().backends[0].slots_taken


async def test_relays_sharing_a_limit_send_no_more_than_it_together(tmp_path: Path):
    a = HoldingUpstream()
    async with (
        relays_sharing(a, 2, tmp_path) as [(first_url, first), (second_url, second)],
        aiohttp.ClientSession() as session,
    ):
        replies = {p: asyncio.create_task(ask(session, first_url, p)) for p in ("r0", "r1")}
        await wait_for(lambda: len(a.held) == 2)
        # The other relay's request waits for a slot the first one holds, in its own line.
        replies["r2"] = asyncio.create_task(ask(session, second_url, "r2"))
        await wait_for(queued(second, 1))
        assert first.stats().backends[0].outstanding == 2
        # Both see the whole server's (a count is reused for a moment).
        await wait_for(lambda: slots_taken(first) == slots_taken(second) == 2)
        await asyncio.sleep(0.1)  # several polls: still no room
        assert a.held == ["r0", "r1"]
        a.release("r0")  # a slot given back in the first relay lets the second one's in
        assert await replies["r0"] == (200, None, "re: r0")
        await wait_for(holding("r2", a))
        assert second.stats().queued == 0
        for prompt in ("r1", "r2"):
            a.release(prompt)
            assert await replies[prompt] == (200, None, f"re: {prompt}")
        assert a.most_at_once == 2
        await wait_for(lambda: slots_taken(first) == slots_taken(second) == 0)


async def test_a_wait_for_a_slot_held_by_another_relay_ends_in_503_when_its_time_is_up(
    tmp_path: Path,
):
    a = HoldingUpstream()
    async with (
        relays_sharing(a, 1, tmp_path, queue_s=0.3) as [(first_url, _), (second_url, second)],
        aiohttp.ClientSession() as session,
    ):
        held = asyncio.create_task(ask(session, first_url, "held"))
        await wait_for(lambda: a.held == ["held"])
        assert await ask(session, second_url, "late") == (503, "1", "upstream_busy")
        assert second.stats().queued == 0 and a.held == ["held"]
        a.release("held")
        assert await held == (200, None, "re: held")
        # The slot is free again: the second relay's next request goes at once.
        again = asyncio.create_task(ask(session, second_url, "again"))
        await wait_for(lambda: a.held == ["again"])
        a.release("again")
        assert await again == (200, None, "re: again")


async def test_a_reload_that_raises_a_shared_limit_lets_waiters_in(tmp_path: Path):
    a = HoldingUpstream()
    async with (
        relays_sharing(a, 1, tmp_path) as [(first_url, first), (second_url, second)],
        aiohttp.ClientSession() as session,
    ):
        replies = {"r0": asyncio.create_task(ask(session, first_url, "r0"))}
        await wait_for(lambda: a.held == ["r0"])
        replies["r1"] = asyncio.create_task(ask(session, second_url, "r1"))
        await wait_for(queued(second, 1))
        raised = UpstreamTarget(second.config.targets[0].base_url, max_outstanding=2)
        for engine in (first, second):
            await engine.reroute(replace(engine.config, targets=(raised,)))
        await wait_for(holding("r1", a))
        await wait_for(lambda: slots_taken(second) == 2)
        assert second.stats().backends[0].max_outstanding == 2
        lowered = replace(raised, max_outstanding=1)
        for engine in (first, second):
            await engine.reroute(replace(engine.config, targets=(lowered,)))
        a.release("r0")  # 1 still held, at the limit now: the next one waits for it
        assert await replies["r0"] == (200, None, "re: r0")
        replies["r2"] = asyncio.create_task(ask(session, first_url, "r2"))
        await wait_for(queued(first, 1))
        a.release("r1")
        await wait_for(holding("r2", a))
        a.release("r2")
        for prompt in ("r1", "r2"):
            assert await replies[prompt] == (200, None, f"re: {prompt}")
        assert a.most_at_once == 2


async def test_relays_sharing_a_limit_serve_their_lines_oldest_first(tmp_path: Path):
    """A slot given back in one relay goes to the other's line when that one began to wait
    first: no relay keeps the room its own replies give back while another's line starves."""
    a = HoldingUpstream()
    async with (
        relays_sharing(a, 1, tmp_path) as [(first_url, first), (second_url, second)],
        aiohttp.ClientSession() as session,
    ):
        replies = {"h": asyncio.create_task(ask(session, first_url, "h"))}
        await wait_for(lambda: a.held == ["h"])
        for prompt, url, engine, count in (
            ("a1", first_url, first, 1),
            ("b1", second_url, second, 1),
            ("a2", first_url, first, 2),
        ):
            replies[prompt] = asyncio.create_task(ask(session, url, prompt))
            await wait_for(queued(engine, count))
        order = []
        for _ in range(4):
            (prompt,) = a.held
            order.append(prompt)
            a.release(prompt)
            assert await replies[prompt] == (200, None, f"re: {prompt}")
            if len(order) < 4:
                await wait_for(lambda: len(a.held) == 1)
        assert order == ["h", "a1", "b1", "a2"]
        assert a.most_at_once == 1


class StreamingHolder(HoldingUpstream):
    """Answers at once and streams its first word, then holds the rest until released."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["messages"][-1]["content"]
        gate = self._gates[prompt] = asyncio.Event()
        self.held.append(prompt)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first = {"choices": [{"index": 0, "delta": {"content": "re: "}}]}
        await response.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        try:
            await gate.wait()
        finally:
            self.held.remove(prompt)
        for body in (
            {"choices": [{"index": 0, "delta": {"content": prompt}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ):
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_time_in_line_leaves_the_failover_window_to_the_attempt_that_gets_room():
    upstream = StreamingHolder()
    # A line longer than the failover window: a request let in after waiting past the
    # window still has the whole window for its attempt's head and first text.
    async with (
        relay((upstream, 1), queue_s=5.0, failover_s=1.0, ttft_s=1.0) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        first = asyncio.create_task(ask(session, url, "first"))
        await wait_for(lambda: upstream.held == ["first"])
        second = asyncio.create_task(ask(session, url, "second"))
        await wait_for(queued(engine, 1))
        await asyncio.sleep(1.2)  # past the window, still in line
        upstream.release("first")
        assert await first == (200, None, "re: first")
        await wait_for(lambda: upstream.held == ["second"])
        upstream.release("second")
        assert await second == (200, None, "re: second")
