"""Run an application on a socket until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; port 0 lets the kernel pick a free one."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(4096)
    sock.setblocking(False)
    return sock


@asynccontextmanager
async def running(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) and yield its base URL."""
    # handler_cancellation: a client that disconnects cancels its handler, which is how a
    # buffered request learns to stop generating (a streamed one also sees failed writes).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = bind_socket(host, port)
    try:
        await web.SockSite(runner, sock).start()
        bound_host, bound_port = sock.getsockname()[:2]
        shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        yield f"http://{shown_host}:{bound_port}"
    finally:
        await runner.cleanup()
        sock.close()


async def serve_forever(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, announcing the URL on stdout (tools read that line)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(app, host, port) as url:
        print(f"replystream listening on {url}", flush=True)
        await stop.wait()
