"""Start ``replystream serve`` in a child process on a free loopback port, for tools to measure.

A separate process keeps the server's event loop apart from the measuring client's, as it would
be in production, so client-side parsing cannot delay the server's timers or the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

READY_PREFIX = "replystream listening on "


@dataclass(frozen=True, slots=True)
class LocalServer:
    """A running ``replystream serve`` child: its base URL and process id."""

    url: str
    pid: int


@contextlib.asynccontextmanager
async def serve_process(
    args: Sequence[str], *, ready_timeout_s: float = 30.0
) -> AsyncIterator[LocalServer]:
    """Run ``replystream serve --port 0 ARGS``; yield its URL and pid; stop it on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(ready_timeout_s):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"server exited early with status {await process.wait()}")
                if line.startswith(READY_PREFIX):
                    break
        yield LocalServer(line[len(READY_PREFIX) :].strip(), process.pid)
    finally:
        await stop_process(process)


@contextlib.asynccontextmanager
async def local_server(args: Sequence[str], *, ready_timeout_s: float = 30.0) -> AsyncIterator[str]:
    """Run ``replystream serve --port 0 ARGS`` and yield its base URL; stop it on exit.

    The engine is the simulated one unless ARGS choose another: lab tools need its schedule.
    """
    if "--engine" not in args:
        args = ["--engine", "simulated", *args]
    async with serve_process(args, ready_timeout_s=ready_timeout_s) as server:
        yield server.url


async def stop_process(process: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    """Ask a child process to stop (SIGTERM); kill it if it has not within ``grace_s``."""
    if process.returncode is not None:
        return
    process.terminate()
    try:
        async with asyncio.timeout(grace_s):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
