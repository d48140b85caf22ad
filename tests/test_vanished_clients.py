"""Clients on a real network link (a veth pair into a namespace of their own) that vanish
without a FIN or a reset, or stop reading: the server must notice within its documented
bounds, stop (or detach) their generation and let go of their connection.

The server's own limits see a client only through its socket's buffer, which the kernel's
send buffer keeps draining into for minutes while a reply trickles out and nobody
acknowledges it; the kernel's own retries last a quarter of an hour. These tests run a
reply slow enough that no buffer fills within their bounds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
from urllib.parse import urlsplit

import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedEngine
from replystream.server import create_app, running
from replystream.server.context import MANAGER_KEY
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.netns import Namespace, client_namespace

SLOW_CLIENT_S = 1.0
# The documented bound (--slow-client-s, and 5 s for a cut socket's last words) and room for
# a loaded machine.
BOUND_S = SLOW_CLIENT_S + 5.0 + 8.0
LAST_WORDS_WAIT = 10.0  # a cut socket is aborted 5 s after its close frame could not leave


def trickling_engine(delay_ms: float = 200.0) -> SimulatedEngine:
    """Short tokens for many minutes, five a second: far less than any socket buffer takes."""
    return fast_engine(reply_text=" ".join(["word"] * 30000), delay_ms=delay_ms, jitter_ms=0)


def config(**server: object) -> ServerConfig:
    return ServerConfig(policy=DeliveryPolicy(slow_client_s=SLOW_CLIENT_S), **server)  # type: ignore[arg-type]


async def connect(ns: Namespace, url: str, *, receive_buffer: int | None = None):
    """A connection from inside ``ns`` to the server at ``url``."""
    sock = await ns.socket()
    if receive_buffer is not None:  # before connecting: the window is offered at the SYN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    parts = urlsplit(url)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return sock


async def post_stream(ns: Namespace, url: str, body: dict[str, object]):
    sock = await connect(ns, url)
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/replies HTTP/1.1\r\nHost: server\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return reader, writer


async def read_until(reader: asyncio.StreamReader, marker: bytes, count: int) -> None:
    seen = b""
    async with asyncio.timeout(10):
        while seen.count(marker) < count:
            seen += await reader.read(4096)


def masked_text(payload: bytes) -> bytes:
    """One masked text frame, as a client sends (RFC 6455 5.3)."""
    mask = os.urandom(4)
    head = bytes((0x81, 0x80 | len(payload))) if len(payload) < 126 else None
    assert head is not None
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def stopped_within(engine: SimulatedEngine, since: float) -> float:
    """Seconds from ``since`` until the engine has no request left (failing past the bound)."""
    await wait_for(lambda: engine.stats().active == 0, timeout_s=BOUND_S)
    return time.monotonic() - since


@pytest.mark.parametrize("resumable", [False, True])
async def test_a_stream_whose_client_went_silent_is_stopped_within_the_slow_client_limit(
    resumable: bool,
):
    # A phone gone into a tunnel mid-reply: its packets stop, with no FIN and no reset. The
    # reply trickles into the kernel's send buffer, which never fills within the bound.
    engine = trickling_engine()
    with client_namespace() as ns:
        app = create_app(engine, config(detach_grace_s=1.0))
        async with running(app, host=ns.server_ip) as url:
            reader, writer = await post_stream(ns, url, {"prompt": "x", "resumable": resumable})
            await read_until(reader, b"event: token", 3)
            await ns.blackout()
            elapsed = await stopped_within(engine, time.monotonic())
            writer.transport.abort()
            await wait_for(lambda: not app[MANAGER_KEY].readers and not len(app[MANAGER_KEY]))
    assert engine.stats().cancelled == 1
    # Noticed once what it was sent went unacknowledged for the limit (a detached reply then
    # runs on for its grace): not after the minutes the buffer takes, or the kernel's retries.
    assert elapsed < BOUND_S + (1.0 if resumable else 0.0), elapsed


async def test_a_reply_not_streamed_whose_client_went_silent_is_stopped_within_the_limit():
    # Nothing is sent until the whole reply is made, so nothing goes unacknowledged: only
    # the kernel's keep-alive probes, unanswered, tell that the client is gone.
    engine = trickling_engine()
    with client_namespace() as ns:
        app = create_app(engine, config())
        async with running(app, host=ns.server_ip) as url:
            _, writer = await post_stream(ns, url, {"prompt": "x", "stream": False})
            await wait_for(lambda: engine.stats().steps > 0)
            await ns.blackout()
            elapsed = await stopped_within(engine, time.monotonic())
            writer.transport.abort()
            await wait_for(lambda: not len(app[MANAGER_KEY]))
    assert engine.stats().cancelled == 1
    assert elapsed < BOUND_S, elapsed


async def test_a_websocket_whose_client_went_silent_mid_reply_is_cut_within_the_limits():
    # The docs' bound for a WebSocket that is gone: keep-alive x 1.25 + slow-client-s after
    # the last frame when idle, sooner while replies are sent. Replies being sent fill no
    # buffer here, and the socket is never idle, so no ping would ever go unanswered.
    engine = trickling_engine()
    with client_namespace() as ns:
        app = create_app(engine, config())
        async with running(app, host=ns.server_ip) as url:
            sock = await connect(ns, url)
            reader, writer = await asyncio.open_connection(sock=sock)
            key = base64.b64encode(os.urandom(16)).decode()
            writer.write(
                f"GET /v1/ws HTTP/1.1\r\nHost: server\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n".encode()
            )
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
            writer.write(masked_text(b'{"type": "reply", "id": "a", "prompt": "x"}'))
            await read_until(reader, b'"type":"token"', 3)
            await ns.blackout()
            elapsed = await stopped_within(engine, time.monotonic())
            await wait_for(lambda: not app[MANAGER_KEY].connections, timeout_s=LAST_WORDS_WAIT)
            writer.transport.abort()
    assert engine.stats().cancelled == 1
    assert elapsed < BOUND_S, elapsed


async def test_a_client_that_shuts_its_window_is_cut_within_the_slow_client_limit():
    # Alive, acknowledging every probe, but reading nothing: its receive window shuts. The
    # reply trickles on into the server's send buffer, which would take minutes to fill
    # before a write stopped draining and the slow-client limit began to count.
    engine = trickling_engine(delay_ms=20.0)
    with client_namespace() as ns:
        app = create_app(engine, config())
        async with running(app, host=ns.server_ip) as url:
            sock = await connect(ns, url, receive_buffer=2048)
            loop = asyncio.get_running_loop()
            body = b'{"prompt": "x"}'
            await loop.sock_sendall(
                sock,
                b"POST /v1/replies HTTP/1.1\r\nHost: server\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
            )
            started = time.monotonic()
            await wait_for(lambda: engine.stats().steps > 0)
            elapsed = await stopped_within(engine, started)
            await wait_for(lambda: not app[MANAGER_KEY].readers and not len(app[MANAGER_KEY]))
            sock.close()
    assert engine.stats().cancelled == 1
    # The window shuts within a second or two (a few KB of events at 50 tokens a second).
    assert elapsed < BOUND_S, elapsed


@pytest.mark.parametrize("slow_client_s", [100_000.0, 10_000_000.0, 1e308])
async def test_a_slow_client_limit_past_the_kernels_ranges_still_serves_every_connection(
    slow_client_s: float,
):
    # Linux takes a keep-alive period of at most 32,767 s and a TCP_USER_TIMEOUT that fits
    # an int of milliseconds (24.8 days): a limit past either is held to it, not refused by
    # the kernel at every accept (no connection served, a traceback each).
    policy = DeliveryPolicy(slow_client_s=slow_client_s)
    app = create_app(fast_engine(), ServerConfig(policy=policy))
    async with running(app) as url:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: server\r\nConnection: close\r\n\r\n")
        try:
            async with asyncio.timeout(10):
                answer = await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
