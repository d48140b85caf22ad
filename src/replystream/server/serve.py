"""Run an application on a socket; stop it gracefully on SIGINT or SIGTERM.

Shutdown order: stop accepting connections; let replies in flight finish for the grace period;
tell the rest to end with an in-band ``shutdown`` error (a buffered reply gets a 503); then
close connections. No stream is ever cut silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from replystream import start_hangup, start_interrupt
from replystream.server.connection import GuardedSockSite
from replystream.server.context import CONFIG_KEY, MANAGER_KEY
from replystream.server.listening import (
    HURRY_SIGNAL,
    LISTEN_BACKLOG,
    bind_socket,
    listening_lines,
    url_of,
)
from replystream.server.listening import announce as announce_lines
from replystream.server.server_config import ServerConfig
from replystream.server.socket_room import unacknowledged_limit_s

log = logging.getLogger("replystream.server")

# After the grace period: how long producers may take to stop, and then how long readers and
# WebSockets may take to send the endings and close (each closes itself within less).
STOP_TIMEOUT_S = 5.0
LAST_WORDS_TIMEOUT_S = 8.0
# How often a worker of ``--workers`` checks that the parent that started it is still there.
PARENT_CHECK_S = 1.0


class RunningServer:
    """An application listening on a socket."""

    def __init__(
        self,
        app: web.Application,
        runner: web.AppRunner,
        site: web.SockSite,
        url: str,
        sock: socket.socket,
    ):
        self.app = app
        self.runner = runner
        self.site = site
        self.url = url
        self.sock = sock
        self._grace: asyncio.Timeout | None = None  # while the grace runs
        self._grace_ended = False

    def end_grace(self) -> None:
        """Cut the grace short (a second SIGINT or SIGTERM: the operator will not wait): the
        replies still running are told ``shutdown`` in-band now, as at the grace's end."""
        if self._grace_ended:
            return
        self._grace_ended = True
        grace = self._grace
        if grace is not None and not grace.expired():
            log.warning("stopped again: the grace ends now")
            grace.reschedule(asyncio.get_running_loop().time())

    def stop_listening(self) -> None:
        """Close the listening socket, so a new connection is refused at once rather than
        queued by the kernel until the process exits (uvloop's accepting server leaves the
        socket to its owner; asyncio's closes it too: closing twice is harmless)."""
        self.sock.close()

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, give replies and the streams sending them ``grace_s`` to finish,
        then end the rest in-band and close every connection that carries replies, each
        within a bounded time."""
        await self.site.stop()
        self.stop_listening()
        manager = self.app[MANAGER_KEY]
        manager.stop_accepting()
        if (len(manager) or manager.readers) and not self._grace_ended:
            log.warning(
                "shutting down: %d replies in flight, %d streams being sent, %.1f s grace",
                len(manager),
                len(manager.readers),
                grace_s,
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s) as self._grace:
                    await manager.wait_drained()
            self._grace = None
        # Replies still running, and readers of replies made elsewhere, end with an error;
        # each WebSocket sends its replies' endings, then closes (1001).
        manager.shut_down()
        await manager.wait_stopped(STOP_TIMEOUT_S)
        await manager.wait_quiet(LAST_WORDS_TIMEOUT_S)


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host:port`` (0 picks a free port), or on a listening socket that
    another process opened (``--workers``); clean up on exit."""
    # handler_cancellation: a client that disconnects cancels its handler, which is how a
    # buffered request learns to stop generating (a streamed one also sees failed writes).
    # An app built without a config (tests, embedders) gets the config's defaults.
    config = app.get(CONFIG_KEY) or ServerConfig()
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=5.0,
        keepalive_timeout=config.guard.idle_timeout_s,
        max_line_size=config.max_header_bytes,
        max_field_size=config.max_header_bytes,
    )
    await runner.setup()
    sock = sock if sock is not None else bind_socket(host, port)
    try:
        site = GuardedSockSite(
            runner,
            sock,
            header_timeout_s=config.guard.header_timeout_s,
            backlog=LISTEN_BACKLOG,
            unacknowledged_s=unacknowledged_limit_s(config.policy.slow_client_s),
        )
        await site.start()
        yield RunningServer(app, runner, site, url_of(sock), sock)
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


