"""Limits for clients that misbehave: too many requests, slow requests, foreign origins.

This file decides who may send how much, and stamps every response with a request id that
also names it in the server's structured access log. Identity is the API key's digest when
auth is on (``request[OWNER]``), else the client's address (``client_address``): the peer,
or behind a trusted proxy the address that proxy says it served. It must not know about
replies.

- ``ClientGate``: at most ``max_concurrent`` open requests and ``per_minute`` requests (a
  token bucket) per identity; a refusal is ``429`` with ``Retry-After``.
- Slow clients before the handler: a request whose headers take longer than
  ``header_timeout_s`` closes its connection (``server.connection``); a request body that
  does not arrive within ``body_timeout_s`` is a ``408``, and one whose ``Content-Length``
  is past the body limit a ``413`` before any of it is read (``read_body``).
- CORS: origins on the allow-list get the headers the chat page needs; others get none.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from aiohttp import web

from replystream.server import ids
from replystream.server.auth import OWNER
from replystream.server.errors import (
    ANTHROPIC_HEADER,
    HTTPAPIError,
    error_response,
    shared_route,
    speaks_anthropic,
)
from replystream.server.guard_config import GuardConfig, Network

access_log = logging.getLogger("replystream.access")

LIMITED_PREFIXES = ("/v1/", "/wait", "/stream")
# Requests that stop what a client runs, or read a stored response once: each is answered at
# once and frees room or holds none, so the cap on requests at once never refuses them (a
# client at its cap could not stop a background response otherwise); the rate counts them.
_STOPS = re.compile(r"^/v1/(?:replies|responses)/[^/]+/cancel$")
_STORED_RESPONSE = re.compile(r"^/v1/responses/[^/]+$")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(text: str) -> Address | None:
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
    return _address(with_port[1] or with_port[2] if with_port else hop)


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
    address = _address(peer)
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
REQUEST_ID = web.RequestKey("request_id", str)
REPLY_ID = web.RequestKey("reply_id", str)  # set by routes that start or follow a reply


class Account(Protocol):
    """What a request that starts or reads a reply keeps of it: where the bytes of a body it
    is answered with whole count (the front door counts them as they go out, gzipped or not),
    and how the request ended, for its access-log line."""

    def on_send(self, nbytes: int, events: int = 1) -> None: ...

    def how_ended(self) -> tuple[str | None, str | None]:
        """The request's outcome (``metrics.RequestOutcome``; None: it has none, having read
        a reply without following it to its end) and its reason (None: none)."""
        ...


class SocketReplyLine(Protocol):
    """A WebSocket's ``reply`` message, as its own access-log line tells it (the socket's
    request has one line for the socket, and one for each such message)."""

    @property
    def tag(self) -> str | None:
        """The client's tag for it (None: refused before its tag was read)."""
        ...

    @property
    def asked_at(self) -> float:
        """When its message came (``time.monotonic``)."""
        ...

    @property
    def line_status(self) -> int | str:
        """Its status, as the same request over HTTP would have it."""
        ...

    @property
    def reply_id(self) -> str | None: ...

    @property
    def sent(self) -> tuple[int, int] | None:
        """The events and bytes its reply sent (None: nothing counted)."""
        ...

    def how_ended(self) -> tuple[str | None, str | None] | None:
        """Its reply's outcome and reason, as ``Account.how_ended``; None: it made none."""
        ...


ACCOUNT = web.RequestKey("account", Account)  # set by the routes that start or read a reply
# Set once a request was upgraded to a WebSocket: its status is 101 however the socket ends
# (aiohttp cancels the handler when the peer's connection goes, before it returns).
UPGRADED = web.RequestKey("upgraded", bool)
# A WebSocket's ``reply`` messages so far, for its access-log line (``log_access``).
SOCKET_REPLIES = web.RequestKey("socket_replies", int)


class ClientGate:
    """Open requests and a request-rate bucket per identity."""

    def __init__(self, max_concurrent: int, per_minute: int) -> None:
        self.max_concurrent = max_concurrent
        self.per_minute = per_minute
        self.open: dict[str, int] = {}
        # identity -> its replies running for no request: background, or detached
        self.unattended: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # identity -> (tokens, at)
        self._admits = 0

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
        each reply running beside its first one more: ``websocket.Session._admit``)."""
        if not self.per_minute:
            return None
        rate = self.per_minute / 60.0
        tokens, at = self._buckets.get(identity, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - at) * rate)
        if tokens < 1.0:
            return (1.0 - tokens) / rate
        self._buckets[identity] = (tokens - 1.0, now)
        self._admits += 1
        if self._admits % 1024 == 0:
            self._forget_full_buckets(now)
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

    def _forget_full_buckets(self, now: float) -> None:
        # A bucket that has refilled completely carries no state worth keeping.
        full_after = 60.0
        for identity, (_, at) in list(self._buckets.items()):
            if now - at >= full_after:
                del self._buckets[identity]


def _count_down(counts: dict[str, int], identity: str) -> None:
    """One less of ``identity``'s; an identity with none left is forgotten."""
    left = counts.get(identity, 0) - 1
    if left > 0:
        counts[identity] = left
    else:
        counts.pop(identity, None)


