"""Start ``replystream serve`` in a child process on a free loopback port, for tools to measure.

A separate process keeps the server's event loop apart from the measuring client's, as it would
be in production, so client-side parsing cannot delay the server's timers or the reverse.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

READY_PREFIX = "replystream listening on "
READY = re.compile(re.escape(READY_PREFIX) + r"(\S+)")
PASS_ON_END_S = 2.0  # how long a stopped child's stderr may stay open after it has ended


@dataclass(frozen=True, slots=True)
class LocalServer:
    """A running ``replystream serve`` child: its base URL and process id."""

    url: str
    pid: int


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def _ended_with_parent() -> Callable[[], None] | None:
    """What a child runs before its program (Linux): be sent SIGTERM when this process ends,
    however it ends (a SIGTERM or SIGHUP Python does not catch, a SIGKILL), so a server
    started for a tool never outlives it. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def in_child() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent ended before the request took hold
            os._exit(1)

    return in_child


def owned_child() -> dict[str, Any]:
    """Keyword arguments of ``subprocess.Popen`` (and ``create_subprocess_exec``, uvloop's
    too) for a process a tool starts and stops itself. In a session of its own: a terminal's
    Ctrl-C goes to its whole foreground process group, and a server that got it too would
    stop on its own, logging as it does, while the tool stops it anyway. And ended with the
    tool (Linux), should the tool end without stopping it."""
    return {"start_new_session": True, "preexec_fn": _ended_with_parent()}


async def _pass_on(stream: asyncio.StreamReader, quiet: asyncio.Event) -> None:
    """Write what a child writes to its stderr to ours until ``quiet`` is set, then read the
    rest to its end unwritten (a child must never block on a full pipe)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while data := await stream.read(1 << 16):
        if not quiet.is_set():
            try:
                sys.stderr.write(decoder.decode(data))
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr closed, or its reader gone
                quiet.set()


@contextlib.asynccontextmanager
async def announced_process(
    command: Sequence[str],
    ready: re.Pattern[str],
    *,
    name: str,
    ready_timeout_s: float = 30.0,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[LocalServer]:
    """Run ``command``, wait for a stdout line matching ``ready`` (group 1: the URL); yield
    the URL and pid; stop it on exit. A child that exits before it is ready, or while in
    use, is an error: measuring a dead server would report nonsense. What the child writes to
    its stderr is written to ours, but for what it says while the tool, interrupted (Ctrl-C),
    stops it: the replies it was still sending, its own stop, when the operator asked for the
    tool to stop and is told so in one line. A tool that takes Ctrl-C as "stop and report"
    ends its work normally: ``interrupt``, set by then, says it was interrupted all the
    same."""
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, **owned_child()
    )
    assert process.stdout is not None and process.stderr is not None
    quiet = asyncio.Event()
    passing = asyncio.create_task(_pass_on(process.stderr, quiet))
    try:
        try:
            async with asyncio.timeout(ready_timeout_s):
                while True:
                    line = (await process.stdout.readline()).decode()
                    if not line:
                        status = await process.wait()
                        raise RuntimeError(f"{name} exited with status {status} before ready")
                    found = ready.search(line)
                    if found:
                        break
        except TimeoutError:
            raise RuntimeError(f"{name} was not ready within {ready_timeout_s:g} s") from None
        yield LocalServer(found.group(1), process.pid)
        if process.returncode is not None:
            raise RuntimeError(f"{name} died while in use (status {process.returncode})")
    except (asyncio.CancelledError, KeyboardInterrupt):
        quiet.set()
        raise
    finally:
        if interrupt is not None and interrupt.is_set():
            quiet.set()
        await stop_process(process)
        # To its end, so that a child's last words come before the tool's; the pipe may be
        # held open a little longer by its own children (a server's workers).
        await asyncio.wait({passing}, timeout=PASS_ON_END_S)
        passing.cancel()


@contextlib.asynccontextmanager
async def serve_process(
    args: Sequence[str],
    *,
    ready_timeout_s: float = 30.0,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[LocalServer]:
    """Run ``replystream serve --port 0 ARGS``; yield its URL and pid; stop it on exit (told
    nothing of its stop once ``interrupt`` is set)."""
    command = [sys.executable, "-m", "replystream", "serve", "--host", "127.0.0.1"]
    async with announced_process(
        [*command, "--port", "0", *args],
        READY,
        name="replystream serve",
        ready_timeout_s=ready_timeout_s,
        interrupt=interrupt,
    ) as server:
        yield server


@contextlib.asynccontextmanager
async def local_server(
    args: Sequence[str],
    *,
    ready_timeout_s: float = 30.0,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[str]:
    """Run ``replystream serve --port 0 ARGS`` and yield its base URL; stop it on exit (told
    nothing of its stop once ``interrupt`` is set).

    The engine is the simulated one unless ARGS choose another: lab tools need its schedule.
    """
    if "--engine" not in args:
        args = ["--engine", "simulated", *args]
    async with serve_process(args, ready_timeout_s=ready_timeout_s, interrupt=interrupt) as server:
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
