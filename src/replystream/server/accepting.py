"""Accepting connections on any loop: every one waiting, each time the socket is readable.

uvloop's own server accepts one connection per turn of its loop (libuv does since 1.45:
"unix: don't accept() connections in a loop"). Under a burst of new connections, while the
first ones' requests start, each turn is long, and the rest wait in the kernel's queue one
turn each: measured, 261 of a burst of 500 relayed requests were accepted one at a time over
695 ms, and their first chunks waited for that (docs/performance.md). asyncio's own loop
accepts up to its backlog per turn. This server does what asyncio's does, on any loop: when
the listening socket is readable, it accepts every connection waiting (at most its backlog)
and hands each to the loop (``connect_accepted_socket``), whose transport and protocol are
then the loop's own.

Out of file descriptors (or memory), accepting pauses for ``ACCEPT_RETRY_S`` and says so in
one line. asyncio's own server pauses too, but logs a traceback for each accept it tries
meanwhile (it goes on through its backlog after the first fails, and schedules a restart for
each): tens of thousands of lines in a few seconds of shortage, so the server uses this one
on asyncio's loop as well. A connection that fails before it is handed over is
closed; one accepted before the server closes is still handed over.

Each connection is set up for a stream to a client over a real network: no Nagle delay on
small writes (``TCP_NODELAY``), and, given ``unacknowledged_s``, a bound on how long what it
sends may go unacknowledged before the kernel drops it (``TCP_USER_TIMEOUT``), with
keep-alive probes (``SO_KEEPALIVE``) so that the bound holds for a connection with nothing
to send too (a request waiting for a reply that is not streamed): a client gone without a
FIN or a reset is then lost as one that closed, instead of after the quarter of an hour of
the system's retries, or never. It must not know about HTTP.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import weakref
from collections.abc import Callable

log = logging.getLogger("replystream.server")

ACCEPT_RETRY_S = 1.0  # asyncio's own pause when accept() runs out of a resource
# Linux's (and Android's); elsewhere a vanished peer is left to the system's own retries.
TCP_USER_TIMEOUT: int | None = getattr(socket, "TCP_USER_TIMEOUT", None)
TCP_KEEPIDLE: int | None = getattr(socket, "TCP_KEEPIDLE", None)
# Keep-alive probes on a silent connection, this many to the limit: the kernel drops it at
# the first probe due once the peer has been silent for the limit.
PROBES_PER_LIMIT = 3
# The largest values Linux takes: a keep-alive period (MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL)
# and TCP_USER_TIMEOUT's milliseconds (an int). A longer limit is held to them: past them
# the kernel refused the option at every accept, and no connection was served.
MAX_PROBE_S = 32_767
MAX_USER_TIMEOUT_MS = 2**31 - 1
OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class BatchAcceptingServer(asyncio.AbstractServer):
    """A listening socket whose waiting connections are all accepted each time it is
    readable, each made a connection of ``factory``'s protocol by the loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        backlog: int,
        unacknowledged_s: float | None = None,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = factory
        self._backlog = backlog  # every connection the kernel may hold, in one turn
        # How long what a connection sends may stay unacknowledged before the kernel drops
        # it (None: as long as the system's retries last, a quarter of an hour on Linux).
        self._user_timeout_ms = (
            None
            if unacknowledged_s is None or TCP_USER_TIMEOUT is None
            else max(1, round(min(unacknowledged_s, MAX_USER_TIMEOUT_MS / 1000) * 1000))
        )
        # And the period of the kernel's keep-alive probes (whole seconds), which a silent
        # connection needs for the same limit to apply: one waiting for a reply not streamed.
        self._probe_s = (
            None
            if unacknowledged_s is None or TCP_KEEPIDLE is None
            else min(MAX_PROBE_S, max(1, int(unacknowledged_s / PROBES_PER_LIMIT)))
        )
        self._handing: set[asyncio.Task[None]] = set()  # connections not handed over yet
        self._clients: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()  # handed over
        self._paused: asyncio.TimerHandle | None = None
        self._serving = True
        self._closed: asyncio.Future[None] = loop.create_future()
        sock.setblocking(False)
        sock.listen(backlog)
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self._backlog):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up before we accepted it
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:
                    raise
                self._pause(exc)
                return
            self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._user_timeout_ms is not None and TCP_USER_TIMEOUT is not None:
                conn.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, self._user_timeout_ms)
                if self._probe_s is not None and TCP_KEEPIDLE is not None:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    conn.setsockopt(socket.IPPROTO_TCP, TCP_KEEPIDLE, self._probe_s)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self._probe_s)
        task = self._loop.create_task(self._connect(conn))
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            transport, _ = await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # reset before it was handed over: nothing was read
            log.debug("a connection failed before it was served: %r", exc)
            conn.close()
        except asyncio.CancelledError:  # the loop itself ending
            conn.close()
            raise
        else:
            self._clients.add(transport)  # until it is freed

    def _pause(self, exc: OSError) -> None:
        log.warning(
            "accepting connections paused for %g s: %s",
            ACCEPT_RETRY_S,
            (exc.strerror or str(exc)).lower(),
        )
        self._loop.remove_reader(self._sock.fileno())
        self._paused = self._loop.call_later(ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    # -- asyncio.AbstractServer ----------------------------------------------------------

    def close(self) -> None:
        """Stop accepting (the socket stays open: its owner closes it). Connections already
        accepted are still handed over, as asyncio's server lets them be: a shutdown answers
        their requests as it answers any (refused in the API's shape), not cut unanswered."""
        if not self._serving:
            return
        self._serving = False
        self._closed.set_result(None)
        if self._paused is not None:
            self._paused.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        """Serving starts when it is made."""

    async def serve_forever(self) -> None:
        await asyncio.shield(self._closed)

    def close_clients(self) -> None:
        """Close every connection handed over that is still open (asyncio's servers have
        this since Python 3.13)."""
        for transport in list(self._clients):
            if not transport.is_closing():
                transport.close()

    def abort_clients(self) -> None:
        """Abort every connection handed over that is still open, unsent data dropped."""
        for transport in list(self._clients):
            if not transport.is_closing():
                transport.abort()

    async def wait_closed(self) -> None:
        if self._handing:
            await asyncio.gather(*self._handing, return_exceptions=True)
