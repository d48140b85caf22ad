"""``GET /v1/ws``: replies over a WebSocket, several at once, each tagged by the client.

Client messages are JSON objects:
- ``{"type": "auth", "api_key": "..."}``: only when keys are configured and the upgrade
  request had no ``Authorization`` header (browsers cannot send one); it must come first.
- ``{"type": "reply", "id": "<tag>", ...}``: start a reply; the other fields are those of
  ``POST /v1/replies`` (``stream`` must stay true).
- ``{"type": "cancel", "id": "<tag>"}``: stop that reply's generation.
Server messages are one JSON object per event of a reply, with the native endpoint's event
names: ``{"type": "reply"|"token"|"tool_call"|"usage"|"done"|"error"|"moderated"|"gap", "id": <tag>,
"reply_id": ..., "seq": n, "data": {...}}``; a bad message gets ``{"type": "error", "id":
<tag or null>, "data": {"error": {...}}}`` and the socket stays open.


The socket's session (its replies, sends, limits, pings, closes) is ``socket_session``'s;
this file upgrades the request, refusing one that cannot be upgraded in HTTP's words.
"""

from __future__ import annotations

import logging

from aiohttp import HttpVersion11, web

from replystream.server.access_log import SOCKET_REPLIES, UPGRADED
from replystream.server.auth import AUTH_PENDING
from replystream.server.context import CONFIG_KEY, MANAGER_KEY
from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.socket_session import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_TIMEOUT_S,
    Session,
)
from replystream.server.ws_transport import MaskedFramesOnly

log = logging.getLogger("replystream.websocket")

# How many times --max-body-bytes a message may be and still be read, to be refused with an
# ``error`` message while the socket and its other replies go on; past it the socket closes
# (1009, message too big): the server does not hold that much to refuse it.
READ_PAST_LIMIT = 4


def _upgrade_refused(request: web.Request, asked: str) -> str:
    """What is wrong with a request for ``GET /v1/ws`` that cannot be upgraded: a client that
    did ask for a WebSocket is told what to change, not to ask for one."""
    if (
        request.version < HttpVersion11
        and "websocket" in request.headers.get("Upgrade", "").lower()
    ):
        return "GET /v1/ws is a WebSocket, which needs HTTP/1.1: this request is HTTP/1.0"
    if asked and asked != "13":
        shown = asked if len(asked) <= 16 and asked.isprintable() else "another"
        return f"GET /v1/ws speaks WebSocket version 13, not {shown} (Sec-WebSocket-Version)"
    return "GET /v1/ws is a WebSocket: send an Upgrade request"


async def handle_websocket(request: web.Request) -> web.StreamResponse:
    """``GET /v1/ws``: upgrade, authenticate if needed, then serve replies until closed.

    Once upgraded, nothing may escape this handler: an HTTP response written now would land
    inside the WebSocket stream. A failure of the session itself closes the socket (1011)."""
    config = request.app[CONFIG_KEY]
    ws = web.WebSocketResponse(
        # The session pings, and answers pings, itself (rule 4).
        autoping=False,
        # The session answers the client's close frame itself: aiohttp answers 1000 even to
        # a code no peer may send (1006, 5000 and up), which RFC 6455 makes a protocol error.
        autoclose=False,
        max_msg_size=READ_PAST_LIMIT * config.max_body_bytes,
        timeout=CLOSE_TIMEOUT_S,
        # No permessage-deflate, whatever the client offers: compressing costs CPU per frame
        # on the hot path, and the reply transports write whole plain frames themselves.
        compress=False,
    )
    # HTTP/1.0 has no protocol switch: its Upgrade header is ignored (RFC 9110, 7.8), so its
    # request is a plain GET, never answered with a 101 its client cannot read. Only RFC
    # 6455's version 13 is spoken: aiohttp would take the drafts' 7 and 8 too, whose clients
    # name their page in ``Sec-WebSocket-Origin``, which the origin check does not read.
    asked = request.headers.get("Sec-WebSocket-Version", "").strip()
    if request.version < HttpVersion11 or asked != "13" or not ws.can_prepare(request).ok:
        message = _upgrade_refused(request, asked)
        refusal = HTTPAPIError(400, message, code="upgrade_required").response()
        # The version this server speaks, which a client asking another must be told
        # (RFC 6455, 4.2.2).
        refusal.headers["Sec-WebSocket-Version"] = "13"
        return refusal
    session = Session(request, ws)
    guard = MaskedFramesOnly.install(request, session.failed_by_client)
    await ws.prepare(request)
    request[UPGRADED] = True
    request[SOCKET_REPLIES] = 0
    if guard is not None and not guard.arm():
        return ws  # the client broke the protocol before its first message was read
    manager = request.app[MANAGER_KEY]
    manager.connections.add(session)  # from now on: told when the server shuts down
    if manager.shutting_down:
        session.server_stopping()
    try:
        ring = request.get(AUTH_PENDING)
        if ring is not None and not await session.authenticate(ring):
            return ws
        await session.run()
    except Exception as exc:
        log.error("websocket session failed", exc_info=exc)
        await session.close(CLOSE_INTERNAL_ERROR, b"internal_error")
    finally:
        manager.forget_connection(session)
    if not ws.closed:
        await session.close(1000, b"")
    return ws


class _OfferedSubprotocols(logging.Filter):
    """Drops aiohttp's warning that a client offered subprotocols (``Sec-WebSocket-Protocol``)
    none of which the server speaks: logged at every handshake step of every such upgrade
    (twice an upgrade here), so any client could fill the log with it. The server speaks no
    subprotocol: RFC 6455 (4.2.2) has it answer such an offer without the header, which
    aiohttp does, and that is no fault of the server's worth a line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.funcName == "_handshake" and str(record.msg).startswith("%s: Client protocols")
        )


_OFFERS_FILTER = _OfferedSubprotocols()


def add_websocket_route(app: web.Application) -> None:
    """Register ``GET /v1/ws`` on ``app``."""
    logging.getLogger("aiohttp.websocket").addFilter(_OFFERS_FILTER)  # once, however many apps
    app.router.add_get("/v1/ws", handle_websocket, allow_head=False, expect_handler=expect_later)
