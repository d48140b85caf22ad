"""Routing by prefix (``--upstream-routing prefix``) through a real relay: every turn of a
conversation, and every request with one ``prompt_cache_key``, goes to one upstream; keys
spread over the upstreams; a hot key spills to the next upstream past the bound on load; a
key whose upstream fails moves, and only that key's requests move when an upstream leaves.

The upstreams are aiohttp apps in this process on loopback ports, the relay
``create_app(UpstreamEngine(...))`` on another, read with the official openai SDK.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import openai
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from replystream.engine.base import GenerationRequest
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_affinity import affinity_key
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import wait_for


class NamedUpstream(ChatUpstream):
    """Answers every chat request at once with its own name; ``mode = "busy"`` answers 503.
    With ``hold`` set, holds each request until it is cleared."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[str] = []  # the last user message of each request
        self.mode = "ok"
        self.hold: asyncio.Event | None = None
        self.holding = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body["messages"][-1]["content"])
        if self.mode == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if self.hold is not None:
            self.holding += 1
            await self.hold.wait()
        return await reply_with(request, self.name)


@asynccontextmanager
async def relay(
    upstreams: list[NamedUpstream], **config: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, UpstreamEngine, list[str]]]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = tuple(UpstreamTarget(f"{u}/v1") for u in urls)
        # One round of health probes (at the first request): a later probe slowed past its
        # limit on a busy machine would move an upstream's keys, as it should, mid-test.
        config.setdefault("health_s", 600.0)
        engine = UpstreamEngine(UpstreamConfig(targets, routing="prefix", **config))
        url = await stack.enter_async_context(running(create_app(engine)))
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield client, engine, [f"{u}/v1" for u in urls]
        finally:
            await client.close()
            await engine.aclose()


async def turn(
    client: openai.AsyncOpenAI,
    messages: list[ChatCompletionMessageParam],
    prompt_cache_key: str | openai.Omit = openai.omit,
) -> str:
    """Send a conversation; the upstream's name, which it answers with."""
    reply = await client.chat.completions.create(
        model="m",
        messages=messages,
        prompt_cache_key=prompt_cache_key,
    )
    content = reply.choices[0].message.content
    assert content is not None
    return content


def conversation(n: int) -> list[ChatCompletionMessageParam]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"conversation {n}: tell me about streaming"},
    ]


async def test_every_turn_of_a_conversation_goes_to_one_upstream_and_keys_spread():
    upstreams = [NamedUpstream(name) for name in ("a", "b", "c")]
    async with relay(upstreams) as (client, _, _):
        homes: dict[int, set[str]] = {}
        for n in range(12):
            messages = conversation(n)
            for t in range(3):  # each turn carries the history before it
                answered = await turn(client, messages)
                homes.setdefault(n, set()).add(answered)
                messages = [
                    *messages,
                    {"role": "assistant", "content": answered},
                    {"role": "user", "content": f"and then, {t}?"},
                ]
        assert all(len(home) == 1 for home in homes.values()), homes
        spread = {home.pop() for home in homes.values()}
        assert len(spread) >= 2, spread  # 12 keys over 3 upstreams: never all on one


async def test_one_prompt_cache_key_goes_to_one_upstream_whatever_the_prompt():
    upstreams = [NamedUpstream(name) for name in ("a", "b", "c")]
    async with relay(upstreams) as (client, _, _):
        answers = {
            await turn(client, conversation(n), prompt_cache_key="tenant-7") for n in range(8)
        }
        assert len(answers) == 1
        # The Responses API takes the field too, to the same effect.
        answers = set()
        for n in range(6):
            response = await client.responses.create(
                model="m", input=f"question {n}", prompt_cache_key="tenant-9", store=False
            )
            answers.add(response.output_text)
        assert len(answers) == 1
    # The key, not the prompt, names it.
    ask = GenerationRequest("x", prompt_cache_key="k")
    assert affinity_key(ask) == affinity_key(GenerationRequest("y", prompt_cache_key="k"))


async def test_a_hot_key_spills_past_the_bound_on_load_and_comes_back():
    upstreams = [NamedUpstream(name) for name in ("a", "b", "c")]
    async with relay(upstreams) as (client, engine, _):
        home = await turn(client, conversation(0))  # alone: its own upstream
        for upstream in upstreams:
            upstream.hold = asyncio.Event()
        # Six requests of one conversation at once: its upstream takes its share within the
        # bound (1.5 times the average), the rest go to the next ones in its preference.
        asked = [asyncio.create_task(turn(client, conversation(0))) for _ in range(6)]
        await wait_for(lambda: sum(u.holding for u in upstreams) == 6)
        loads = {u.name: u.holding for u in upstreams}
        assert loads[home] == max(loads.values()) < 6, loads  # spilled, not piled up
        assert loads[home] <= 3, loads
        assert engine.stats().spills == 6 - loads[home]  # each one sent past its home
        for upstream in upstreams:
            assert upstream.hold is not None
            upstream.hold.set()
            upstream.hold = None
        await asyncio.gather(*asked)
        # With the load gone, the key is at its own upstream again.
        assert await turn(client, conversation(0)) == home
        assert engine.stats().queued == 0


async def test_a_key_whose_upstream_fails_moves_and_only_its_keys_move_when_it_leaves():
    upstreams = [NamedUpstream(name) for name in ("a", "b", "c")]
    async with relay(upstreams) as (client, engine, urls):
        homes = {n: await turn(client, conversation(n)) for n in range(12)}
        victim = next(u for u in upstreams if u.name in homes.values())
        victim.mode = "busy"
        for n, home in homes.items():  # its keys fail over; the others stay where they were
            answered = await turn(client, conversation(n))
            assert answered != victim.name
            if home != victim.name:
                assert answered == home
        # The upstream leaves the routes: still only its keys move.
        kept = tuple(
            UpstreamTarget(url) for url, up in zip(urls, upstreams, strict=True) if up is not victim
        )
        await engine.reroute(UpstreamConfig(kept, routing="prefix", health_s=600.0))
        for n, home in homes.items():
            if home != victim.name:
                assert await turn(client, conversation(n)) == home


async def test_a_key_whose_upstream_another_worker_fills_spills_and_is_counted(tmp_path: Path):
    # Two relays sharing one folder of slot files are two workers of one server: each of
    # the two upstreams takes one request at once, counted over both.
    upstreams = [NamedUpstream(name) for name in ("a", "b")]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = tuple(UpstreamTarget(f"{u}/v1", max_outstanding=1) for u in urls)
        config = UpstreamConfig(targets, routing="prefix", health_s=600.0, queue_s=5.0)
        workers = [UpstreamEngine(config, shared_limits=tmp_path) for _ in range(2)]
        clients = []
        for engine in workers:
            stack.push_async_callback(engine.aclose)
            url = await stack.enter_async_context(running(create_app(engine)))
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            stack.push_async_callback(client.close)
            clients.append(client)
        first, second = clients
        home = await turn(first, conversation(0))  # alone: its own upstream
        held = next(u for u in upstreams if u.name == home)
        held.hold = asyncio.Event()
        holding = asyncio.create_task(turn(first, conversation(0)))
        await wait_for(lambda: held.holding == 1)
        # The other worker has nothing under way: its key's upstream has room as far as its
        # own count goes, but the first worker holds that upstream's only slot.
        assert await turn(second, conversation(0)) != home
        assert workers[1].stats().spills == 1
        assert workers[0].stats().spills == 0
        held.hold.set()
        assert await holding == home
        assert await turn(second, conversation(0)) == home  # the slot is free again
        assert workers[1].stats().spills == 1
