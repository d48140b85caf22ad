"""Baseline: the least a server can do to stream these replies, bare aiohttp SSE and WebSocket.

``POST /v1/replies`` reads the seed, follows the same seeded schedule as the simulated engine
(each delay computed when it is needed, as the engine does), sleeps until each token's due time
from the start (a fixed schedule, so lateness does not accumulate) and writes replystream's token
events byte for byte, then ``event: done``. No event log, no metrics, no moderation: the cost
of this handler is the floor.

``GET /v1/ws`` does the same over a WebSocket: it reads one ``{"type": "reply", ...}`` message,
sends one message per token on the same schedule, each byte for byte as replystream's
``GET /v1/ws`` sends it (same tag, a reply id of the same length), then ``done``, and waits
for the client's close. Pings every 15 s, as replystream's socket (``--keepalive-s 15``).

Run: python benchmarks/delivery/bare_app.py [--port 0]; prints ``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets

from aiohttp import WSMsgType, web
from procstats import raise_nofile
from workload import (
    TOKENS,
    WS_PATH,
    done_frame,
    gap_ms,
    parse_body,
    parse_ws_reply,
    token_frame,
    ws_done_message,
    ws_token_message,
)

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
KEEPALIVE_S = 15.0


async def replies(request: web.Request) -> web.StreamResponse:
    try:
        seed, tokens = parse_body(await request.read())
    except ValueError as error:
        raise web.HTTPBadRequest(text=str(error)) from error
    response = web.StreamResponse(headers=HEADERS)
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    due_ms = 0.0
    for index in range(tokens):
        due_ms += gap_ms(seed, index)
        await asyncio.sleep(max(0.0, start + due_ms / 1000.0 - loop.time()))
        await response.write(token_frame(index))
    await response.write(done_frame(tokens, "stop" if tokens == TOKENS else "length"))
    await response.write_eof()
    return response


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=KEEPALIVE_S)
    await ws.prepare(request)
    first = await ws.receive()
    if first.type != WSMsgType.TEXT:
        await ws.close()
        return ws
    try:
        tag, seed, tokens = parse_ws_reply(first.data)
    except ValueError as error:
        await ws.close(code=1003, message=str(error)[:120].encode())
        return ws
    reply_id = secrets.token_urlsafe(18)  # 24 characters, as replystream's
    loop = asyncio.get_running_loop()
    start = loop.time()
    due_ms = 0.0
    for index in range(tokens):
        due_ms += gap_ms(seed, index)
        await asyncio.sleep(max(0.0, start + due_ms / 1000.0 - loop.time()))
        await ws.send_str(ws_token_message(tag, reply_id, index))
    finish_reason = "stop" if tokens == TOKENS else "length"
    await ws.send_str(ws_done_message(tag, reply_id, tokens, finish_reason))
    async for _ in ws:
        pass  # one reply per socket: wait for the client's close
    return ws


async def started(host: str, port: int) -> web.AppRunner:
    """The bare app, accepting on ``host:port`` (0: a free port); clean the runner up after."""
    app = web.Application()
    app.router.add_post("/v1/replies", replies)
    app.router.add_get(WS_PATH, websocket)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    return runner


async def serve(host: str, port: int) -> None:
    runner = await started(host, port)
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"bare aiohttp listening on http://{bound_host}:{bound_port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = parser.parse_args()
    # Checked by hand: a peer measured against replystream loads none of its code.
    if not 0 <= args.port <= 65535:
        parser.error(
            f"argument --port: want a port from 0 to 65535 (0 picks a free one), got {args.port}"
        )
    raise_nofile()
    new_loop = None
    if args.loop == "uvloop":
        import uvloop

        new_loop = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
