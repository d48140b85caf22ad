"""Stop strings through the relay, against an aiohttp upstream on a loopback socket that
behaves as llama.cpp's server does (llama-cpp-python's, Ollama's and TGI's alike): sent
``stop``, it cuts its text before the first stop string and finishes ``stop`` without saying
which string it was. The dialects that tell the client which stop string ended the reply
(Anthropic's Messages, the native routes) send it none: the text comes whole, the reply ends
at the stop string, named, and the upstream's connection is closed there; the OpenAI
dialects, which do not name it, still send it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anthropic
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.sse_client import post_events
from tests.test_gateway import metric
from tests.test_upstream_routing import Upstream, chunk

# The reply, as the upstream streams it: a stop string may end within one piece (",") or
# span two (" wo" and "rld": "world"); many pieces follow, a little apart, so a relay that
# reads on to the end is seen doing it.
PIECES = ("Hello", ",", " wo", "rld", ".", *[" more"] * 40)
STARTS = [len("".join(PIECES[:i])) for i in range(len(PIECES))]  # where each piece starts
ASK: Any = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


class LlamaCpp(Upstream):
    """An upstream that honours ``stop`` as llama.cpp does: the text up to the first stop
    string, then ``finish_reason: "stop"`` with nothing naming it; sent none, the whole text.
    Asked to continue a final assistant message, it writes the rest of the text after it.
    It counts the replies it wrote to the end, and those cut by the client's closing."""

    def __init__(self, crash_after: int | None = None) -> None:
        super().__init__(["m"])
        # Asked afresh: the pieces it writes before its connection closes (a crash).
        self.crash_after = crash_after
        self.whole = 0
        self.aborted = 0
        self._ended = asyncio.Event()  # set as each reply ends

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        self.bodies.append(body)
        continuing = bool(body.get("continue_final_message"))
        done = len(body["messages"][-1]["content"]) if continuing else 0
        pieces = [
            piece[max(0, done - at) :]
            for at, piece in zip(STARTS, PIECES, strict=True)
            if at + len(piece) > done
        ]
        text = "".join(pieces)
        cut = min((text.find(s) for s in body.get("stop") or [] if s in text), default=len(text))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(chunk("", role="assistant"))
            written = count = 0
            for piece in pieces:
                if count == self.crash_after and not continuing:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                piece = piece[: cut - written]
                if not piece:
                    break
                await response.write(chunk(piece))
                written, count = written + len(piece), count + 1
                await asyncio.sleep(0.02)
            await response.write(chunk(None, "stop"))
            usage = {"prompt_tokens": 9, "completion_tokens": count, "total_tokens": 9 + count}
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
            await response.write(b"\n\ndata: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            # The client closed the connection mid-reply (the server cancels this handler
            # when it learns it, or the next write fails).
            self.aborted += 1
            self._ended.set()
            raise
        self.whole += 1
        self._ended.set()
        return response

    async def settled(self, replies: int) -> None:
        """Until ``replies`` replies have ended here, whole or cut (bounded)."""
        async with asyncio.timeout(30):
            while True:
                self._ended.clear()
                if self.whole + self.aborted >= replies:
                    return
                await self._ended.wait()


@asynccontextmanager
async def relaying(*upstreams: LlamaCpp, **config: Any) -> AsyncIterator[tuple[str, list[str]]]:
    """A server relaying to ``upstreams``: its URL, and theirs as metrics label them."""
    async with AsyncExitStack() as stack:
        targets = [f"{await stack.enter_async_context(running(u.app()))}/v1" for u in upstreams]
        routes = tuple(UpstreamTarget(target) for target in targets)
        engine = UpstreamEngine(UpstreamConfig(routes, health_s=600.0, **config))
        stack.push_async_callback(engine.aclose)
        yield await stack.enter_async_context(running(create_app(engine))), targets


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        return await response.text()


async def test_anthropic_messages_name_the_stop_string_an_upstream_would_not_name():
    upstream = LlamaCpp()
    async with (
        relaying(upstream) as (url, [target]),
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as claude,
    ):
        for stop, text, tokens in ((",", "Hello", 2), ("world", "Hello, ", 4)):
            ask = {**ASK, "stop_sequences": [stop]}
            whole = await claude.messages.create(**ask)
            async with claude.messages.stream(**ask) as stream:
                streamed = await stream.get_final_message()
            for message in (whole, streamed):
                [block] = message.content
                assert isinstance(block, anthropic.types.TextBlock)
                ending = (block.text, message.stop_reason, message.stop_sequence)
                assert ending == (text, "stop_sequence", stop)
                # The upstream's usage never comes: the tokens relayed, the stop string's too.
                assert message.usage.output_tokens == tokens
        await upstream.settled(4)
        metrics = await scrape(url)
    assert [body.get("stop") for body in upstream.bodies] == [None] * 4
    # Each upstream was stopped at the stop string, its connection closed, not read to the end.
    assert (upstream.aborted, upstream.whole) == (4, 0)
    # Every attempt ended well: none cancelled or failed, the circuit closed.
    assert metric(metrics, "replystream_upstream_attempts", upstream=target, result="ok") == 4
    attempts = [line for line in metrics.splitlines() if "replystream_upstream_attempts{" in line]
    assert all(line.endswith(" 0.0") for line in attempts if 'result="ok"' not in line), attempts
    assert metric(metrics, "replystream_upstream_circuit", upstream=target) == 0.0
    outcome = {"endpoint": "/v1/messages", "outcome": "finished"}
    assert metric(metrics, "replystream_replies_total", **outcome) == 4


async def test_the_native_route_names_the_stop_string_and_chat_still_sends_it_upstream():
    upstream = LlamaCpp()
    async with relaying(upstream) as (url, [target]):
        streamed = await post_events(f"{url}/v1/replies", {"prompt": "hi", "stop": ["world"]})
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{url}/v1/replies", json={"prompt": "hi", "stop": [","], "stream": False}
            ) as response,
        ):
            whole = await response.json()
        await upstream.settled(2)
        chat = await post_events(
            f"{url}/v1/chat/completions", {**ASK, "stream": True, "stop": [","]}
        )
        await upstream.settled(3)
        metrics = await scrape(url)
    assert streamed.text == "Hello, "
    assert streamed.of_type("done") == [{"finish_reason": "stop", "stop_sequence": "world"}]
    assert (whole["text"], whole["finish_reason"], whole["stop_sequence"]) == ("Hello", "stop", ",")
    # Chat names no stop string: the upstream is sent it, stops there itself and ends well.
    assert chat.chat_text == "Hello"
    finishes = [
        c["finish_reason"]
        for e in chat.events
        if e.data != "[DONE]"
        for c in json.loads(e.data)["choices"]
    ]
    assert finishes[-1] == "stop"
    assert [body.get("stop") for body in upstream.bodies] == [None, None, [","]]
    assert (upstream.aborted, upstream.whole) == (2, 1)
    attempts = {"name": "replystream_upstream_attempts", "upstream": target}
    assert metric(metrics, **attempts, result="ok") == 3
    assert metric(metrics, **attempts, result="cancelled") == 0


