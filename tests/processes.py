"""``replystream serve`` in a child process, as a replica would run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

from replystream.lab.local_server import READY_PREFIX, stop_process


async def start_server(*args: str, ready_s: float = 30.0) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``replystream serve --port 0 ARGS``; return the process and its base URL.

    ``ready_s`` bounds the wait for its ready line (a real model takes seconds to load)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        "serve",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), ready_s)).decode()
    assert line.startswith(READY_PREFIX), line
    return process, line[len(READY_PREFIX) :].strip()


stop = stop_process


@contextlib.asynccontextmanager
async def replica(
    *args: str, ready_s: float = 30.0
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    process, url = await start_server(*args, ready_s=ready_s)
    try:
        yield process, url
    finally:
        await stop(process)
