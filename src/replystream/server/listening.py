"""The listening socket of ``serve``, what is said once it listens, and how a start is refused.

Apart from the serving loop (``server.serve``, which needs aiohttp and the app) so that the
command line, a port it cannot have included, is checked before the server loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any

log = logging.getLogger("replystream.server")

# Connections the kernel queues before we accept them. aiohttp's default (128) re-listens the
# socket with a small queue, and a burst of thousands of clients then overflows it: their
# SYNs are dropped and retried a second later.
LISTEN_BACKLOG = 4096
# The exit status of ``serve`` when its command line cannot be served (a bad value, a file it
# cannot use, a port it cannot have): a worker that exits with it would refuse again.
REFUSED_EXIT = 2
# What a ``--workers`` parent sends its serving workers on a second stop signal: end the grace
# now. Not the stop signal itself: a signal sent to the whole group (a terminal's Ctrl-C)
# reaches a worker twice, from there and from its parent, and must stop it once.
HURRY_SIGNAL = signal.SIGUSR1


def bind_socket(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port``; port 0 lets the kernel pick a free one.
    ``shared``: the port's holder for workers, bound and not listening, others bound to its
    address with ``also_listening`` (``SO_REUSEPORT``) listening in its place.

    Raises:
        ValueError: ``port`` is not 0 to 65535 (the resolver would take a negative one as a
            service name, and ``bind`` would wrap a large one around to another port).
        OSError: ``host`` does not resolve (``socket.gaierror``), or the address cannot be
            bound (in use, not this machine's, privileged).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0 to 65535, got {port}")
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return _bound(socket.socket(family, kind, proto), address, shared=shared, listens=not shared)


def also_listening(holder: socket.socket, *, listens: bool = True) -> socket.socket:
    """Another listening socket on ``holder``'s address (``bind_socket(shared=True)``): the
    kernel spreads new connections evenly over every such socket that listens, one per
    worker, instead of handing a burst to whichever worker woke first on one shared queue.
    Without ``listens`` it is only bound, and given no connection until its worker listens
    on it (the server does as it starts accepting)."""
    sock = socket.socket(holder.family, holder.type, holder.proto)
    return _bound(sock, holder.getsockname(), shared=True, listens=listens)


def _bound(sock: socket.socket, address: Any, *, shared: bool, listens: bool) -> socket.socket:
    """``sock`` bound to ``address`` (with ``SO_REUSEPORT`` when ``shared``), listening if
    ``listens``, non-blocking; closed if it cannot be."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listens:
            sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """The URL clients reach the listening ``sock`` at: an IPv6 address in brackets, a
    link-local one with its zone (``http://[fe80::1%25eth0]:8000``, RFC 6874), without which
    it names no interface and cannot be connected to."""
    address = sock.getsockname()
    host, port = address[:2]
    if ":" in host:
        scope = address[3] if len(address) > 3 else 0
        if scope and "%" not in host:
            try:
                host += "%25" + socket.if_indextoname(scope)
            except OSError:  # an interface gone since: its number is a zone too
                host += f"%25{scope}"
        host = f"[{host}]"
    return f"http://{host}:{port}"


def listening_lines(url: str) -> list[str]:
    """What a server prints on stdout once it accepts connections. Tools read the first line
    (``replystream listening on URL``, nothing after the URL); anything else goes below it."""
    return [f"replystream listening on {url}"]


def announce(lines: list[str]) -> None:
    """Print ``lines`` on stdout, once listening. A stdout that cannot be written (a log file
    on a full disk, a reader gone) is told on stderr in one line, and serving goes on: what is
    served does not depend on it. Its unwritten bytes go nowhere (else they would fail again
    at exit)."""
    try:
        print("\n".join(lines), flush=True)
    except OSError as exc:
        log.warning(
            "serving, but stdout cannot be written (the address was not printed): %s",
            (exc.strerror or str(exc)).lower(),
        )
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # for the rest of the process
