"""Bearer-token API keys: who may call ``/v1/*``, and whose replies a caller may touch.

This file decides:
- Every ``/v1/*`` route, and the lab's ``/wait`` and ``/stream`` (which generate as they
  do), needs ``Authorization: Bearer <key>`` (or ``x-api-key``, as Anthropic's clients send
  it) once keys are configured; ``/healthz``, ``/metrics`` and the static pages do not. A
  missing or wrong key is a 401 in the API's error shape (``authentication_error`` /
  ``invalid_api_key``) with ``WWW-Authenticate: Bearer``.
- ``GET /v1/replies/{id}/stream`` (resume) also takes the key as ``?api_key=``, because
  ``EventSource`` cannot send headers. No other route does: a key in a URL ends up in logs.
  A request offering two different keys (in any of these places) is a 401.
- ``GET /v1/ws`` without an ``Authorization`` header is let through marked unauthenticated;
  the socket handler then wants the key in its first message (a browser's ``WebSocket``
  cannot send headers either). A wrong header is refused before the upgrade.
- A candidate key is compared with every configured key in constant time, without stopping
  at a match, so timing reveals neither which key matched nor how much of one did.
- ``request[OWNER]`` is the SHA-256 hex digest of the key; replies are owned by it, so
  resume and cancel work only with the key that started the reply. Keys are never logged.
- ``client_key`` is the caller's key itself, for a relay told to pass it on to an upstream.
It must not know about replies, engines or wire formats.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable

from aiohttp import web

from replystream.server.errors import error_response

RESUME_PATH = re.compile(r"^/v1/replies/[^/]+/stream$")
WEBSOCKET_PATH = "/v1/ws"
# The lab's routes generate as the API's do (a relay's with its upstream key): keyed alike.
LAB_PATHS = frozenset(("/wait", "/stream"))
OWNER = web.RequestKey("owner", str)  # who may read and cancel the replies a request starts
# The key a WebSocket sent in its first message (a browser's socket cannot send headers).
SOCKET_KEY = web.RequestKey("socket_key", str)


def key_owner(key: str) -> str:
    """The owner id of replies started with ``key`` (its SHA-256, hex): never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The configured keys; answers whether a candidate is one of them, in constant time.
    ``replace`` swaps them all at once (the keys file read again): a request checked after
    it needs one of the new keys; one already let through goes on."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = self._encoded(keys)

    @staticmethod
    def _encoded(keys: Iterable[str]) -> list[bytes]:
        encoded = [key.encode() for key in keys if key]
        if not encoded:
            raise ValueError("need at least one non-empty API key")
        return encoded

    def replace(self, keys: Iterable[str]) -> None:
        """Accept ``keys`` from now on, and no other.

        Raises:
            ValueError: there is no key among them (nothing changes).
        """
        self._keys = self._encoded(keys)

    def __repr__(self) -> str:
        return f"KeyRing({len(self._keys)} keys)"  # never the keys

    def accepts(self, candidate: str) -> bool:
        try:
            given = candidate.encode()
        except UnicodeEncodeError:
            # Header bytes that are not UTF-8 (aiohttp hands them over as surrogate escapes),
            # or a lone surrogate in a JSON string: no key is spelled so.
            return False
        matched = False
        for key in self._keys:  # every key, no early exit
            matched |= hmac.compare_digest(given, key)
        return matched


# Set on a WebSocket upgrade without a key: the socket handler must authenticate with this ring.
AUTH_PENDING = web.RequestKey("auth_pending", KeyRing)
# The application's keys, when it has any (so that they can be replaced while it serves).
KEY_RING = web.AppKey("key_ring", KeyRing)


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, "" if the header is malformed."""
    header = request.headers.get("Authorization")
    return None if header is None else _token_of(header)


def client_key(request: web.Request) -> str | None:
    """The caller's own key, as the check below reads it (its bearer token, else Anthropic's
    ``x-api-key``, else what its WebSocket sent first), for a relay that passes it on. Read
    whether or not keys are configured here: an upstream may be the one that checks it."""
    token = bearer_token(request) or request.headers.get("x-api-key") or request.get(SOCKET_KEY)
    return token or None


def offered_keys(request: web.Request) -> list[str]:
    """Every different key the request offers: its ``Authorization: Bearer`` headers ("" for
    a malformed one), its ``x-api-key`` headers (Anthropic's clients send their key this
    way) and, on a resume, its ``api_key`` query values. More than one is refused: which one
    would be meant is a guess, and the reply's owner with it."""
    offered = [_token_of(header) for header in request.headers.getall("Authorization", [])]
    offered += request.headers.getall("x-api-key", [])
    if request.method == "GET" and RESUME_PATH.match(request.path):
        offered += request.query.getall("api_key", [])
    return list(dict.fromkeys(offered))


def _token_of(header: str) -> str:
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def unauthorized(message: str) -> web.Response:
    response = error_response(401, message, code="invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def api_key_check(ring: KeyRing) -> Callable[[web.Request], web.Response | None]:
    """A check requiring one of ``ring``'s keys on every ``/v1/*`` route: None lets the
    request on, a response refuses it."""

    def check(request: web.Request) -> web.Response | None:
        path = request.path
        if not (path == "/v1" or path.startswith("/v1/") or path in LAB_PATHS):
            return None
        offered = offered_keys(request)
        if len(offered) > 1:
            return unauthorized(
                "The request offers more than one API key (in Authorization, x-api-key or "
                "api_key): send one."
            )
        token = offered[0] if offered else None
        if token is None and request.method == "GET" and path == WEBSOCKET_PATH:
            request[AUTH_PENDING] = ring
            return None
        if token is None:
            return unauthorized(
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
            )
        if not ring.accepts(token):
            return unauthorized("Incorrect API key provided.")
        request[OWNER] = key_owner(token)
        return None

    return check
