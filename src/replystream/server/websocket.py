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

Rules:
1. Each reply is produced into its reply log like any other and read from the log by one task
   of this socket's ``TaskGroup``; the handler owns them all and waits for them.
2. Closing the socket cancels every reader task; a reader leaving stops its reply's
   generation (unless the reply is resumable: then it detaches, as over SSE).
3. Sends are serialised and awaited (they wait for the socket to drain); one that does not
   finish within ``slow_client_s``, or a reply whose unsent backlog passes its follower's
   byte limit (``slow_client_bytes`` past the least it has had), closes the socket (code
   1008, reason ``slow_client``).
4. At most ``ServerConfig.ws_max_replies`` replies run on one socket, and no more than its
   client's per-client limits allow (``Session._admit``). A socket that has sent
   nothing for ``keepalive_s`` is pinged; a ping not answered within ``slow_client_s`` cuts
   it as rule 3 does (``ws_transport.SocketKeepalive``). aiohttp's own heartbeat is not used:
   it pings whatever is being sent, and drops a reader merely behind its replies.
5. One error boundary per client message and per reply task: whatever fails there becomes
   an ``error`` message for its tag. Only ``Session.send`` failing (``_SocketDone``) ends the
   socket; nothing escapes the handler after the upgrade (a session failure closes 1011).
6. At shutdown (``server_stopping``) the replies' ``shutdown`` errors are sent, then the
   socket closes with 1001; every close is bounded (a client that does not answer is dropped).
7. A client frame that is not masked fails the connection (1002) before aiohttp reads it
   (``ws_transport.MaskedFramesOnly``); the session only stops, as when the client leaves.
   A client's close frame is answered by the session: 1000, or 1002 for a close code no peer
   may send (``ws_transport.close_answer``).
8. Each ``reply`` message has an access-log line of its own once it has ended (refused, or
   its reply over), as its request would have had over HTTP (``accounts.SocketReply``); the
   socket's own line, the upgrade's, counts them.
This file must not know how tokens are made or how the log is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import HttpVersion11, WSMessage, WSMsgType, web

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.task_stop import forget_cancellation
from replystream.server.access_log import SOCKET_REPLIES, UPGRADED, log_socket_reply
from replystream.server.accounts import SocketReply
from replystream.server.auth import (
    AUTH_PENDING,
    KEY_RING,
    OWNER,
    SOCKET_KEY,
    KeyRing,
    client_key,
    key_owner,
)
from replystream.server.context import (
    CONFIG_KEY,
    MANAGER_KEY,
    NATIVE_FORMAT,
    caller_of,
    follower_of,
    start_reply,
)
from replystream.server.errors import HTTPAPIError, error_body, retry_after_value
from replystream.server.front_door import expect_later
from replystream.server.guard import GATE_KEY, RATE_LIMITED, count_as_owner, identity_of
from replystream.server.native import ReplyRequest, parse_reply_request
from replystream.server.native_schemas import AuthMessage, CancelMessage, ReplyMessage
from replystream.server.openai_api import routed_model
from replystream.server.refusal_names import refusals_naming
from replystream.server.replies import Reply, ReplyManager
from replystream.server.socket_messages import BadMessage, auth_key, parse_message
from replystream.server.socket_room import LAST_WORDS_S, abort_later
from replystream.server.ws_transport import (
    CLOSE_PROTOCOL_ERROR,
    MaskedFramesOnly,
    SocketKeepalive,
    WebSocketTransport,
    close_answer,
    frame_bytes,
)

log = logging.getLogger("replystream.websocket")

AUTH_TIMEOUT_S = 10.0
LIVENESS_POLL_S = 1.0
CLOSE_UNAUTHORIZED = 4401  # application range (4000-4999): "401" over a WebSocket
CLOSE_TRY_AGAIN_LATER = 1013  # RFC 6455's: the server cannot take the socket now (a 429)
CLOSE_POLICY = 1008
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TIMEOUT_S = 1.0  # how long a close waits for the client's answering close frame
# At shutdown, how long the replies on a socket may take to send their last events (each
# reply's log already ends with its ``shutdown`` error) before the socket is closed.
SHUTDOWN_LAST_WORDS_S = 2.0
# How many times --max-body-bytes a message may be and still be read, to be refused with an
# ``error`` message while the socket and its other replies go on; past it the socket closes
# (1009, message too big): the server does not hold that much to refuse it.
READ_PAST_LIMIT = 4


class _SocketDone(Exception):
    """The socket itself failed: every reply on it ends (raised only by ``Session.send``)."""


class _SlowClient(_SocketDone):
    """The socket cannot keep up; it is closed with ``CLOSE_POLICY``."""