def _nothing() -> None:
    pass


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


def assign_request_id(request: web.Request) -> str:
    """Give the request an id: the client's ``X-Request-Id`` if sane, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _REQUEST_ID.match(given) else ids.request_id()
    request[REQUEST_ID] = request_id
    return request_id


def log_access(request: web.Request, request_id: str, status: int | str, started: float) -> None:
    """The request's one structured access-log line (a WebSocket's says how many ``reply``
    messages it took, ``replies``: each has a line of its own, ``log_socket_reply``)."""
    line = _line(request, request_id, status, started, request.get(REPLY_ID))
    line |= _how_ended(request.get(ACCOUNT))
    replies = request.get(SOCKET_REPLIES)
    if replies is not None:
        line["replies"] = replies
    access_log.info("%s", json.dumps(line))


def log_socket_reply(request: web.Request, message: SocketReplyLine) -> None:
    """The access-log line of one ``reply`` message of a WebSocket, once it has ended: the
    line its request would have had over HTTP, under the socket's request id, with the
    client's ``tag`` for it and what its reply sent (``events``, ``bytes``; null: nothing
    counted, a message refused before its reply began)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    request_id = request.get(REQUEST_ID, "")
    line = _line(request, request_id, message.line_status, message.asked_at, message.reply_id)
    ended = message.how_ended()
    outcome, reason = (None, None) if ended is None else ended
    events, nbytes = (None, None) if message.sent is None else message.sent
    line |= {"outcome": outcome, "reason": reason, "tag": message.tag}
    line |= {"events": events, "bytes": nbytes}
    access_log.info("%s", json.dumps(line))


def _line(
    request: web.Request, request_id: str, status: int | str, started: float, reply_id: str | None
) -> dict[str, object]:
    """The fields every access-log line of a request begins with."""
    return {
        "request_id": request_id,
        "method": request.method,
        "path": request.path,
        "status": status,
        "ms": round((time.monotonic() - started) * 1000.0, 1),
        "client": client_address(request, request.app[GUARD_KEY].trusted_proxies),
        "reply_id": reply_id,
    }


def _how_ended(account: Account | None) -> dict[str, object]:
    """The access-log fields that say how a request's reply ended (null: it made none)."""
    if account is None:
        return {"outcome": None, "reason": None}
    outcome, reason = account.how_ended()
    return {"outcome": outcome, "reason": reason}


def log_refused(client: str | None, status: int, code: str) -> None:
    """The access-log line of a request the HTTP parser refused before any route saw it: no
    request id, method or path of its own (none could be read), and why (``refused``)."""
    if access_log.isEnabledFor(logging.INFO):
        line: dict[str, object] = {"request_id": None, "method": None, "path": None}
        address = None if client is None else _address(client)
        shown = client if address is None else str(address)  # as ``client_address`` names it
        line |= {"status": status, "ms": None, "client": shown, "reply_id": None}
        line |= {"outcome": None, "reason": None}
        line["refused"] = code
        access_log.info("%s", json.dumps(line))


def preflight_response(request: web.Request, origins: Sequence[str]) -> web.Response | None:
    """The answer to a CORS preflight (a ``403`` for origins not allowed); None otherwise."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    origin = request.headers.get("Origin")
    if origin is None or not _allowed(origin, origins):
        return error_response(403, "origin not allowed", code="cors_forbidden")
    requested = request.headers.get("Access-Control-Request-Headers", "")
    return web.Response(
        status=204,
        headers={
            # DELETE: of a stored response (``DELETE /v1/responses/{id}``).
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Allow-Headers": _allowed_headers(requested),
            "Access-Control-Max-Age": "600",
            "Vary": "Access-Control-Request-Headers",
        },
    )


# The answer's headers a page of an allowed origin may read, besides those CORS always lets
# it: the reply's and request's ids, and when to retry (the SDKs read ``Retry-After`` and
# ``X-Should-Retry``; unexposed, a 429's wait is guessed and a 409 retried all the same).
EXPOSED_HEADERS = "X-Reply-Id, X-Request-Id, request-id, Retry-After, X-Should-Retry"
ALLOWED_HEADERS = ("Authorization", "Content-Type", "Last-Event-ID", "X-Request-Id")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")


def _allowed_headers(requested: str) -> str:
    """The headers a page of an allowed origin may send: ours, and those its preflight asks
    for (the SDKs send their own: Anthropic's ``x-api-key`` and ``anthropic-version``,
    OpenAI's ``x-stainless-*``), when they are header names; the key is a bearer token a page
    sends itself, never a cookie, so naming more headers lets no page do more."""
    names = [name.strip() for name in requested.split(",") if name.strip()]
    if len(names) > 64 or not all(_HEADER_NAME.match(name) for name in names):
        names = []
    known = {name.lower() for name in ALLOWED_HEADERS}
    return ", ".join([*ALLOWED_HEADERS, *(n for n in names if n.lower() not in known)])


def _allowed(origin: str, origins: Sequence[str]) -> bool:
    return "*" in origins or origin in origins


def _host_name(authority: str) -> str:
    """The host of ``HOST[:PORT]`` (an IPv6 address in brackets kept whole), lower-cased."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority.partition("]")[0] + "]"
    return authority.rpartition(":")[0] if authority.count(":") == 1 else authority


