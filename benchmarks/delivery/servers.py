"""The servers under test: how each is started fresh in a child process and where it listens.

Every server prints one line containing ``listening on URL`` when it accepts connections;
the harness waits for that line, and fails loudly if the process exits or stays silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from tier import RedisProcess, started_nginx, started_redis
from workload import (
    TOKEN_MARKER,
    WS_PATH,
    WS_TAG,
    WS_TOKEN_MARKER,
    request_body,
    token_frame,
    ws_reply_message,
    ws_token_message,
)

from replystream.lab.local_server import announced_process

HERE = Path(__file__).resolve().parent
READY = re.compile(r"listening on (http://\S+)")
# Every reply resumable: its log kept in memory (``replystream-resumable``), or in Redis by one
# replica (``replystream-redis``) or by two behind nginx (``replystream-redis-2``).
RESUMABLE_NAMES = ("replystream-resumable", "replystream-redis", "replystream-redis-2")
SERVER_NAMES = ("replystream", "bare", "starlette", *RESUMABLE_NAMES)
DEFAULT_SERVERS = ("replystream", "bare", "starlette")
TRANSPORTS = ("sse", "ws")
# uvicorn serves WebSockets only with the websockets or wsproto package, which the bench extra
# does not install: Starlette is measured over SSE alone. The nginx in front of two replicas
# is configured for SSE.
SERVER_TRANSPORTS = {
    "replystream": TRANSPORTS,
    "bare": TRANSPORTS,
    "starlette": ("sse",),
    "replystream-resumable": TRANSPORTS,
    "replystream-redis": TRANSPORTS,
    "replystream-redis-2": ("sse",),
}
REDIS_REPLICAS = {"replystream-redis": 1, "replystream-redis-2": 2}
# The programs a server's run starts besides Python (``tier.py``).
SERVER_PROGRAMS = {
    "replystream-redis": ("redis-server",),
    "replystream-redis-2": ("redis-server", "nginx"),
}


LOOPS = ("asyncio", "uvloop")


def server_command(name: str, workers: int, loop: str = "asyncio") -> list[str]:
    """The command line that starts server ``name`` on a free loopback port, on ``loop``."""
    if name == "replystream":
        command = [sys.executable, "-m", "replystream", "serve", "--host", "127.0.0.1"]
        command += ["--port", "0", "--engine", "simulated", "--delay-ms", "33"]
        command += ["--jitter-ms", "8", "--keepalive-s", "15", "--loop", loop]
        return command + (["--workers", str(workers)] if workers > 1 else [])
    if name == "bare":
        return [sys.executable, str(HERE / "bare_app.py"), "--port", "0", "--loop", loop]
    if name == "starlette":
        return [sys.executable, str(HERE / "starlette_app.py"), "--port", "0", "--loop", loop]
    if name == "replystream-resumable":
        return [*server_command("replystream", workers, loop), "--resumable-by-default"]
    raise ValueError(f"unknown server {name!r}")


def replica_command(redis_url: str, loop: str) -> list[str]:
    """One replica of the Redis-backed server: every reply resumable, its log in Redis."""
    command = server_command("replystream", 1, loop)
    return [*command, "--resumable-by-default", "--redis-url", redis_url]


@dataclass(frozen=True, slots=True)
class Variant:
    """One column of the table: a server, its transport, and for replystream its workers."""

    name: str
    workers: int = 1
    transport: str = "sse"

    @property
    def label(self) -> str:
        name = self.name if self.transport == "sse" else f"{self.name} {self.transport}"
        if self.workers == 1:
            return name
        return f"{name} ({self.workers} workers)"


@dataclass(frozen=True, slots=True)
class Started:
    """A server under test: where clients connect, and the processes whose CPU is its own."""

    name: str
    pid: int  # the first (or only) server process
    url: str
    pids: tuple[int, ...] = ()  # every replica's process (each with its workers)
    redis: RedisProcess | None = None  # the Redis its replicas log to
    proxy_pid: int | None = None  # the nginx in front of its replicas

    @property
    def replicas(self) -> tuple[int, ...]:
        return self.pids or (self.pid,)


@contextlib.asynccontextmanager
async def started_server(
    name: str, workers: int = 1, loop: str = "asyncio", ready_timeout_s: float = 30.0
) -> AsyncIterator[Started]:
    """Start server ``name`` (with its Redis and nginx, if it has them) and yield where it
    listens and its processes; stop everything on exit."""
    if name in REDIS_REPLICAS:
        async with started_tier(name, REDIS_REPLICAS[name], loop, ready_timeout_s) as tier:
            yield tier
        return
    async with announced_process(
        server_command(name, workers, loop),
        READY,
        name=f"{name} server",
        ready_timeout_s=ready_timeout_s,
    ) as server:
        yield Started(name, server.pid, server.url)


@contextlib.asynccontextmanager
async def started_tier(
    name: str, replicas: int, loop: str, ready_timeout_s: float
) -> AsyncIterator[Started]:
    """A fresh Redis, ``replicas`` replicas logging to it, and nginx in front of two or more."""
    async with contextlib.AsyncExitStack() as stack:
        redis = await stack.enter_async_context(started_redis())
        started = [
            await stack.enter_async_context(
                announced_process(
                    replica_command(redis.url, loop),
                    READY,
                    name=f"{name} replica {index + 1}",
                    ready_timeout_s=ready_timeout_s,
                )
            )
            for index in range(replicas)
        ]
        pids = tuple(server.pid for server in started)
        if replicas == 1:
            yield Started(name, pids[0], started[0].url, pids, redis)
            return
        upstreams = [urlsplit(server.url).netloc for server in started]
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        proxy = await stack.enter_async_context(started_nginx(upstreams, nofile))
        yield Started(name, pids[0], proxy.url, pids, redis, proxy.pid)


def token_frames(url: str, tokens: int = 3) -> list[bytes]:
    """The token events of one short reply from ``url``, as bytes (blocking)."""
    request = urllib.request.Request(
        f"{url}/v1/replies",
        data=request_body(7, tokens),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        body: bytes = response.read()
    return [block + b"\n\n" for block in body.split(b"\n\n") if block.startswith(TOKEN_MARKER)]


async def token_messages(url: str, tokens: int = 3) -> list[str]:
    """The token messages of one short reply over ``GET /v1/ws`` (no extension offered)."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{url}{WS_PATH}", compress=0) as ws,
    ):
        await ws.send_str(ws_reply_message(WS_TAG, 7, tokens).decode())
        messages: list[str] = []
        async with asyncio.timeout(10):
            while True:
                text = await ws.receive_str()
                kind = json.loads(text)["type"]
                if kind == "token":
                    messages.append(text)
                elif kind in ("done", "error", "moderated"):
                    return messages


async def check_wire(server: Started, transport: str = "sse") -> None:
    """Fail unless ``server`` writes token events byte for byte as the benchmark counts them."""
    if transport == "ws":
        await check_ws_wire(server)
        return
    frames = await asyncio.to_thread(token_frames, server.url)
    expected = [token_frame(index) for index in range(3)]
    if frames != expected:
        raise RuntimeError(f"{server.name} token events differ: {frames!r} != {expected!r}")


async def check_ws_wire(server: Started) -> None:
    """The same over ``GET /v1/ws``: one uncompressed text message per token, as counted."""
    messages = await token_messages(server.url)
    reply_id = json.loads(messages[0])["reply_id"] if messages else ""
    expected = [ws_token_message(WS_TAG, reply_id, index) for index in range(3)]
    if messages != expected or not all(m.encode().startswith(WS_TOKEN_MARKER) for m in messages):
        raise RuntimeError(f"{server.name} token messages differ: {messages!r} != {expected!r}")
