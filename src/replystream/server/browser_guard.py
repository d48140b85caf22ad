"""What a browser page may do here: CORS, pages of foreign sites, DNS rebinding.

This file decides which pages may call the server and read its answers: a preflight's
answer, the headers an allowed origin's page may send and read, the ``403`` of a request
a foreign site's page made, and of one that reached a loopback address under a name a
site could point there. It must not know about replies or limits.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence

from aiohttp import web

from replystream.server.access_log import REQUEST_ID
from replystream.server.errors import (
    ANTHROPIC_HEADER,
    UNROUTED,
    error_response,
    shared_route,
    speaks_anthropic,
)
from replystream.server.guard import GUARD_KEY


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
# it: the reply's and request's ids, and when to retry (the SDKs read ``Retry-After``,
# ``retry-after-ms`` and ``X-Should-Retry``; unexposed, a 429's wait is guessed and a 409
# retried all the same).
EXPOSED_HEADERS = (
    "X-Reply-Id, X-Request-Id, request-id, Retry-After, retry-after-ms, X-Should-Retry"
)
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
    unrouted = request.get(UNROUTED, False)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
        if speaks_anthropic(request.path, request.headers, unrouted=unrouted):
            # The name Anthropic's SDKs read; other routes keep their heads as small as before.
            response.headers["request-id"] = request_id
    if shared_route(request.path, unrouted=unrouted):
        # Its shape is chosen by a header: a cache between must keep the two apart.
        response.headers.add("Vary", ANTHROPIC_HEADER)
    origin = request.headers.get("Origin")
    origins = request.app[GUARD_KEY].cors_origins
    if origin is not None and origins and _allowed(origin, origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.headers.add("Vary", "Origin")  # beside any other (gzip's Accept-Encoding)
