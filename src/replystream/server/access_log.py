"""The server's structured access log: one JSON line per request, and per WebSocket reply.

This file decides what a line says: the request's id (the client's ``X-Request-Id`` if
sane, else a new one, stamped on the answer too), its method, path, status, time, client
and reply, and for a request that started or read a reply how it ended (``Account``). A
WebSocket's socket has a line, and each of its ``reply`` messages one of its own once it
has ended (``SocketReplyLine``); a request the HTTP parser refused, one with what could be
known (``log_refused``). What a reply sent and why it ended is counted by ``accounts``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Protocol

from aiohttp import web

from replystream.server import ids
from replystream.server.guard import GUARD_KEY, client_address, parse_address

access_log = logging.getLogger("replystream.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# The most of a path a line shows, in bytes of its JSON form (a character may take 12: an
# escaped surrogate pair). A request line may be 8 KiB: a line that showed all of it would
# pass the one write a pipe keeps whole (``log_sink.WHOLE_WRITE_BYTES``, 4096 bytes on
# Linux), and another worker's lines could go into its middle. With this, every line fits.
PATH_SHOWN = 2048

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
        "path": shown_path(request.path),
        "status": status,
        "ms": round((time.monotonic() - started) * 1000.0, 1),
        "client": client_address(request, request.app[GUARD_KEY].trusted_proxies),
        "reply_id": reply_id,
    }


def shown_path(path: str) -> str:
    """``path`` as a line shows it: whole, or its start and its length when its JSON form
    would pass ``PATH_SHOWN`` bytes."""
    if len(json.dumps(path)) <= PATH_SHOWN:
        return path
    note = f"… ({len(path)} characters)"
    room = PATH_SHOWN - len(json.dumps(note))  # for the start, its quotes left out
    kept, over = 0, len(path)  # the longest start that fits, found by halving
    while kept + 1 < over:
        middle = (kept + over) // 2
        if len(json.dumps(path[:middle])) - 2 <= room:
            kept = middle
        else:
            over = middle
    return path[:kept] + note


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
        address = None if client is None else parse_address(client)
        shown = client if address is None else str(address)  # as ``client_address`` names it
        line |= {"status": status, "ms": None, "client": shown, "reply_id": None}
        line |= {"outcome": None, "reason": None}
        line["refused"] = code
        access_log.info("%s", json.dumps(line))