class _ClientGone(_SocketDone):
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
        log.log(level, "websocket message %r refused: %s (%s)", tag, exc.message, exc.code)
        body = error_body(exc.message, code=exc.code, status=exc.status, param=exc.param)
        if exc.retry_after_s is not None:  # what HTTP says in ``Retry-After``
            body["retry_after"] = int(retry_after_value(exc.retry_after_s))
    else:
        log.error("websocket message %r failed", tag, exc_info=exc)
        body = error_body("internal error", code="internal_error", status=500)
    return {"type": "error", "id": tag, "data": body}


class Session:
    """One WebSocket connection and the replies running over it."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.config = request.app[CONFIG_KEY]
        self.manager: ReplyManager = request.app[MANAGER_KEY]
        self.policy: DeliveryPolicy = self.config.policy
        self.running: dict[str, _Running] = {}
        # Reply tasks not done yet, and whom each room they hold past the socket's own is
        # counted against (``_admit``): one fewer than the tasks, or none.
        self._replies = 0
        self._rooms: list[str] = []
        self._send_lock = asyncio.Lock()
        self._group: asyncio.TaskGroup | None = None  # while ``run`` runs
        self._pinging: asyncio.Task[None] | None = None
        self._closing = False
        # Set when the server shuts down: ends the wait for an ``auth`` message too.
        self._stopping: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Kept from the start: a cut must be able to drop the connection whatever state the
        # WebSocket machinery is in by then.
        self.transport = request.transport
        self.keepalive = SocketKeepalive(
            self.transport,
            keepalive_s=self.policy.keepalive_s or math.inf,  # None: never pinged
            patience_s=self.policy.slow_client_s,
            now=asyncio.get_running_loop().time(),
        )

    async def send(self, message: dict[str, Any]) -> int:
        """Send one message, waiting for the socket to drain; cut a socket that does not. The
        bytes it took on the wire (its frame), as a reply's messages are counted."""
        text = json.dumps(message, separators=(",", ":"))  # ASCII: a byte per character
        async with self._send_lock:
            self.keepalive.sent = True
            try:
                async with asyncio.timeout(self.policy.slow_client_s):
                    await self.ws.send_str(text)
            except TimeoutError:
                raise _SlowClient(
                    f"socket did not drain for {self.policy.slow_client_s:g} s"
                ) from None
            except ConnectionError as exc:
                raise _ClientGone(str(exc)) from None
        return frame_bytes(len(text))

    async def send_error(
        self, tag: str | None, message: str, code: str, *, status: int = 400
    ) -> None:
        body = error_body(message, code=code, status=status)
        await self.send({"type": "error", "id": tag, "data": body})

    async def close(self, code: int, reason: bytes) -> None:
        """Send a close frame and give the client ``CLOSE_TIMEOUT_S`` to answer it.

        The frame waits behind everything the client has not read; if the connection has
        not gone within ``LAST_WORDS_S``, it goes without it (a close waits for the buffer to
        drain, which a client that does not read never lets happen, and that wait does not
        give way to a timeout: only dropping the connection ends it)."""
        if self._closing:
            return
        self._closing = True
        # No frame may follow the close frame (RFC 6455, 5.5.1): the replies' readers and the
        # pinger stop first (a reply's transport checks ``_closing`` before each write).
        self._stop_writers()
        transport = self.transport
        if transport is not None:
            abort_later(transport, LAST_WORDS_S)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.ws.close(code=code, message=reason)

    async def answer_close(self, code: int | None) -> None:
        """Answer the client's close frame, whose code was ``code``: with 1000, or with 1002
        (protocol error) for a code no peer may send (``ws_transport.close_answer``)."""
        answer = close_answer(code)
        if answer == CLOSE_PROTOCOL_ERROR:
            log.info("websocket closed (1002, protocol error): the client sent close code %s", code)
            await self.close(answer, b"invalid close code")
        else:
            await self.close(answer, b"")

    def _stop_writers(self) -> None:
        if self._pinging is not None:
            self._pinging.cancel()
        for running in self.running.values():
            running.task.cancel()

    async def authenticate(self, ring: KeyRing) -> bool:
        """Wait for the first message to carry a valid key. The server shutting down ends
        the wait: the socket closes as every other does then (1001)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + AUTH_TIMEOUT_S
        msg: WSMessage | None = None
        while msg is None:
            receive = asyncio.ensure_future(self.ws.receive())
            waits: set[asyncio.Future[Any]] = {receive, self._stopping}
            timeout = max(0.0, deadline - loop.time())
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
                if self._stopping.done():
                    await self.close(CLOSE_GOING_AWAY, b"shutdown")
                    return False
                break
            msg = receive.result()
            # A control frame is no message (RFC 6455 5.5): the client may ping, or send an
            # unsolicited pong, before its first message.
            if msg.type == WSMsgType.PING:
                with contextlib.suppress(ConnectionError):
                    await self.ws.pong(msg.data)
                msg = None
            elif msg.type == WSMsgType.PONG:
                msg = None
        if msg is not None and msg.type == WSMsgType.CLOSE:
            await self.answer_close(msg.data)
            return False
        key = None
        if msg is not None and msg.type == WSMsgType.TEXT:
            key = auth_key(msg.data)
        if key is not None and ring.accepts(key):
            self.request[OWNER] = key_owner(key)
            self.request[SOCKET_KEY] = key  # for a relay that passes it on
            wait = count_as_owner(self.request)
            if wait is None:
                return True
            error = HTTPAPIError(429, RATE_LIMITED, code="rate_limited", retry_after_s=wait)
            with contextlib.suppress(_SocketDone):
                await self.send(failure_message(None, error))
            await self.close(CLOSE_TRY_AGAIN_LATER, b"rate_limited")
            return False
        if not self.ws.closed:
            await self.refuse_key('send {"type": "auth", "api_key": ...} first, with a valid key')
        return False

    async def refuse_key(self, message: str) -> None:
        """Tell the client its key is refused, and close the socket (4401)."""
        with contextlib.suppress(_SocketDone):  # 401, as over HTTP (4401 is its close code)
            await self.send_error(None, message, "invalid_api_key", status=401)
        await self.close(CLOSE_UNAUTHORIZED, b"invalid_api_key")

    async def run(self) -> None:
        """Read client messages until the socket closes, running replies alongside."""
        if self._stopping.done():  # the server began to shut down before this socket ran
            await self.close(CLOSE_GOING_AWAY, b"shutdown")
            return
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                if self.policy.keepalive_s is not None:
                    self._pinging = group.create_task(
                        self._keep_alive(self.keepalive), name="ws-ping"
                    )
                    self._pinging.add_done_callback(forget_cancellation)
                try:
                    async for msg in self.ws:
                        if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                            await self._on_message(msg, group)
                        elif msg.type == WSMsgType.PING:
                            with contextlib.suppress(ConnectionError):  # closing: no answer
                                await self.ws.pong(msg.data)
                        elif msg.type == WSMsgType.PONG:
                            self.keepalive.answered()
                    if self.ws.close_code is not None and not self.ws.closed:
                        await self.answer_close(self.ws.close_code)  # the client's close
                finally:
                    # The client is gone (or the socket is being cut): stop every reader.
                    self._stop_writers()
        except* _SlowClient as cut:
            log.info("websocket cut: %s", cut.exceptions[0])
            await self.close(CLOSE_POLICY, b"slow_client")
        except* _ClientGone:
            pass  # the client left while a reply was being sent; its readers have stopped
        finally:
            self._group = None
            # Every reply task is done by now; a room taken for one that never began (its
            # task refused by a group already stopping) is given back here.
            gate = self.request.app[GATE_KEY]
            while self._rooms:
                gate.release(self._rooms.pop())

    async def _keep_alive(self, keepalive: SocketKeepalive) -> None:
        """Ping the socket when idle; cut it (as a slow client) when a ping goes unanswered."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(keepalive.next_check_s(loop.time()))
            problem = keepalive.check(loop.time())
            if problem is not None:
                raise _SlowClient(problem)

    def server_stopping(self) -> None:
        """The server is shutting down: every reply here is ending with a ``shutdown`` error;
        send those, then close the socket (1001, going away). A socket still waiting for its
        ``auth`` message closes at once."""
        if not self._stopping.done():
            self._stopping.set_result(None)
        if self._group is not None and not self._closing:
            self._group.create_task(self._close_for_shutdown(), name="ws-shutdown")

    async def _close_for_shutdown(self) -> None:
        readers = [running.task for running in self.running.values()]
        if readers:
            await asyncio.wait(readers, timeout=SHUTDOWN_LAST_WORDS_S)
        await self.close(CLOSE_GOING_AWAY, b"shutdown")

    async def _on_message(self, msg: WSMessage, group: asyncio.TaskGroup) -> None:
        """Handle one client message. Whatever goes wrong with it (the client's mistake, a
        refusal, a bug of ours) becomes an ``error`` message for its tag: only the socket
        itself failing ends the socket and the other replies on it."""
        tag: str | None = None  # known once the message is read far enough to name it
        arrived = time.monotonic()
        asks_reply = False  # a ``reply`` message: it has an access-log line of its own
        try:
            if msg.type != WSMsgType.TEXT:
                raise HTTPAPIError(400, "messages must be JSON text", code="invalid_json")
            limit, size = self.request.app[CONFIG_KEY].max_body_bytes, len(msg.data)
            # In bytes, as a body is counted (encoded only when its characters could pass it).
            if size > limit or (4 * size > limit and len(msg.data.encode()) > limit):
                said = f"a message is larger than {limit} bytes (--max-body-bytes)"
                raise HTTPAPIError(413, said, code="body_too_large")
            try:
                message = parse_message(msg.data)
            except BadMessage as bad:
                tag, asks_reply = bad.tag, bad.kind == "reply"
                raise bad.error from None
            if isinstance(message, AuthMessage):
                if not message.api_key:  # never a key: refused as a wrong key is
                    await self.refuse_key("api_key is empty")
                    return
                self._take_key(message.api_key)
                return
            tag = message.id
            if isinstance(message, CancelMessage):
                self._cancel(tag)
            else:
                asks_reply = True
                self._start(message, group, arrived)
            return
        except _SocketDone:
            raise
        except Exception as exc:
            failure = failure_message(tag, exc)
            status = exc.status if isinstance(exc, HTTPAPIError) else 500
        if asks_reply:  # refused before its reply began: no reply, nothing counted
            self._log_reply(SocketReply(tag, arrived, status=status))
        await self.send(failure)

    def _take_key(self, key: str) -> None:
        """An ``auth`` message on a server without keys of its own: the caller's key, for a
        relay that passes it on (a browser's ``WebSocket`` cannot send it on the upgrade).
        Replies started after it carry it; a socket has one key, from wherever it came."""
        if client_key(self.request) is not None:
            raise HTTPAPIError(
                400,
                "this socket has its key already (from its upgrade or an earlier auth message)",
                code="invalid_value",
                param="api_key",
            )
        self.request[SOCKET_KEY] = key

    def _start(self, message: ReplyMessage, group: asyncio.TaskGroup, arrived: float) -> None:
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
            self.policy,
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
        """Count a reply about to start against its client's limits, as HTTP counts a
        request: one more of its --requests-per-minute; and, past the first reply running on
        the socket, one more of its --max-concurrent-per-client (the socket is one open
        request, its first reply's), so a socket runs no more replies at once than its
        client could over HTTP. The room is given back as replies end (``_reply_over``).

        Raises:
            HTTPAPIError: the ``429`` of a client at either limit.
        """
        gate = self.request.app[GATE_KEY]
        identity, now = identity_of(self.request), time.monotonic()
        another = bool(gate.max_concurrent and self._replies)
        wait = gate.admit(identity, now) if another else gate.spend(identity, now)
        if wait is not None:
            raise HTTPAPIError(429, RATE_LIMITED, code="rate_limited", retry_after_s=wait)
        if another:
            self._rooms.append(identity)
        self._replies += 1

    def _reply_over(self, running: _Running, task: asyncio.Task[None]) -> None:
        """A reply's task is done (ended, or cancelled before it ran): the room it took past
        the socket's own is free again, so a socket counts as many requests as it runs
        replies, and never fewer than one; its access-log line says how it ended."""
        self._replies -= 1
        if len(self._rooms) > max(0, self._replies - 1):
            self.request.app[GATE_KEY].release(self._rooms.pop())
        self._log_reply(running.account)

    def _log_reply(self, account: SocketReply) -> None:
        """One ``reply`` message's access-log line, once it has ended; the socket's own line
        counts them."""
        self.request[SOCKET_REPLIES] = self.request.get(SOCKET_REPLIES, 0) + 1
        log_socket_reply(self.request, account)

    def _cancel(self, tag: str) -> None:
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
        except _SocketDone:
            raise  # the socket itself is done for: every reply on it ends
        except Exception as exc:  # a refusal, or a bug: this reply ends, the others go on
            account.status = exc.status if isinstance(exc, HTTPAPIError) else 500
            account.on_send(await self.send(failure_message(tag, exc)))
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
            cut=self._cut_by_follower,
            closing=lambda: self._closing,
            keepalive=self.keepalive,
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

    def failed_by_client(self, reason: str) -> None:
        """The client broke the WebSocket protocol: the connection is being closed (1002)
        under the session, which only stops (its readers end as the socket goes)."""
        if not self._closing:
            self._closing = True
            log.info("websocket closed (1002, protocol error): %s", reason)

    def _cut_by_follower(self) -> None:
        """A follower found the socket unable to keep up and is closing it (1008)."""
        if not self._closing:
            self._closing = True
            log.info("websocket cut: slow_client")
            for running in self.running.values():
                running.task.cancel()


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
