"""Limits for clients that misbehave: too many requests at once or a minute, slow bodies.

This file decides who may send how much. Identity is the API key's digest when auth is on
(``request[OWNER]``), else the client's address (``client_address``): the peer, or behind a
trusted proxy the address that proxy says it served. It must not know about replies. The
access log is ``access_log``'s; what a browser page may do, ``browser_guard``'s.

- ``ClientGate``: at most ``max_concurrent`` open requests and ``per_minute`` requests (a
  token bucket) per identity; a refusal is ``429`` with ``Retry-After``.
- Slow clients before the handler: a request whose headers take longer than
  ``header_timeout_s`` closes its connection (``server.connection``); a request body that
  does not arrive within ``body_timeout_s`` is a ``408``, and one whose ``Content-Length``
  is past the body limit a ``413`` before any of it is read (``read_body``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import time
from collections.abc import Callable, Sequence
from functools import partial

from aiohttp import web

from replystream import stalls
from replystream.server.auth import OWNER
from replystream.server.errors import HTTPAPIError, error_response
from replystream.server.guard_config import GuardConfig, Network

LIMITED_PREFIXES = ("/v1/", "/wait", "/stream")
# Requests that stop what a client runs, or read a stored response once: each is answered at
# once and frees room or holds none, so the cap on requests at once never refuses them (a
# client at its cap could not stop a background response otherwise); the rate counts them.
_STOPS = re.compile(r"^/v1/(?:replies|responses)/[^/]+/cancel$")
_STORED_RESPONSE = re.compile(r"^/v1/responses/[^/]+$")
# How often the rate buckets that have refilled are forgotten (one drained refills in a minute).
BUCKETS_SWEPT_EVERY_S = 60.0


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return address


# A proxy may write the port it was connected from beside the address (Azure's Application
# Gateway does): "203.0.113.1:5678", "[2001:db8::1]:4711" (or "[2001:db8::1]") name the
# address in them.
_WITH_PORT = re.compile(r"\s*(?:\[([^\]]+)\](?::\d{1,5})?|(\d{1,3}(?:\.\d{1,3}){3}):\d{1,5})\s*")


def _hop_address(hop: str) -> Address | None:
    """The address an ``X-Forwarded-For`` entry names, with or without a port."""
    with_port = _WITH_PORT.fullmatch(hop)
    return parse_address(with_port[1] or with_port[2] if with_port else hop)


def _trusted(address: Address | None, proxies: Sequence[Network]) -> bool:
    return address is not None and any(address in network for network in proxies)


def client_address(request: web.Request, proxies: Sequence[Network]) -> str:
    """Who sent the request: the peer, unless the peer is a trusted proxy; then the right-most
    address in ``X-Forwarded-For`` that is not itself a trusted proxy (each proxy appends
    the address it served, so entries left of that one are the client's word and may be
    forged). With no proxies listed the header is never read. An IPv4 peer of a dual-stack
    socket (``--host ::``), which it sees as ``::ffff:a.b.c.d``, is ``a.b.c.d``, as a proxy
    names it: one client, one identity."""
    peer = request.remote or "unknown"
    address = parse_address(peer)
    if not proxies or not _trusted(address, proxies):
        return peer if address is None else str(address)
    hops = [
        hop for header in request.headers.getall("X-Forwarded-For", ()) for hop in header.split(",")
    ]
    client = peer
    for hop in reversed(hops):
        address = _hop_address(hop)
        if address is None:
            break  # not an address: nothing left of it can be trusted either
        client = str(address)
        if not _trusted(address, proxies):
            break
    return client


GUARD_KEY = web.AppKey("guard", GuardConfig)


class BodyRoom:
    """The request-body bytes being read at once, over every connection, and their bound.

    A body is held in memory whole before it is parsed, and aiohttp holds about twice its
    size while it arrives: 200 uploads of 1 MiB each stalled one byte short took a server
    from 58 to 440 MiB, in 0.6 s of one client's sending (a container past its memory
    limit is killed, every stream with it). A body still arriving takes room for its
    ``Content-Length`` (or the body limit, chunked) until it is read; one that finds no room
    is refused before any of it is read, so it holds only what aiohttp buffered unasked (at
    most 128 KiB) until its connection closes. A body that has arrived whole takes no room:
    it is in memory already, and read at once.
    """

    def __init__(self, most: int) -> None:
        self.most = most  # 0: no bound
        self.taken = 0

    def take(self, size: int) -> bool:
        """Room for ``size`` bytes (True, counted until ``give_back``), or none (False)."""
        if self.most and self.taken + size > self.most and self.taken:
            return False  # (a lone body always fits: the body limit, not this, bounds it)
        self.taken += size
        return True

    def give_back(self, size: int) -> None:
        self.taken -= size


BODY_ROOM_KEY = web.AppKey("body_room", BodyRoom)


class ClientGate:
    """Open requests and a request-rate bucket per identity."""

    def __init__(self, max_concurrent: int, per_minute: int) -> None:
        self.max_concurrent = max_concurrent
        self.per_minute = per_minute
        self.open: dict[str, int] = {}
        # identity -> its replies running for no request: background, or detached
        self.unattended: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # identity -> (tokens, at)
        # Forgets the buckets that have refilled, whether or not more requests come: a quiet
        # server would otherwise keep one for every client of its last busy minute.
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def limits(self) -> bool:
        """Whether any limit is on (with none, requests need not be counted at all)."""
        return bool(self.max_concurrent or self.per_minute)

    def admit(self, identity: str, now: float) -> float | None:
        """None if the request may go on (and is counted open), else seconds to wait."""
        if self.max_concurrent and self.open.get(identity, 0) >= self.max_concurrent:
            return 1.0
        wait = self.spend(identity, now)
        if wait is not None:
            return wait
        self.open[identity] = self.open.get(identity, 0) + 1
        return None

    def spend(self, identity: str, now: float) -> float | None:
        """One request of ``identity``'s rate: None if it may go (counted), else seconds to
        wait. Each reply a WebSocket starts is one too (the socket is one open request, and
        each reply running beside its first one more: ``SocketRooms``)."""
        if not self.per_minute:
            return None
        rate = self.per_minute / 60.0
        tokens, at = self._buckets.get(identity, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - at) * rate)
        if tokens < 1.0:
            return (1.0 - tokens) / rate
        self._buckets[identity] = (tokens - 1.0, now)
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(BUCKETS_SWEPT_EVERY_S, self._forget_full_buckets)
        return None

    def hold_background(self, identity: str) -> Callable[[], None] | None:
        """Count a background response of ``identity``, which one of its open requests
        (this one) is starting: None if it has as many requests open and replies running
        unattended as ``max_concurrent``, else the function that frees it, to call once it
        ends. So a key held to N requests at once runs N background responses at most,
        besides its requests (a poll or a cancel of them needs no room of its own)."""
        if not self.max_concurrent:
            return _nothing
        running = self.unattended.get(identity, 0)
        if self.open.get(identity, 1) - 1 + running >= self.max_concurrent:
            return None
        return self._hold(identity, running)

    def hold_detached(self, identity: str) -> Callable[[], None] | None:
        """Count a reply ``identity`` left, still generating for its detach grace: None if it
        has as many replies running unattended (detached, or in the background) as
        ``max_concurrent``, else the function that frees it, to call once a reader joins it
        or it ends. Its client's resume is a request like any other, so the room the reply
        held is free again for it."""
        running = self.unattended.get(identity, 0)
        if running >= self.max_concurrent:
            return None
        return self._hold(identity, running)

    def _hold(self, identity: str, running: int) -> Callable[[], None]:
        self.unattended[identity] = running + 1
        return partial(_count_down, self.unattended, identity)

    def release(self, identity: str) -> None:
        _count_down(self.open, identity)

    def close(self) -> None:
        """The server is done: no more sweeps."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _forget_full_buckets(self) -> None:
        """Forget the buckets that have refilled: one carries nothing a new one would not.
        Their times are the front door's, ``time.monotonic``'s."""
        self._sweeper = None
        now, most, rate = time.monotonic(), float(self.per_minute), self.per_minute / 60.0
        for identity, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * rate >= most:
                del self._buckets[identity]
        if self._buckets:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(BUCKETS_SWEPT_EVERY_S, self._forget_full_buckets)


