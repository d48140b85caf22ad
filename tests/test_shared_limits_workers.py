"""An upstream's limit of requests at once (``--upstream-max-outstanding``) holds for the
whole of ``serve --workers 2``, not per worker: the upstream never has more requests at
once, a request past the limit in either worker waits for room or gets ``upstream_busy``,
and a worker killed while it holds slots leaves them free.

Real processes: the relay is ``replystream serve --workers 2``; the upstream is an aiohttp
app in this process that counts the requests it holds at once (one whose client is gone
no longer counts) and answers when the test lets it. Each of our connections is pinned to
a known worker (``test_gateway_workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from replystream.server import running
from replystream.server.metrics import STATE_REFRESH_S
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import wait_for
from tests.processes import replica
from tests.test_gateway_workers import Pinned, new_worker, pin_each_worker, value
from tests.test_workers import children_of

pytestmark = pytest.mark.slow

CHAT: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class GatedUpstream(ChatUpstream):
    """Holds each chat request while its gate is shut (then ``delay_s`` more), and counts
    the requests it holds at once: ``at_once`` now, ``most_at_once`` ever."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.gate = asyncio.Event()
        self.delay_s = delay_s
        self.at_once = 0
        self.most_at_once = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            while not self.gate.is_set():
                transport = request.transport
                if transport is None or transport.is_closing():  # its client is gone
                    raise ConnectionResetError
                await asyncio.sleep(0.01)
            await asyncio.sleep(self.delay_s)
        finally:
            self.at_once -= 1
        return await reply_with(request, "fine")


@contextlib.asynccontextmanager
async def relayed(
    upstream: GatedUpstream, *options: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, str]]:
    """The relay ``serve --workers 2`` in front of ``upstream``: its process, its URL, and
    the upstream's base URL."""
    async with running(upstream.app()) as url:
        base = f"{url}/v1"
        args = [f"--engine=upstream:{base}", "--workers", "2", "--upstream-health-s", "60"]
        async with replica(*args, *options) as (process, relay):
            yield process, relay, base


def served(reply: tuple[int, bytes]) -> bool:
    status, body = reply
    return status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "fine"


def busy(reply: tuple[int, bytes]) -> bool:
    status, body = reply
    return status == 503 and json.loads(body)["error"]["code"] == "upstream_busy"


async def ask(connection: Pinned) -> tuple[int, bytes]:
    return await connection.request("POST", "/v1/chat/completions", CHAT)


async def test_two_workers_send_an_upstream_no_more_than_its_limit_together():
    upstream = GatedUpstream(delay_s=0.05)
    options = ("--upstream-max-outstanding", "2", "--upstream-queue-s", "30")
    async with (
        relayed(upstream, *options) as (process, relay, _),
        contextlib.AsyncExitStack() as stack,
    ):
        pids = children_of(process.pid)
        # Four keep-alive connections to each worker: eight clients at once.
        sets = [await stack.enter_async_context(pin_each_worker(relay, pids)) for _ in range(4)]
        clients = [connection for pinned in sets for connection in pinned.values()]
        upstream.gate.set()

        async def client(connection: Pinned) -> list[tuple[int, bytes]]:
            return [await ask(connection) for _ in range(4)]

        replies = await asyncio.wait_for(asyncio.gather(*map(client, clients)), 60)
        assert all(served(reply) for each in replies for reply in each)
        assert upstream.most_at_once == 2  # used to the limit, never past it


async def test_a_request_past_the_limit_in_either_worker_waits_then_is_busy():
    upstream = GatedUpstream()
    options = ("--upstream-max-outstanding", "2", "--upstream-queue-s", "1.5")
    async with (
        relayed(upstream, *options) as (process, relay, base),
        pin_each_worker(relay, children_of(process.pid)) as first,
        pin_each_worker(relay, children_of(process.pid)) as second,
    ):
        one, other = first
        held = [asyncio.create_task(ask(first[one])), asyncio.create_task(ask(second[one]))]
        await wait_for(lambda: upstream.at_once == 2)
        # The other worker has sent nothing: the limit is the server's, so its request waits
        # its time in line, as one of the first worker's own does, and is told it is busy.
        late = [ask(first[other]), ask(second[other])]
        started = asyncio.get_running_loop().time()
        assert all(busy(reply) for reply in await asyncio.gather(*late))
        assert asyncio.get_running_loop().time() - started >= 1.4
        assert upstream.most_at_once == 2
        await asyncio.sleep(STATE_REFRESH_S * 1.5)  # each worker has written its readings
        seen = await first[other].scrape()
        assert value(seen, "replystream_upstream_slots_taken", upstream=base) == 2
        assert value(seen, "replystream_upstream_max_outstanding", upstream=base) == 2
        assert value(seen, "replystream_upstream_outstanding", upstream=base) == 2
        upstream.gate.set()
        assert all(served(reply) for reply in await asyncio.gather(*held))


async def test_a_worker_killed_while_it_holds_slots_leaves_them_free():
    upstream = GatedUpstream()
    options = ("--upstream-max-outstanding", "2", "--upstream-queue-s", "30")
    async with (
        relayed(upstream, *options) as (process, relay, _),
        contextlib.AsyncExitStack() as stack,
    ):
        workers = children_of(process.pid)
        first = await stack.enter_async_context(pin_each_worker(relay, workers))
        second = await stack.enter_async_context(pin_each_worker(relay, workers))
        doomed, spared = workers
        for pinned in (first, second):  # the doomed worker holds both slots
            stack.push_async_callback(_settled, asyncio.create_task(ask(pinned[doomed])))
        await wait_for(lambda: upstream.at_once == 2)
        os.kill(doomed, signal.SIGKILL)
        await wait_for(lambda: upstream.at_once == 0)  # its connections closed with it
        (newcomer,) = set(await new_worker(process.pid, workers)) - {spared}
        fresh = await stack.enter_async_context(pin_each_worker(relay, [newcomer]))
        # Both slots are free: one request through each worker goes at once...
        replies = [asyncio.create_task(ask(c)) for c in (fresh[newcomer], first[spared])]
        await wait_for(lambda: upstream.at_once == 2)
        # ...and a third waits for one of them, whichever worker it came through.
        third = asyncio.create_task(ask(second[spared]))
        await asyncio.sleep(0.5)
        assert upstream.at_once == 2 and not third.done()
        upstream.gate.set()
        assert all(served(reply) for reply in await asyncio.gather(*replies, third))
        assert upstream.most_at_once == 2


async def _settled(task: asyncio.Task[tuple[int, bytes]]) -> None:
    """The end of a request whose worker was killed (its connection dropped)."""
    with contextlib.suppress(Exception):
        await task
