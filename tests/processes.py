"""``replystream serve`` in a child process, as a replica would run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping

from replystream.lab.local_server import READY_PREFIX, stop_process


async def launch(
    *args: str,
    stderr: int | None = None,
    env: Mapping[str, str] | None = None,
    module: str = "replystream",
) -> asyncio.subprocess.Process:
    """``replystream serve --port 0 ARGS`` started, its stdout ours to read (and its stderr,
    with ``stderr=asyncio.subprocess.PIPE``); run as ``python -m MODULE``, a module of the
    tests that runs it in a way of its own (``tests.narrow_link``)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "serve",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
        env=env,
    )


async def ready_url(process: asyncio.subprocess.Process, ready_s: float = 30.0) -> str:
    """The base URL a started server's ready line names; ``ready_s`` bounds the wait for it
    (a real model takes seconds to load)."""
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), ready_s)).decode()
    assert line.startswith(READY_PREFIX), line
    return line[len(READY_PREFIX) :].strip()


async def start_server(*args: str, ready_s: float = 30.0) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``replystream serve --port 0 ARGS``; return the process and its base URL. One
    that does not say it is ready in time is stopped, not left running past the test."""
    process = await launch(*args)
    try:
        return process, await ready_url(process, ready_s)
    except BaseException:
        await stop_process(process)
        raise


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