def _count_down(counts: dict[str, int], identity: str) -> None:
    """One less of ``identity``'s; an identity with none left is forgotten."""
    left = counts.get(identity, 0) - 1
    if left > 0:
        counts[identity] = left
    else:
        counts.pop(identity, None)


def _nothing() -> None:
    pass


class SocketRooms:
    """The room a WebSocket's replies take among its client's limits, as HTTP counts its
    requests: each reply is one more of --requests-per-minute; past the first running on the
    socket, one more of --max-concurrent-per-client (the socket is one open request, its
    first reply's), so a socket runs no more replies at once than its client could over
    HTTP. The room is given back as replies end."""

    def __init__(self, gate: ClientGate) -> None:
        self._gate = gate
        self._replies = 0  # replies counted and not over yet
        self._rooms: list[str] = []  # whom each room past the socket's own is counted against

    def admit(self, identity: str, now: float) -> float | None:
        """Count a reply about to start: None if it may (counted), else seconds to wait."""
        gate = self._gate
        another = bool(gate.max_concurrent and self._replies)
        wait = gate.admit(identity, now) if another else gate.spend(identity, now)
        if wait is not None:
            return wait
        if another:
            self._rooms.append(identity)
        self._replies += 1
        return None

    def reply_over(self) -> None:
        """A reply counted by ``admit`` is over: a socket holds as many rooms as it runs
        replies, and never fewer than its own."""
        self._replies -= 1
        if len(self._rooms) > max(0, self._replies - 1):
            self._gate.release(self._rooms.pop())

    def release_all(self) -> None:
        """The socket is done: every room it still holds is free."""
        while self._rooms:
            self._gate.release(self._rooms.pop())


