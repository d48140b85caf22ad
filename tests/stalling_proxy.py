"""A reader that stops reading, made of real sockets: a loopback proxy that holds its first
connection's replies back, small kernel buffers under the server's writes, and a server that
cuts such a reader for a write that does not drain (rather than for byte lag, which a reader
that came back as far behind would meet again at once)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from aiohttp import web

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


@contextlib.asynccontextmanager
async def proxy_stalling_its_first_connection(
    upstream: tuple[str, int], release: asyncio.Event
) -> AsyncIterator[str]:
    """A loopback proxy whose first connection passes nothing back until ``release`` is set
    (a client that stops reading for a while); later connections pass freely."""
    connections = 0

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        stalled = connections == 1
        # A small receive buffer towards the server: a stall fills the server's socket soon.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, upstream)
        up_r, up_w = await asyncio.open_connection(sock=sock)
        requests = asyncio.ensure_future(pipe(client_r, up_w))
        try:
            if stalled:
                await release.wait()
                # Then it reads as fast as it can. Left this small, the connection was seen
                # to pass 6 KiB every 0.2 s on a busy machine (as if its window reopened
                # only at the sender's zero-window probes), far slower than any reader.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            await pipe(up_r, client_w)  # the server's side ends the exchange
        finally:
            client_w.close()
            up_w.close()
            await requests  # its socket is closed: it ends

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def small_send_buffer(request: web.Request, response: web.StreamResponse) -> None:
    """A small kernel buffer under the server's side of each response (loopback's are
    megabytes), so a client that stops reading holds up the server's writes soon."""
    transport = request.transport
    if transport is not None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)


def server_cutting_stalled_readers() -> web.Application:
    """A server making one long reply per request (300 words of 2,000 characters, 1 ms a
    token) that cuts a reader whose write has not drained for 0.5 s."""
    engine = fast_engine(reply_text=("r" * 2000 + " ") * 300, delay_ms=1, jitter_ms=0)
    policy = DeliveryPolicy(slow_client_bytes=64 << 20, slow_client_s=0.5)
    app = create_app(engine, ServerConfig(policy=policy))
    app.on_response_prepare.append(small_send_buffer)
    return app
