"""Run an application on a socket; stop it gracefully on SIGINT or SIGTERM.

Shutdown order: stop accepting connections; let replies in flight finish for the grace period;
tell the rest to end with an in-band ``shutdown`` error (a buffered reply gets a 503); then
close connections. No stream is ever cut silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator

from aiohttp import web

log = logging.getLogger("replystream.server")


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


class RunningServer:
    """An application listening on a socket."""

    def __init__(self, app: web.Application, runner: web.AppRunner, site: web.SockSite, url: str):
        self.app = app
        self.runner = runner
        self.site = site
        self.url = url

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, give replies ``grace_s`` to finish, then end the rest in-band."""
        from replystream.server.app import MANAGER_KEY

        await self.site.stop()
        manager = self.app[MANAGER_KEY]
        if len(manager):
            log.warning("shutting down: %d replies in flight, %.1f s grace", len(manager), grace_s)
            await manager.wait_stopped(grace_s)
        # Replies still running, and readers of replies made elsewhere, end with an error.
        manager.shut_down()
        await manager.wait_stopped(5.0)
        if manager.readers:
            await asyncio.sleep(0.2)  # let readers write what the producers ended with


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host:port`` (0 picks a free port); clean up on exit."""
    # handler_cancellation: a client that disconnects cancels its handler, which is how a
    # buffered request learns to stop generating (a streamed one also sees failed writes).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    sock = bind_socket(host, port)
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        bound_host, bound_port = sock.getsockname()[:2]
        shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        yield RunningServer(app, runner, site, f"http://{shown_host}:{bound_port}")
    finally:
        await runner.cleanup()
        sock.close()


@contextlib.asynccontextmanager
async def running(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) and yield its base URL."""
    async with serving(app, host, port) as server:
        yield server.url


async def serve_forever(app: web.Application, host: str, port: int, grace_s: float) -> None:
    """Serve until SIGINT or SIGTERM, announcing the URL on stdout (tools read that line)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serving(app, host, port) as server:
        print(f"replystream listening on {server.url}", flush=True)
        await stop.wait()
        await server.shutdown(grace_s)