# The server's one gate, for the routes that admit more than their request (a WebSocket's
# replies).
GATE_KEY = web.AppKey("client_gate", ClientGate)


# Whom the front door counted a request open against (``identity_of``), until its end.
ADMITTED = web.RequestKey("admitted_as", str)


def needs_no_room(request: web.Request) -> bool:
    """Whether the cap on a client's requests at once lets ``request`` by: a cancel, a
    delete of a stored response, a poll of one (not ``stream``, which follows its events)."""
    path, method = request.path, request.method
    if method == "POST":
        return _STOPS.match(path) is not None
    if method == "DELETE":
        return _STORED_RESPONSE.match(path) is not None
    if method == "GET":
        return _STORED_RESPONSE.match(path) is not None and "stream" not in request.query
    return False


def identity_of(request: web.Request) -> str:
    """Whom the limits count this request against: its API key, else its client's address."""
    owner = request.get(OWNER)
    if owner:
        return f"key:{owner}"
    return f"addr:{client_address(request, request.app[GUARD_KEY].trusted_proxies)}"


def count_as_owner(request: web.Request) -> float | None:
    """A WebSocket that gave its key in its first message was admitted as its address (no
    key was known at its upgrade): count it open against its key from now on, as a socket
    whose key came in a header is, so the key's limit holds and the address is free again.
    None if taken, else the seconds to wait: the key has as many requests open as it may."""
    before = request.get(ADMITTED)
    if before is None:  # no limits, or not counted
        return None
    after = identity_of(request)
    if after == before:
        return None
    gate = request.app[GATE_KEY]
    if gate.max_concurrent and gate.open.get(after, 0) >= gate.max_concurrent:
        return 1.0
    gate.release(before)
    gate.open[after] = gate.open.get(after, 0) + 1
    request[ADMITTED] = after
    return None


RATE_LIMITED = "too many requests from this client; retry later"


def hold_background(request: web.Request) -> Callable[[], None]:
    """Room for a background response among its client's requests at once (see
    ``ClientGate.hold_background``): the function that frees it, to call once it ends.

    Raises:
        HTTPAPIError: the ``429`` of a client with no room left.
    """
    release = request.app[GATE_KEY].hold_background(identity_of(request))
    if release is None:
        raise HTTPAPIError(
            429,
            "too many background responses and requests of this client at once; retry "
            "once one has ended",
            code="rate_limited",
            retry_after_s=1.0,
        )
    return release


def rate_limited(wait_s: float) -> web.Response:
    """The ``429`` for a request ``ClientGate.admit`` refused, with when to try again."""
    return error_response(429, RATE_LIMITED, code="rate_limited", retry_after_s=wait_s)


async def read_body(request: web.Request) -> bytes:
    """The request body, or a ``408`` (closing the connection) if it does not arrive within
    the body timeout.

    A body its ``Content-Length`` puts past the limit is refused on that header alone, as
    nginx's ``client_max_body_size`` refuses it: waiting for it would hold the client to an
    upload that can only be refused (or, for one that never comes, answer a ``408`` naming
    the wrong fault)."""
    codings = [
        coding.strip().lower()
        for header in request.headers.getall("Transfer-Encoding", ())
        for coding in header.split(",")
    ]
    if codings and codings != ["chunked"]:
        # aiohttp's parser takes ``gzip, chunked`` as plain chunks, so the gzip would be read
        # as the body itself. No transfer coding but chunked is decoded here.
        raise HTTPAPIError(
            400,
            "the request body's framing (Content-Length or Transfer-Encoding) is not valid",
            code="bad_body_framing",
            close_connection=True,
        )
    limit, declared = request.client_max_size, request.content_length
    if declared is not None and declared > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
    if request.content.is_eof():
        return await request.read()  # all of it has arrived: nothing to wait for, no timer
    room, size = request.app[BODY_ROOM_KEY], limit if declared is None else declared
    if not room.take(size):
        raise HTTPAPIError(
            503,
            "the server is reading as many request bodies at once as it holds room for; "
            "try again in a moment",
            code="server_busy",
            retry_after_s=1.0,
            close_connection=True,  # the body is left unread
        )
    timeout = request.app[GUARD_KEY].body_timeout_s
    try:
        # Back from a stall of this process (stopped, frozen), the body that came meanwhile
        # is read before it is judged late.
        async with stalls.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise HTTPAPIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="body_timeout",
            # The rest of the body may still come: on a kept-alive connection the next
            # request's bytes would be read as it. The connection ends with the answer.
            close_connection=True,
        ) from None
    finally:
        room.give_back(size)
