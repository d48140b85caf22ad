"""The replies running on one WebSocket (``socket_session``), each under its client's tag.

This file decides how a ``reply`` message becomes a reply followed over the socket, and how
it ends: it is refused as its request would be over HTTP (a revoked key, a tag running
already, too many on the socket, the client's limits: ``guard.SocketRooms``), or it starts
and one task of the socket's ``TaskGroup`` follows it through the socket's frame transport
(the same follower as over SSE); a ``cancel`` message stops it. Any failure of one reply
becomes an ``error`` message for its tag and the others go on; only the socket's own
``send`` failing (``SocketDone``) ends them all. Each reply has its access-log line once it
has ended. It must not know how the socket reads its messages, pings or closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.task_stop import forget_cancellation
from replystream.server.access_log import SOCKET_REPLIES, log_socket_reply
from replystream.server.accounts import SocketReply
from replystream.server.auth import KEY_RING, client_key
from replystream.server.context import (
    CONFIG_KEY,
    NATIVE_FORMAT,
    caller_of,
    follower_of,
    start_reply,
)
from replystream.server.errors import HTTPAPIError, error_body, retry_after_value
from replystream.server.guard import GATE_KEY, RATE_LIMITED, SocketRooms, identity_of
from replystream.server.native import ReplyRequest, parse_reply_request
from replystream.server.native_schemas import ReplyMessage
from replystream.server.openai_api import routed_model
from replystream.server.refusal_names import refusals_naming
from replystream.server.replies import Reply
from replystream.server.ws_transport import SocketKeepalive, WebSocketTransport

log = logging.getLogger("replystream.websocket")

# The most of a refusal's words its log line shows, in characters: the words may quote what
# the client sent (a model's name, a field's), which may be as long as a message is.
SAID_SHOWN = 300


class SocketDone(Exception):
    """The socket itself failed: every reply on it ends (raised only by the socket's ``send``)."""


class SlowClient(SocketDone):
    """The socket cannot keep up; it is closed with 1008 (policy)."""


class ClientGone(SocketDone):
    """The connection is gone (or closing): there is nobody left to tell anything."""


@dataclass(eq=False)
class _Running:
    task: asyncio.Task[None]
    account: SocketReply  # its reply once begun, and what it made, for its access-log line
    cancelled: bool = False


def failure_message(tag: str | None, exc: Exception) -> dict[str, Any]:
    """The ``error`` message for a client message (or its reply) that failed with ``exc``.

    A refusal (``HTTPAPIError``: the client's mistake, or the server declining) is logged
    in one line; anything else is a bug of ours, logged with its traceback, and the client
    is told no more than that."""
    if isinstance(exc, HTTPAPIError):
        level = logging.INFO if exc.status < 500 else logging.WARNING
        log.log(level, "websocket message %r refused: %s (%s)", tag, _said(exc.message), exc.code)
        body = error_body(exc.message, code=exc.code, status=exc.status, param=exc.param)
        if exc.retry_after_s is not None:  # what HTTP says in ``Retry-After``
            body["retry_after"] = int(retry_after_value(exc.retry_after_s))
    else:
        log.error("websocket message %r failed", tag, exc_info=exc)
        body = error_body("internal error", code="internal_error", status=500)
    return {"type": "error", "id": tag, "data": body}


def _said(message: str) -> str:
    """A refusal's words as its log line shows them: on one line, and cut past
    ``SAID_SHOWN`` characters (the client's error message has them all)."""
    if len(message) > SAID_SHOWN:
        return f"{message[:SAID_SHOWN]!r}… ({len(message)} characters)"
    return message if message.isprintable() else repr(message)


class SocketReplies:
    """The replies running on one socket, by tag, and the room they take among its client's
    limits."""

    def __init__(
        self,
        request: web.Request,
        *,
        send: Callable[[dict[str, Any]], Awaitable[int]],
        cut: Callable[[], None],
        closing: Callable[[], bool],
        keepalive: SocketKeepalive,
    ) -> None:
        self.request = request
        self.config = request.app[CONFIG_KEY]
        self.running: dict[str, _Running] = {}
        self._rooms = SocketRooms(request.app[GATE_KEY])
        # The socket's: send a message (its bytes on the wire; raises ``SocketDone``), cut it
        # as a slow client, whether it is closing, its pings.
        self._send = send
        self._cut = cut
        self._closing = closing
        self._keepalive = keepalive

    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks following the replies running now."""
        return [running.task for running in self.running.values()]

    def stop(self) -> None:
        """Stop following every reply (the socket is closing or gone)."""
        for running in self.running.values():
            running.task.cancel()

    def release_all(self) -> None:
        """Every task is done: a room taken for a reply that never began (its task refused by
        a group already stopping) is given back."""
        self._rooms.release_all()

    def refused(self, tag: str | None, arrived: float, status: int) -> None:
        """A ``reply`` message refused before its reply began: its access-log line."""
        self._log_reply(SocketReply(tag, arrived, status=status))

    def start(self, message: ReplyMessage, group: asyncio.TaskGroup, arrived: float) -> None:
        """Start the reply a ``reply`` message asks for, followed by a task of ``group``.

        Raises:
            HTTPAPIError: the message is refused, as its request would be over HTTP.
        """
        tag = message.id
        ring = self.request.app.get(KEY_RING)
        key = client_key(self.request)
        if ring is not None and key is not None and not ring.accepts(key):
            # Revoked since the socket opened (a reload of --api-keys-file): a reply is a
            # request, refused as one over HTTP is; the replies running on it go on.
            raise HTTPAPIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if tag in self.running:
            raise HTTPAPIError(
                400, f"a reply tagged {tag!r} is running", code="duplicate_id", param="id"
            )
        if len(self.running) >= self.config.ws_max_replies:
            raise HTTPAPIError(
                400,
                f"at most {self.config.ws_max_replies} replies may run on one socket",
                code="too_many_replies",
            )
        ask = parse_reply_request(
            message,
            self.config.policy,
            self.config.max_prompt_chars,
            caller=caller_of(self.request),
            model=routed_model(self.request.app, message.model),
        )
        self._admit()
        task = group.create_task(self._reply(tag, ask), name=f"ws-reply-{tag[:16]}")
        running = self.running[tag] = _Running(task, SocketReply(tag, arrived))
        task.add_done_callback(forget_cancellation)
        task.add_done_callback(partial(self._reply_over, running))

    def _admit(self) -> None:
        """Count a reply about to start against its client's limits (``SocketRooms``).

        Raises:
            HTTPAPIError: the ``429`` of a client at either limit.
        """
        wait = self._rooms.admit(identity_of(self.request), time.monotonic())
        if wait is not None:
            raise HTTPAPIError(429, RATE_LIMITED, code="rate_limited", retry_after_s=wait)

    def _reply_over(self, running: _Running, task: asyncio.Task[None]) -> None:
        """A reply's task is done (ended, or cancelled before it ran): its room is free
        again; its access-log line says how it ended."""
        self._rooms.reply_over()
        self._log_reply(running.account)

    def _log_reply(self, account: SocketReply) -> None:
        """One ``reply`` message's access-log line, once it has ended; the socket's own line
        counts them."""
        self.request[SOCKET_REPLIES] = self.request.get(SOCKET_REPLIES, 0) + 1
        log_socket_reply(self.request, account)

    def cancel(self, tag: str) -> None:
        """Stop the reply tagged ``tag`` (a ``cancel`` message); a ``404`` if none runs."""
        running = self.running.get(tag)
        if running is None:
            # As HTTP answers a cancel of an unknown reply: a 404 (``not_found_error``).
            raise HTTPAPIError(
                404, f"no reply tagged {tag!r} is running", code="reply_not_found", param="id"
            )
        # The reply's log ends with an ``error`` event (``cancelled``), which its reader sends;
        # a reply still being admitted is stopped as soon as it is, so it ends the same way.
        running.cancelled = True
        if running.account.reply is not None:
            running.account.reply.stop("cancelled")

    async def _reply(self, tag: str, ask: ReplyRequest) -> None:
        """Start one reply and send its log; any failure of this reply stays with it."""
        running = self.running[tag]
        account = running.account
        try:
            with refusals_naming(ask.fields):
                reply = await start_reply(
                    self.request,
                    ask.generation,
                    endpoint="/v1/ws",
                    fmt=NATIVE_FORMAT,
                    policy=ask.policy,
                    resumable=ask.resumable,
                    disconnect=ask.disconnect,
                    on_record=account.keep,
                )
            account.reply, account.status = reply, 200
            if running.cancelled:
                # Let the producer take its first step first: a task cancelled before it
                # starts never runs its ``finally``, and its log would never get an ending.
                await asyncio.sleep(0)
                reply.stop("cancelled")
            await self._follow(tag, reply, ask.policy, account)
        except SocketDone:
            raise  # the socket itself is done for: every reply on it ends
        except Exception as exc:  # a refusal, or a bug: this reply ends, the others go on
            account.status = exc.status if isinstance(exc, HTTPAPIError) else 500
            account.on_send(await self._send(failure_message(tag, exc)))
        finally:
            self.running.pop(tag, None)

    async def _follow(
        self, tag: str, reply: Reply, policy: DeliveryPolicy, account: SocketReply
    ) -> None:
        """Send the reply's log as messages for ``tag``: the same follower as over SSE (the
        same limits, endings and direct path), through this socket's frame transport."""
        transport = WebSocketTransport(
            self.request,
            tag=tag,
            reply_id=reply.reply_id,
            cut=self._cut,
            closing=self._closing,
            keepalive=self._keepalive,
        )
        account.follower = follower = follower_of(
            self.request,
            reply_id=reply.reply_id,
            store=reply.store,
            policy=policy,
            reply=reply,
            transport=transport,
        )
        await follower.run()
