"""The one middleware every request passes through, and the order of what it does.

In order: the request gets an id (``guard``); a CORS preflight is answered; one for a name
that is not this server's, reaching it at a loopback address, is refused (``guard``: DNS
rebinding); a request a page of a foreign origin made is refused (``guard``); on ``/v1/*``
and the lab's routes the API key is checked (``auth``); the per-client limits admit the
request (``guard``); its ``Expect`` header is answered (``expectation``: the body is invited
only now); the handler runs. Whatever fails becomes the API's error shape
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

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.typedefs import Handler, Middleware

from replystream.server.access_log import (
    ACCOUNT,
    UPGRADED,
    access_log,
    assign_request_id,
    log_access,
)
from replystream.server.browser_guard import (
    foreign_page_refusal,
    preflight_response,
    rebinding_refusal,
)
from replystream.server.errors import UNROUTED, HTTPAPIError, error_response, in_route_shape
from replystream.server.guard import (
    ADMITTED,
    LIMITED_PREFIXES,
    ClientGate,
    identity_of,
    needs_no_room,
    rate_limited,
)
from replystream.server.response_gzip import gzip_if_worthwhile

log = logging.getLogger("replystream.server")

# A step that may answer a request itself (a refusal) before the handler sees it.
Check = Callable[[web.Request], web.StreamResponse | None]


@dataclass(frozen=True, slots=True)
class FrontDoor:
    cors_origins: tuple[str, ...]
    allowed_hosts: tuple[str, ...]
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
    allowed_hosts = door.allowed_hosts
    limits = gate.limits

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = assign_request_id(request)
        started = time.monotonic()
        status: int | str = "client_gone"
        sent_later = False
        gone = False  # the client left while its answer was being written
        try:
            response: web.StreamResponse | None = preflight_response(request, origins)
            if response is None:
                try:
                    response = rebinding_refusal(request, allowed_hosts)
                    if response is None:
                        response = foreign_page_refusal(request)
                    if response is None and check_key is not None:
                        response = check_key(request)
                    if limits and response is None and request.path.startswith(LIMITED_PREFIXES):
                        identity = identity_of(request)
                        if needs_no_room(request):
                            wait = gate.spend(identity, time.monotonic())
                        elif (wait := gate.admit(identity, time.monotonic())) is None:
                            request[ADMITTED] = identity  # counted open until ``finish``
                        if wait is not None:
                            response = rate_limited(wait)
                    if response is None and "Expect" in request.headers:
                        response = await expectation(request, door.max_body_bytes)
                    if response is None:
                        response = await handler(request)
                except Exception as exc:
                    if request.writer.output_size:
                        # The response (or a WebSocket's upgrade) is on the wire: a second
                        # one would be read as part of it. The connection just ends.
                        gone = client_left(request, exc)
                        if not gone:
                            log.error(
                                "%s %r failed after its response began",
                                request.method,
                                request.path,  # quoted: a decoded path may hold line breaks
                                exc_info=exc,
                            )
                        response = AbandonedResponse()
                    else:
                        response = error_answer(request, exc, door.max_body_bytes)
                response = in_route_shape(
                    request.path,
                    response,
                    request.headers,
                    request_id,
                    unrouted=request.get(UNROUTED, False),
                )
                if response.status >= 400 and body_withheld(request):
                    # The client holds its body back until invited, or until it tires of
                    # waiting: then it would be read as the next request. Nothing follows.
                    response.force_close()
                await gzip_if_worthwhile(request, response, door.gzip_min_bytes)
                count_whole_body(request, response)
            status = "client_gone" if gone else response.status
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


def count_whole_body(request: web.Request, response: web.StreamResponse) -> None:
    """A body answered whole to a request that started or reads a reply (its reply, or its
    refusal as the reply started) counts as its one event, as it goes on the wire: in its
    last form (gzipped, when it is), written by aiohttp in one piece once this returns. A
    stream's body (``SentLater``) is counted as its writes go out."""
    account = request.get(ACCOUNT)
    if account is not None and isinstance(response, web.Response):
        body = response.body
        if isinstance(body, bytes):
            account.on_send(len(body), 1)


