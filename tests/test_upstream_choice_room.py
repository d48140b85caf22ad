"""The choices of one request (``n > 1``) get room at upstreams with limits of requests at
once all together or not at all: a request whose choices do not all fit waits in line
holding none, so two such requests that fit the limits one at a time run one after the other
rather than each holding part of the room and waiting for the rest the other holds; and a
room it cannot use yet goes on to the next one in line.

The upstreams are aiohttp apps in this process on loopback ports, the relay (or two relays
sharing the limits, as the workers of one server do) a replystream app on another port, read
over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import wait_for
from tests.test_upstream_queue import (
    StreamingHolder,
    ask,
    holding,
    queued,
    relay,
    relays_sharing,
)

REPLY_S = 0.5  # how long the slow upstream takes over each reply


class SlowUpstream(ChatUpstream):
    """Answers each chat request after ``REPLY_S``; ``seen`` are their prompts, in order,
    and ``most_at_once`` the most it held at once."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.at_once = self.most_at_once = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["messages"][-1]["content"]
        self.seen.append(prompt)
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            await asyncio.sleep(REPLY_S)
            return await reply_with(request, f"re: {prompt}")
        finally:
            self.at_once -= 1


async def ask_choices(
    session: aiohttp.ClientSession, url: str, n: int, prompt: str
) -> tuple[int, Any]:
    """Status and body of one chat request for ``n`` choices of ``prompt``, not streamed."""
    body = {"model": "m", "n": n, "messages": [{"role": "user", "content": prompt}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, await response.json()


def answered(reply: tuple[int, Any], prompt: str) -> bool:
    status, body = reply
    return (
        status == 200
        and [c["message"]["content"] for c in body["choices"]] == [f"re: {prompt}"] * 2
    )


async def test_two_requests_whose_choices_fit_only_one_at_a_time_run_one_after_the_other():
    """Upstreams taking 2 at once, two requests for n=2 at once: the second waits, holding
    no room, until the first is done, then gets both its rooms (before, each one's first
    choice took a room and each second choice waited for the other's until queue_s)."""
    a, b = SlowUpstream(), SlowUpstream()
    async with (
        relay((a, 1), (b, 1), queue_s=4.0) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        first = asyncio.create_task(ask_choices(session, url, 2, "p"))
        await wait_for(lambda: "p" in a.seen + b.seen)  # its first choice is under way
        second = asyncio.create_task(ask_choices(session, url, 2, "q"))
        replies = await asyncio.gather(first, second)
        assert engine.stats().active == 0
    assert answered(replies[0], "p"), replies[0]
    assert answered(replies[1], "q"), replies[1]
    assert (a.most_at_once, b.most_at_once) == (1, 1)


async def test_relays_sharing_the_limits_admit_each_requests_choices_all_together(
    tmp_path: Path,
):
    """The same with the limit held by two relays together (the workers of one server): a
    request's choices take their slots all at once or wait for them holding none."""
    upstream = SlowUpstream()
    async with (
        relays_sharing(upstream, 2, tmp_path, queue_s=4.0) as [(one, _), (two, _)],
        aiohttp.ClientSession() as session,
    ):
        first = asyncio.create_task(ask_choices(session, one, 2, "p"))
        await wait_for(lambda: "p" in upstream.seen)
        second = asyncio.create_task(ask_choices(session, two, 2, "q"))
        replies = await asyncio.gather(first, second)
    assert answered(replies[0], "p"), replies[0]
    assert answered(replies[1], "q"), replies[1]
    assert upstream.most_at_once <= 2


async def test_a_room_a_waiting_request_of_several_choices_cannot_use_yet_goes_to_the_next():
    """A request for n=2 first in line, one room free: it is not enough for it, so the
    single request behind it gets the room rather than leave it idle (or hold it); the
    request of two gets both once two are free."""
    a, b = StreamingHolder(), StreamingHolder()
    async with (
        relay((a, 1), (b, 1), queue_s=10.0) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        # Every choice's head and first word come at once; the rest waits to be released.
        first = asyncio.create_task(ask_choices(session, url, 2, "p"))
        await wait_for(lambda: a.held == b.held == ["p"])
        pair = asyncio.create_task(ask_choices(session, url, 2, "q"))
        await wait_for(queued(engine, 1))
        single = asyncio.create_task(ask(session, url, "s"))
        await wait_for(queued(engine, 2))
        a.release("p")  # one room: not enough for the pair, so the single one goes
        await wait_for(holding("s", a))
        assert engine.stats().queued == 1 and b.held == ["p"]
        b.release("p")
        assert answered(await first, "p")
        await asyncio.sleep(0.2)  # one room is still not two
        assert engine.stats().queued == 1 and not holding("q", a, b)()
        a.release("s")
        assert await single == (200, None, "re: s")
        await wait_for(lambda: a.held == b.held == ["q"])
        a.release("q")
        b.release("q")
        assert answered(await pair, "q")
        assert engine.stats().active == 0


async def pair_among_singles(
    session: aiohttp.ClientSession, singles_to: str, pair_to: str, in_line: Callable[[], bool]
) -> tuple[tuple[int, Any], list[int]]:
    """Four clients each send single requests to ``singles_to`` one after another, keeping
    the upstream busy; once ``in_line()``, a request of two choices to ``pair_to``. Its
    reply, and the statuses of every single request."""
    stop = asyncio.Event()

    async def one_after_another(name: str) -> list[int]:
        statuses: list[int] = []
        for turn in range(1000):
            if stop.is_set():
                return statuses
            status, _, _ = await ask(session, singles_to, f"{name}{turn}")
            statuses.append(status)
        return statuses

    singles = [asyncio.create_task(one_after_another(name)) for name in "abcd"]
    await wait_for(in_line)
    pair = await ask_choices(session, pair_to, 2, "q")
    stop.set()
    statuses = await asyncio.gather(*singles)
    return pair, [status for run in statuses for status in run]


async def test_a_request_of_several_choices_is_not_starved_by_single_ones_behind_it():
    """An upstream taking 2 at once, kept busy by four clients sending one request after
    another: each room freed goes to a single request, never two at once, so a request for
    n=2 passed over all of its wait would end in a 503. Past half of its wait the room freed
    is held for it, and single requests that come meanwhile wait behind it: it is served."""
    upstream = SlowUpstream()
    async with (
        relay((upstream, 2), queue_s=4.0) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        # Once two wait in line behind the two the upstream holds.
        pair, statuses = await pair_among_singles(session, url, url, queued(engine, 2))
    assert answered(pair, "q"), pair  # within its wait, not a 503 at its end
    assert all(status == 200 for status in statuses)
    assert upstream.most_at_once <= 2


class FailingUpstream(ChatUpstream):
    """Answers every chat request 500 at once; ``asked`` counts them."""

    def __init__(self) -> None:
        self.asked = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.asked += 1
        return web.json_response({"error": {"message": "broken"}}, status=500)


async def test_choices_failing_over_while_their_request_starts_wait_holding_no_room():
    """One of three upstreams fails every request, and two requests for n=2 come at once:
    choices fail over (the failing upstream's circuit counts room until it opens) while
    their requests start. None waits in line holding room its request's other choices took,
    so neither request waits out queue_s for room the other holds: each is served, or ends
    at once with its upstream's failure, never busy."""
    failing, b, c = FailingUpstream(), SlowUpstream(), SlowUpstream()
    async with (
        relay((failing, 1), (b, 1), (c, 1), queue_s=6.0) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        started = asyncio.get_running_loop().time()
        first = asyncio.create_task(ask_choices(session, url, 2, "p"))
        await wait_for(lambda: "p" in b.seen + c.seen or failing.asked > 0)
        second = asyncio.create_task(ask_choices(session, url, 2, "q"))
        replies = await asyncio.gather(first, second)
        took = asyncio.get_running_loop().time() - started
        assert engine.stats().active == 0
    assert failing.asked >= 1  # some choice failed over
    for (status, body), prompt in zip(replies, "pq", strict=True):
        served = answered((status, body), prompt)
        failed_at_once = status == 502 and body["error"]["code"] == "upstream_error_status"
        assert served or failed_at_once, (status, body)
    assert took < 5.0  # not a wait until queue_s (6 s) for room held by the other
    assert (b.most_at_once, c.most_at_once) == (1, 1)


async def test_a_request_of_several_choices_is_not_starved_by_another_workers_singles(
    tmp_path: Path,
):
    """The same across the workers of one server: the single requests keeping the upstream
    busy come through the other worker, whose line sees the room freed, not the request of
    two waiting in this one's. Past half of its wait the room it needs is held for it in
    both: the other worker's requests wait behind it rather than take it."""
    upstream = SlowUpstream()
    async with (
        relays_sharing(upstream, 2, tmp_path, queue_s=4.0) as [(one, _), (two, second)],
        aiohttp.ClientSession() as session,
    ):
        pair, statuses = await pair_among_singles(session, two, one, queued(second, 2))
    assert answered(pair, "q"), pair  # within its wait, not a 503 at its end
    assert all(status == 200 for status in statuses)
    assert upstream.most_at_once <= 2