# DNS rebinding: a site's page, its name then pointed at 127.0.0.1, is to the browser of the
# same origin as a server on this machine, which then lets the page read every answer (its
# ``Origin`` and the request's ``Host`` agree, so ``foreign_origin`` takes it). Such a name is
# a public one; the names a connection to a loopback address is taken for are those no site
# can point: IP addresses, names of one label (``localhost``, this machine's), the suffixes
# reserved for local use, this machine's own name, and ``--allowed-host``'s.
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
_MACHINE_NAME = socket.gethostname().lower()


def _loopback(address: str) -> bool:
    return address.startswith(("127.", "::ffff:127.")) or address == "::1"


def local_name(name: str, allowed: Sequence[str]) -> bool:
    """Whether ``name`` (a ``Host``'s, lower-cased, its port left out) is one a request
    reaching this server at a loopback address may give: see ``LOCAL_SUFFIXES``."""
    name = name.removesuffix(".")
    if "." not in name or name.startswith("[") or name.endswith(LOCAL_SUFFIXES):
        return True
    if name.replace(".", "").isdigit() or name == _MACHINE_NAME or name in allowed:
        return True
    return any(
        entry == "*" or (entry.startswith("*.") and name.endswith(entry[1:])) for entry in allowed
    )


def rebinding_refusal(request: web.Request, allowed: Sequence[str]) -> web.Response | None:
    """The ``403`` of a request that reached a loopback address of this server for a name
    that is not a local one (``local_name``); None for any other."""
    transport = request.transport
    local = None if transport is None else transport.get_extra_info("sockname")
    if type(local) is not tuple or not _loopback(local[0]):
        return None  # reached over a network, or a Unix socket: names are not this check's
    host = request.headers.get("Host")
    if not host:
        return None
    name = _host_name(host)
    if local_name(name, allowed):
        return None
    message = (
        f"this server takes requests for {name!r} only when started with --allowed-host "
        f"{name}: reached at a loopback address, it takes local names (IP addresses, "
        "localhost), not a site's, which a page of that site could use once its name points "
        "here"
    )
    return error_response(403, message, code="host_not_allowed")


def foreign_page_refusal(request: web.Request) -> web.Response | None:
    """The ``403`` of a request a page of a foreign origin made (``foreign_origin``); None
    for any other. The browser would not let the page read the answer, but the request would
    still have been served: a reply made (on a relay, on its upstream key), a response
    deleted, by any site its user visits. A WebSocket it would even let the page read."""
    origin = foreign_origin(request)
    if origin is None:
        return None
    message = (
        f"a page from {origin[:100]!r} may not call this server: the origin is not this "
        "server's, nor one --cors-origin allows"
    )
    return error_response(403, message, code="cors_forbidden")


def foreign_origin(request: web.Request) -> str | None:
    """The ``Origin`` of a browser page from another site, that ``--cors-origin`` does not
    allow; None for a request without one (not a browser's), a page of this server's own
    host (as the request's ``Host`` names it: the port is left out, since a proxy may send
    ``$host`` alone), or an allowed one."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    origins = request.app[GUARD_KEY].cors_origins
    if _allowed(origin, origins):
        return None
    scheme, _, authority = origin.partition("://")
    if scheme in ("http", "https") and authority and "/" not in authority:
        if _host_name(authority) == _host_name(request.host):
            return None
    return origin


async def stamp_response(request: web.Request, response: web.StreamResponse) -> None:
    """Before headers leave (streams included): the request id and CORS headers."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
        if speaks_anthropic(request.path, request.headers):
            # The name Anthropic's SDKs read; other routes keep their heads as small as before.
            response.headers["request-id"] = request_id
    if shared_route(request.path):
        # Its shape is chosen by a header: a cache between must keep the two apart.
        response.headers.add("Vary", ANTHROPIC_HEADER)
    origin = request.headers.get("Origin")
    origins = request.app[GUARD_KEY].cors_origins
    if origin is not None and origins and _allowed(origin, origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.headers.add("Vary", "Origin")  # beside any other (gzip's Accept-Encoding)


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
    timeout = request.app[GUARD_KEY].body_timeout_s
    try:
        async with asyncio.timeout(timeout):
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
