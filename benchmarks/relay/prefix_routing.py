"""How often a conversation's next turn reaches the upstream that holds its history: the
relay's ``--upstream-routing least`` against ``prefix``, side by side in one run.

What this file decides: a measure of prompt-cache locality that needs no model. Three
upstreams (aiohttp in this process, OpenAI-compatible, answering at once with a short
reply) each remember every conversation they served, by its messages. A turn after the
first is a **hit** when the upstream it reaches has served the turn before it (its messages
up to the previous user message: what a prefix cache such as vLLM's would hold of it), a
**miss** otherwise. The client holds ``--concurrency`` conversations open at once, each
``--turns`` turns long (each turn's messages are the history so far), ``--conversations`` in
all, every one with the same system prompt and a first question of its own (the common
case). The relay is ``replystream serve --engine upstream`` in front of the three, started
fresh for each routing, on one process.
Reported per routing: the hit rate of later turns, requests per upstream (the spread of
load), and the relay's added time to the whole reply (p50), which routing should not change.

Run: python benchmarks/relay/prefix_routing.py [--conversations 300] [--turns 4]
     [--concurrency 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

if __package__ in (None, ""):  # run as a script: make the ``relay`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replystream.lab.local_server import serve_process
from replystream.server import running
from tool_main import tool_main

ROUTINGS = ("least", "prefix")
SYSTEM = "You are a concise assistant. Answer in one short paragraph."


class RememberingUpstream:
    """An upstream that knows which conversations' turns it has served."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.served: set[str] = set()  # every request's messages, as JSON
        self.requests = 0
        self.hits = 0
        self.later_turns = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        messages = (await request.json())["messages"]
        self.requests += 1
        if len(messages) > 2:  # a later turn: was the turn before it served here?
            self.later_turns += 1
            self.hits += json.dumps(messages[:-2]) in self.served
        self.served.add(json.dumps(messages))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for body in (
            {"choices": [{"index": 0, "delta": {"content": "noted"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ):
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


@contextlib.asynccontextmanager
async def upstreams(count: int) -> AsyncIterator[list[tuple[RememberingUpstream, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        made = [RememberingUpstream(chr(ord("a") + i)) for i in range(count)]
        urls = [await stack.enter_async_context(running(u.app())) for u in made]
        yield list(zip(made, urls, strict=True))


async def converse(
    session: aiohttp.ClientSession, url: str, number: int, turns: int, times: list[float]
) -> None:
    """One conversation: ``turns`` requests, each with the history so far; the reply
    ignored but for its end."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        # The first question is what sets conversations apart (as users' first questions do).
        question = f"conversation {number}: question {turn} about streaming replies"
        messages.append({"role": "user", "content": question})
        body = {"model": "bench", "stream": True, "messages": messages}
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"the relay answered {response.status}")
            answer = ""
            async for line in response.content:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        answer += choice["delta"].get("content") or ""
        times.append(time.perf_counter() - started)
        messages.append({"role": "assistant", "content": answer})


@dataclass(frozen=True)
class Result:
    routing: str
    hit_rate: float  # of turns after the first
    requests: list[int]  # per upstream
    reply_ms_p50: float  # request sent to the reply's end, as the client saw it


async def measure(routing: str, args: argparse.Namespace) -> Result:
    async with upstreams(3) as pairs:
        command = [arg for _, url in pairs for arg in ("--engine", f"upstream:{url}/v1")]
        command += ["--upstream-routing", routing, "--model-name", "bench"]
        command += ["--upstream-health-s", "60", "--log-level", "WARNING"]
        async with serve_process(command) as server, aiohttp.ClientSession() as session:
            times: list[float] = []
            gate = asyncio.Semaphore(args.concurrency)

            async def one(number: int) -> None:
                async with gate:
                    await converse(session, server.url, number, args.turns, times)

            await asyncio.gather(*(one(n) for n in range(args.conversations)))
        made = [u for u, _ in pairs]
        later = sum(u.later_turns for u in made)
        return Result(
            routing,
            sum(u.hits for u in made) / later if later else 0.0,
            [u.requests for u in made],
            statistics.median(times) * 1000.0,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=30)
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.turns < 2 or args.concurrency < 1:
        parser.error("--conversations and --concurrency at least 1, --turns at least 2")
    print(
        f"{args.conversations} conversations of {args.turns} turns, {args.concurrency} at "
        "once, over 3 upstreams; a later turn hits when its upstream served the turn before"
    )
    print(f"{'routing':>8} {'hit rate':>9} {'requests per upstream':>24} {'reply p50 ms':>13}")
    for routing in ROUTINGS:
        row = asyncio.run(measure(routing, args))
        spread = " / ".join(str(n) for n in row.requests)
        print(f"{routing:>8} {row.hit_rate:>9.1%} {spread:>24} {row.reply_ms_p50:>13.2f}")
    return 0


if __name__ == "__main__":
    tool_main(main)