async def test_a_stop_string_spanning_a_seam_stops_the_upstream_that_continued():
    """The first upstream crashes after ``Hello, wo``; the reply goes on at the other, whose
    text ``rld. more...`` completes the stop string ``world``: the reply ends before it,
    named, and that upstream is stopped there, its attempt ended well."""
    upstreams = LlamaCpp(crash_after=3), LlamaCpp(crash_after=3)
    async with relaying(*upstreams, continuation=True) as (url, targets):
        got = await post_events(f"{url}/v1/replies", {"prompt": "hi", "stop": ["world"]})
        first, then = sorted(
            upstreams, key=lambda u: bool(u.bodies[0].get("continue_final_message"))
        )
        await then.settled(1)
        metrics = await scrape(url)
    assert got.types.count("continued") == 1
    assert got.text == "Hello, "
    assert got.of_type("done") == [{"finish_reason": "stop", "stop_sequence": "world"}]
    assert [len(first.bodies), len(then.bodies)] == [1, 1]
    assert then.bodies[0]["messages"][-1] == {"role": "assistant", "content": "Hello, wo"}
    assert "stop" not in then.bodies[0]
    assert (then.aborted, then.whole) == (1, 0)
    ok = [
        metric(metrics, "replystream_upstream_attempts", upstream=t, result="ok") for t in targets
    ]
    assert ok == [0.0, 1.0] if first is upstreams[0] else [1.0, 0.0]
