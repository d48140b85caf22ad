"""Baseline: the popular stack, Starlette with sse-starlette's EventSourceResponse on uvicorn.

``POST /v1/replies`` does what the bare aiohttp baseline does (same seeded schedule, due times
from the start, replystream's token events byte for byte, then ``event: done``), written the
way the sse-starlette documentation shows: an async generator handed to EventSourceResponse,
with its keep-alive ping every 15 s as replystream's. Pre-encoded bytes pass through it as
they are, so the wire is identical to the other servers'.

Run: python benchmarks/delivery/starlette_app.py [--port 0] [--loop asyncio]; prints
``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import AsyncIterator

import uvicorn
from procstats import raise_nofile
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from workload import TOKENS, done_frame, parse_body, schedule, token_frame

BACKLOG = 4096


async def events(seed: int, tokens: int) -> AsyncIterator[bytes]:
    due = schedule(seed, tokens)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for index, at in enumerate(due):
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        yield token_frame(index)
    yield done_frame(tokens, "stop" if tokens == TOKENS else "length")


async def replies(request: Request) -> Response:
    try:
        seed, tokens = parse_body(await request.body())
    except ValueError as error:
        return PlainTextResponse(str(error), status_code=400)
    return EventSourceResponse(events(seed, tokens), ping=15)


app = Starlette(routes=[Route("/v1/replies", replies, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--loop", default="asyncio", help="uvicorn's event loop (auto picks uvloop if installed)"
    )
    args = parser.parse_args()
    # Checked by hand: a peer measured against replystream loads none of its code.
    if not 0 <= args.port <= 65535:
        parser.error(
            f"argument --port: want a port from 0 to 65535 (0 picks a free one), got {args.port}"
        )
    raise_nofile()
    # Bind here so a free port is known before serving; uvicorn serves on this socket.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(BACKLOG)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        backlog=BACKLOG,
        loop=args.loop,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    print(f"starlette listening on http://{host}:{port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