# Young objects the collector lets pile up before it runs (CPython's default is 700). A server
# holding thousands of streams allocates fast and keeps most of it alive for the whole reply;
# with the default, full collections walked every live stream's objects several times a
# burst (80 ms each at 3,000 streams, stalling every stream). The cost: cyclic garbage is
# found later. A cycle caught young waits up to this many allocations; one that outlives a
# young collection waits for a middle one (every 10 young ones) or, older still, for a full
# collection (every 10 middle ones, and only once the old objects grew by a quarter). So a
# cycle with much memory behind it (a cancelled task's error holding the task's frames)
# is broken where it is made, not left to the collector.
GC_YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Freeze what start-up made (modules, the app: never garbage) out of every future
    collection, and collect young objects less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


async def serve_forever(
    app: web.Application,
    host: str,
    port: int,
    grace_s: float,
    sock: socket.socket | None = None,
    announce: Callable[[str], list[str]] | None = listening_lines,
    parent_pid: int | None = None,
    on_serving: Callable[[], None] | None = None,
    on_hangup: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, printing ``announce(url)`` on stdout once listening
    (tools read its first line); a worker serving an inherited socket passes None and stays
    quiet (its parent announces the URL once ``on_serving`` said so for every worker), and its
    parent's ``parent_pid``: it also stops, the same way, when that parent is gone. With
    ``on_hangup``, a SIGHUP calls it (and one that came while the server started, once it
    serves); else it stops the server as SIGTERM does (a terminal closed, or a reload asked
    of a server with nothing to read again, must not cut its replies without a word). A
    second SIGINT or SIGTERM while it stops ends the grace at once (in a worker,
    ``HURRY_SIGNAL`` from its parent does). Once stopped, the process ignores SIGHUP (a
    worker, SIGINT, SIGTERM and ``HURRY_SIGNAL`` too): it is about to exit."""
    stop = asyncio.Event()
    running: list[RunningServer] = []  # the server, once it serves

    def hurry() -> None:  # the stop, with no grace
        if running:
            running[0].end_grace()
        stop.set()

    def stop_or_hurry() -> None:
        # A second stop signal ends the grace. Not in a worker: a signal sent to the whole
        # group reaches it twice (from there and from its parent), one stop for the operator;
        # its parent's second is ``HURRY_SIGNAL``.
        if stop.is_set() and parent_pid is None:
            hurry()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_or_hurry)
    if parent_pid is not None:
        loop.add_signal_handler(HURRY_SIGNAL, hurry)
    if start_interrupt.interrupted():
        # A Ctrl-C during the start that some code swallowed: the start ends as it would
        # have (exit 130), before the port is announced.
        raise KeyboardInterrupt
    loop.add_signal_handler(signal.SIGHUP, on_hangup if on_hangup is not None else stop.set)
    async with serving(app, host, port, sock) as server:
        running.append(server)
        tune_collector()
        if announce is not None:
            announce_lines(announce(server.url))
        if on_serving is not None:
            on_serving()
        if on_hangup is not None and start_hangup.came():
            # A SIGHUP while it started (before the loop took the signal over): the files
            # may have been read before the edit it was sent for.
            on_hangup()
        if parent_pid is None:
            await stop.wait()
        else:
            await _until_stopped_or_orphaned(stop, parent_pid)
        await server.shutdown(grace_s)
    # Closing the loop would give each signal it handles its default back, the end of the
    # process, and one landing then would kill a server that stopped gracefully (a worker's
    # parent reports that as replies cut). A stopped server has no file to read again and
    # nothing left to stop, so it ignores SIGHUP (a reload sent as it stops, a terminal
    # closed after its Ctrl-C); a worker also the stop, which it is sent twice: by its
    # parent, and by whoever signalled the whole group (a terminal's Ctrl-C, systemd's
    # SIGTERM). (Held back while handlers change: removing the loop's gives the default back
    # for a moment, and one landing then would be that death; ignored, a held one is dropped.)
    stops = {signal.SIGHUP}
    if parent_pid is not None:
        stops |= {signal.SIGINT, signal.SIGTERM, HURRY_SIGNAL}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        for sig in stops:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


async def _until_stopped_or_orphaned(stop: asyncio.Event, parent_pid: int) -> None:
    """Wait for ``stop``, or until this process's parent is no longer ``parent_pid``: a
    worker whose parent was killed must not serve on unsupervised, holding the port (nobody
    would restart it or forward it a signal, and a new server could not listen there)."""
    while os.getppid() == parent_pid:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PARENT_CHECK_S):
                await stop.wait()
                return
    log.warning("the parent process %d is gone: shutting down", parent_pid)
