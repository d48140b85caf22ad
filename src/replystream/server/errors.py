"""The error shape every replystream endpoint answers with.

Errors before a response starts are HTTP statuses with a JSON body
``{"error": {"message", "type", "param", "code"}}`` (the shape OpenAI-compatible clients read).
Errors after a stream started are in-band events built from the same fields. The Anthropic
routes (``/v1/messages``; ``/v1/models`` asked with ``anthropic-version``) answer the same
errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"},
"request_id"}`` (with our ``code`` and ``param`` beside them): ``in_route_shape`` rewrites
any error response of ours for it, whoever made it.
A refusal that knows when the client may try again (a 429 or 503) says so in ``Retry-After``,
whichever route's shape it takes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web

from replystream.delivery.error_types import (
    ANTHROPIC_OVERLOADED,
    anthropic_error_type,
    anthropic_status,
    openai_error_type,
)


def error_body(
    message: str, *, code: str, status: int = 500, param: str | None = None
) -> dict[str, Any]:
    """The JSON error object for ``status``, typed as OpenAI types its own
    (``openai_error_type``)."""
    kind = openai_error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Where an error response keeps its fields, to be written in another route's shape.
API_ERROR = web.ResponseKey("api_error", tuple)
ANTHROPIC_PATHS = ("/v1/messages",)
# Routes both APIs have: Anthropic's when the client says it speaks it, as its SDKs always do.
SHARED_PATHS = ("/v1/models",)
ANTHROPIC_HEADER = "anthropic-version"
# Set on a request no route serves (its path, or its method there): it belongs to neither API,
# so, as on a shared route, its ``anthropic-version`` chooses the shape of its 404 or 405 (an
# Anthropic SDK asking for an endpoint this server lacks, its Files API say, reads its own).
UNROUTED = web.RequestKey("unrouted", bool)


def shared_route(path: str, *, unrouted: bool = False) -> bool:
    """Whether ``path`` is on a route both APIs have, or (``unrouted``) on none: answered in
    the shape its request's ``anthropic-version`` header chooses."""
    if unrouted:
        return True
    return path in SHARED_PATHS or path.startswith(tuple(f"{p}/" for p in SHARED_PATHS))


def speaks_anthropic(path: str, headers: Mapping[str, str], *, unrouted: bool = False) -> bool:
    """Whether a request is answered in Anthropic's shape: on its routes, and on the routes
    both APIs have (``/v1/models``) or none (``unrouted``) when it carries
    ``anthropic-version``."""
    if path.startswith(ANTHROPIC_PATHS):
        return True
    return shared_route(path, unrouted=unrouted) and ANTHROPIC_HEADER in headers


# Anthropic's own codes for a refusal, which its SDKs read in ``error.details.error_code``
# to choose the error's class and what to do next: on ``thread_unsupported_request`` the tool
# runner goes on without a server-held conversation. Our other codes are not Anthropic's, and
# are given only beside its fields, as ``code``.
ANTHROPIC_DETAIL_CODES = frozenset({"thread_unsupported_request"})

# The wait in milliseconds, beside ``Retry-After``'s whole seconds, as OpenAI's API sends it:
# the openai and anthropic SDKs read it first, so a rate's wait of 0.1 s is not slept as 1 s.
RETRY_AFTER_MS = "retry-after-ms"
# Whatever kind of response ``in_route_shape`` is given, it gives back (or a reshaped one).
AnyResponse = TypeVar("AnyResponse", bound=web.StreamResponse)
_KEPT_HEADERS = (
    "Allow",
    "Retry-After",
    RETRY_AFTER_MS,
    "WWW-Authenticate",
    "X-Reply-Id",
    "X-Should-Retry",
)
# The longest ``Retry-After`` a client's SDK is left to sleep through before asking again: the
# openai SDK's own bound (past it, it gives up). The anthropic SDK has none: told an hour (an
# upstream's quota, passed on), it would hang its caller for an hour before each of its two
# retries. Past this, ``X-Should-Retry: false`` tells both to hand the refusal to their caller.
RETRY_WAIT_LIMIT_S = 120.0


