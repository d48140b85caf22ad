"""``replystream serve`` in a child process, as a replica would run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

from replystream.lab.local_server import READY_PREFIX, stop_process


async def start_server(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``replystream serve --port 0 ARGS``; return the process and its base URL."""
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
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    assert line.startswith(READY_PREFIX), line
    return process, line[len(READY_PREFIX) :].strip()


stop = stop_process


@contextlib.asynccontextmanager
async def replica(*args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    process, url = await start_server(*args)
    try:
        yield process, url
    finally:
        await stop(process)
