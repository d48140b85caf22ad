"""The one middleware every request passes through, and the order of what it does.

In order: the request gets an id (``guard``); a CORS preflight is
answered; a request a page of a foreign origin made is refused (``guard``); on ``/v1/*``
and the lab's routes the API key is checked (``auth``); the per-client limits admit the
request (``guard``); the handler runs. Whatever fails becomes the API's error shape
(``errors``), JSON, HTML and plain-text bodies are gzipped for clients that accept them
(``response_gzip``), and one access log line names the request.

Each step is a plain function owned by its module; they run in one coroutine, not a stack of
middlewares (six layers cost a stream about 1.6 KiB and a dozen microseconds). A stream's
response is a ``SentLater``: its body is sent after this middleware returned, so a stream
holds none of these frames, and the last steps run when the body has been sent. This file
must not know about replies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from replystream.server.errors import HTTPAPIError, error_response, in_route_shape
from replystream.server.guard import (
    ADMITTED,
    LIMITED_PREFIXES,
    UPGRADED,
    ClientGate,
    access_log,
    assign_request_id,
    foreign_page_refusal,
    identity_of,
    log_access,
    preflight_response,
    rate_limited,
)
from replystream.server.response_gzip import gzip_if_worthwhile

log = logging.getLogger("replystream.server")

# A step that may answer a request itself (a refusal) before the handler sees it.
Check = Callable[[web.Request], web.StreamResponse | None]


@dataclass(frozen=True, slots=True)
class FrontDoor:
    cors_origins: tuple[str, ...]
    gate: ClientGate
    check_key: Check | None  # None: no API keys configured
    max_body_bytes: int
    gzip_min_bytes: int


class SentLater(web.StreamResponse):
    """A response whose whole body is sent after the handler and this middleware returned: by
    ``prepare``, which aiohttp calls then (as it sends a ``FileResponse``). A stream of an hour
    holds none of their frames. The front door's last steps for the request (the client's
    open-request slot, the access log line) wait for ``sent``, which the body's sender calls
    with the status the access log names; it is set only when there is such a step."""

    sent: Callable[[int | str], None] | None = None


class AbandonedResponse(web.StreamResponse):
    """What a handler that failed after its response began leaves aiohttp to send: nothing.
    The connection closes, so the client sees a response cut short, never a second one."""

    def __init__(self) -> None:
        super().__init__(status=500)
        self.force_close()

    async def prepare(self, request: web.BaseRequest) -> None:
        if request.transport is not None:
            request.transport.close()

    async def write_eof(self, data: bytes = b"") -> None:
        pass


def front_door(door: FrontDoor) -> Middleware:
    """The middleware running ``door``'s steps around every handler."""
    origins, gate, check_key = door.cors_origins, door.gate, door.check_key
    limits = gate.limits

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = assign_request_id(request)
        started = time.monotonic()
        status: int | str = "client_gone"
        sent_later = False
        try:
            response: web.StreamResponse | None = preflight_response(request, origins)
            if response is None:
                try:
                    response = foreign_page_refusal(request)
                    if response is None and check_key is not None:
                        response = check_key(request)
                    if limits and response is None and request.path.startswith(LIMITED_PREFIXES):
                        identity = identity_of(request)
                        wait = gate.admit(identity, time.monotonic())
                        if wait is None:
                            request[ADMITTED] = identity  # counted open until ``finish``
                        else:
                            response = rate_limited(wait)
                    if response is None:
                        response = await handler(request)
                except Exception as exc:
                    if request.writer.output_size:
                        # The response (or a WebSocket's upgrade) is on the wire: a second
                        # one would be read as part of it. The connection just ends.
                        log.error(
                            "%s %s failed after its response began",
                            request.method,
                            request.path,
                            exc_info=exc,
                        )
                        response = AbandonedResponse()
                    else:
                        response = error_answer(request, exc, door.max_body_bytes)
                response = in_route_shape(request.path, response, request.headers, request_id)
                await gzip_if_worthwhile(request, response, door.gzip_min_bytes)
            status = response.status
            if isinstance(response, SentLater):
                sent_later = True
                if ADMITTED in request or access_log.isEnabledFor(logging.INFO):
                    response.sent = partial(finish, request, request_id, started, gate)
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if status == "client_gone" and request.get(UPGRADED):
                status = 101
            if not sent_later:
                finish(request, request_id, started, gate, status)

    return front


def finish(
    request: web.Request, request_id: str, started: float, gate: ClientGate, status: int | str
) -> None:
    """A request's last steps: its client's slot is free again (whoever it is counted
    against by now: ``guard.count_as_owner``); its access log line."""
    identity = request.get(ADMITTED)
    if identity is not None:
        gate.release(identity)
    if access_log.isEnabledFor(logging.INFO):  # off by default: skip building the line
        log_access(request, request_id, status, started)


def error_answer(request: web.Request, exc: Exception, max_body_bytes: int) -> web.Response:
    """Any failure as a response in the API's error shape; never a stack trace.

    Redirects and other non-error ``HTTPException`` are raised again for aiohttp to send.
    """
    if isinstance(exc, HTTPAPIError):
        return exc.response()
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        message = f"request body is larger than {max_body_bytes} bytes"
        response = error_response(413, message, code="body_too_large")
        response.force_close()  # the rest of the body is unread: the connection cannot go on
        return response
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        message = exc.reason
        # The router's own refusals say which request they refuse, as OpenAI's "Invalid URL
        # (POST /v1/x)" does: an SDK call this server does not have is named in the error.
        if isinstance(exc, web.HTTPNotFound):
            message = f"{exc.reason}: {request.method} {request.path} is not a route of this server"
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{exc.reason}: {request.path} takes {allowed}, not {request.method}"
        response = error_response(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
        if "Allow" in exc.headers:  # a 405 says which methods the route serves
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    log.error("unhandled error in %s %s", request.method, request.path, exc_info=exc)
    return error_response(500, "internal server error", code="internal_error")