def retry_after_value(wait_s: float) -> str:
    """The ``Retry-After`` for a wait of ``wait_s`` seconds: delay-seconds, whole and rounded
    up (earlier, the client would be refused again), at least 1 (0 invites a retry at once)."""
    return str(max(1, math.ceil(wait_s)))


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    retry_after_s: float | None = None,
    lasting: bool = False,
) -> web.Response:
    """An HTTP error in the API's own format; with ``retry_after_s``, when to try again;
    ``lasting``: asking again does not help (``EngineError.lasting``)."""
    body = json.dumps(error_body(message, code=code, status=status, param=param))
    response = web.Response(status=status, text=body, content_type="application/json")
    response[API_ERROR] = (message, code, param)
    if retry_after_s is not None:
        response.headers["Retry-After"] = retry_after_value(retry_after_s)
        response.headers[RETRY_AFTER_MS] = str(max(1, math.ceil(retry_after_s * 1000)))
    too_long = retry_after_s is not None and retry_after_s > RETRY_WAIT_LIMIT_S
    if status == 409 or too_long or lasting:
        # The openai and anthropic SDKs retry a 409 twice by default (a lock another request
        # held, in their APIs). Ours is a reply that has ended: asking again changes nothing,
        # and their header says so, so the client has its answer at once. So does a wait
        # longer than a client should sleep unasked (``RETRY_WAIT_LIMIT_S``), and a failure
        # that lasts until an operator mends it (a relay's key or URL for its upstream),
        # which they would retry as any 5xx, sleeping its ``Retry-After`` each time.
        response.headers["X-Should-Retry"] = "false"
    return response


def in_route_shape(
    path: str,
    response: AnyResponse,
    headers: Mapping[str, str] | None = None,
    request_id: str | None = None,
    *,
    unrouted: bool = False,
) -> AnyResponse | web.Response:
    """An error response of ours in the shape the route's clients read (``headers``: the
    request's, when known; ``request_id``: its id, which Anthropic's body carries;
    ``unrouted``: no route serves the request)."""
    fields = response.get(API_ERROR)
    if fields is None or not speaks_anthropic(path, headers or {}, unrouted=unrouted):
        return response
    message, code, param = fields
    status = anthropic_status(response.status)
    kind = anthropic_error_type(status)
    error: dict[str, Any] = {"type": kind, "message": message, "code": code, "param": param}
    if code in ANTHROPIC_DETAIL_CODES:
        error["details"] = {"error_code": code}
    body: dict[str, Any] = {"type": "error", "error": error}
    if request_id is not None:
        body["request_id"] = request_id
    reshaped = web.Response(status=status, text=json.dumps(body), content_type="application/json")
    if status == ANTHROPIC_OVERLOADED:
        reshaped.set_status(status, "Overloaded")  # no reason phrase of its own in HTTP
    for name in _KEPT_HEADERS:
        if name in response.headers:
            reshaped.headers[name] = response.headers[name]
    if not response.keep_alive and response.keep_alive is not None:
        reshaped.force_close()
    return reshaped


class HTTPAPIError(Exception):
    """Raised inside a handler to answer with an error response before any byte is sent."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        close_connection: bool = False,
        retry_after_s: float | None = None,
        names_upstream_field: bool = False,
        lasting: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        # A relay's refusal: ``param`` is in its upstream's words (``server.refusal_names``).
        self.names_upstream_field = names_upstream_field
        self.close_connection = close_connection  # the request's end on the wire is unknown
        self.retry_after_s = retry_after_s  # seconds until the client may try again
        self.lasting = lasting  # asking again does not help (``error_response``)

    def response(self) -> web.Response:
        response = error_response(
            self.status,
            self.message,
            code=self.code,
            param=self.param,
            retry_after_s=self.retry_after_s,
            lasting=self.lasting,
        )
        if self.close_connection:
            response.force_close()
        return response