def client_left(request: web.Request, exc: Exception) -> bool:
    """Whether ``exc`` is the client's leaving, not a failure: a write refused because its
    connection is closing or gone (a WebSocket upgrade answered after the client gave up
    waiting for it, on a busy server)."""
    transport = request.transport
    return isinstance(exc, ConnectionError) and (transport is None or transport.is_closing())


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
        # The path as the router matched it: an encoded slash (``%2F``) kept, not read as one.
        path = request.rel_url.path_safe
        if isinstance(exc, web.HTTPNotFound):
            message = f"{exc.reason}: {request.method} {path} is not a route of this server"
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{exc.reason}: {path} takes {allowed}, not {request.method}"
        response = error_response(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
        if "Allow" in exc.headers:  # a 405 says which methods the route serves
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    # The path quoted: decoded, it may hold line breaks (``%0A``) that would forge log lines.
    log.error("unhandled error in %s %r", request.method, request.path, exc_info=exc)
    return error_response(500, "internal server error", code="internal_error")


# ``Expect``: a client that sends ``Expect: 100-continue`` waits for ``100 Continue`` before
# it sends its body (RFC 9110 10.1.1), so a request refused on its head alone costs it no
# upload. aiohttp answers the header per route, before any middleware (``expect_handler``,
# whose default invites every body); every route here leaves it to the front door
# (``expect_later``), which decides once the checks that need no body have passed.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
INVITED = web.RequestKey("body_invited", bool)


async def expect_later(request: web.Request) -> None:
    """Every route's expect handler: nothing yet; the front door answers ``Expect``
    (``expectation``) once its checks passed."""
    return None


def expectations(request: web.Request) -> list[str]:
    """What the request's ``Expect`` fields ask for, lowercased (RFC 9110: a list of
    tokens, case-insensitive)."""
    return [
        item.strip().lower()
        for field in request.headers.getall("Expect", ())
        for item in field.split(",")
        if item.strip()
    ]


async def expectation(request: web.Request, max_body_bytes: int) -> web.Response | None:
    """The answer to the request's ``Expect`` header, with every check that needs no body
    passed: a refusal, or None once the body is invited (``100 Continue``) if it has one to
    come. An expectation other than ``100-continue`` is a ``417``; a body its
    ``Content-Length`` puts past the limit a ``413`` without it. A path no route serves, or
    a method its route does not take, is not invited: the handler's ``404`` or ``405``
    follows (``unrouted``). HTTP/1.0 has no ``100 Continue``: the expectation is ignored."""
    asked = expectations(request)
    if not asked:
        return None
    if any(item != "100-continue" for item in asked):
        response = error_response(
            417,
            "the only expectation this server meets is Expect: 100-continue",
            code="expectation_failed",
        )
        response.force_close()  # the body may come all the same, or not: the end is unknown
        return response
    if request.version < HttpVersion11 or request.match_info.handler is unrouted:
        return None
    declared = request.content_length
    if declared is not None and declared > max_body_bytes:
        too_large = web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=declared)
        return error_answer(request, too_large, max_body_bytes)
    if request.body_exists and not request.content.is_eof():
        await request.writer.write(CONTINUE)
        request.writer.output_size = 0  # an interim answer: the response has not begun
        request[INVITED] = True
    return None


def body_withheld(request: web.Request) -> bool:
    """Whether the request's body may still come though it was never invited: refused
    before its ``100 Continue``, the connection cannot go on."""
    return (
        "Expect" in request.headers
        and not request.get(INVITED)
        and request.body_exists
        and not request.content.is_eof()
        and "100-continue" in expectations(request)
    )


async def unrouted(request: web.Request) -> web.StreamResponse:
    """A path no route serves (``404``) or a method its route does not take (``405``, with
    the methods it does): aiohttp's router's own answers, made by a route (``add_unrouted``)
    so that its ``Expect`` is the front door's too (the router's would invite the body)."""
    request[UNROUTED] = True
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        _, methods = await resource.resolve(request)
        allowed |= methods
    allowed.discard(hdrs.METH_ANY)  # this route's own
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def add_unrouted(router: web.UrlDispatcher) -> None:
    """Register ``unrouted`` for every path and method no route takes; added last."""
    # Any path: ``.`` would miss one whose decoded form holds a line break (``%0A``).
    router.add_route("*", r"/{path:[\s\S]*}", unrouted, expect_handler=expect_later)
