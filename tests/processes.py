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
    session: bool = False,
) -> asyncio.subprocess.Process:
    """``replystream serve --port 0 ARGS`` started, its stdout ours to read (and its stderr,
    with ``stderr=asyncio.subprocess.PIPE``); run as ``python -m MODULE``, a module of the
    tests that runs it in a way of its own (``tests.narrow_link``); ``session``: in a session
    of its own, its process group a terminal's (``os.killpg`` as a Ctrl-C)."""
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
        start_new_session=session,
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


class StderrLines:
    """A server's stderr, read as it comes: wait for a line with a given piece."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        self._stream = process.stderr
        self.lines: list[str] = []

    async def wait_for(self, piece: str, count: int = 1, timeout_s: float = 20.0) -> list[str]:
        async with asyncio.timeout(timeout_s):
            while sum(piece in line for line in self.lines) < count:
                line = await self._stream.readline()
                assert line, f"the server's stderr ended; it said: {self.lines}"
                self.lines.append(line.decode())
        return [line for line in self.lines if piece in line]


@contextlib.asynccontextmanager
async def serving_with_stderr(
    *args: str,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, StderrLines]]:
    """``replystream serve --port 0 ARGS`` ready: the process, its base URL and its stderr
    read as it comes; stopped when the block ends."""
    process = await launch(*args, stderr=asyncio.subprocess.PIPE)
    try:
        url = await ready_url(process)
        yield process, url, StderrLines(process)
    finally:
        await stop(process)
