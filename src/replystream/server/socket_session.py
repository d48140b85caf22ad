"""One WebSocket of ``GET /v1/ws`` once upgraded: its messages, the replies running on it.

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
   client's per-client limits allow (``guard.SocketRooms``). A socket that has sent
   nothing for ``keepalive_s`` is pinged; a ping not answered within ``slow_client_s`` cuts
   it as rule 3 does (``ws_transport.SocketKeepalive``). aiohttp's own heartbeat is not used:
   it pings whatever is being sent, and drops a reader merely behind its replies.
5. One error boundary per client message and per reply task: whatever fails there becomes
   an ``error`` message for its tag. Only ``Session.send`` failing (``SocketDone``) ends the
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
from typing import Any

from aiohttp import WSMessage, WSMsgType, web

from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.task_stop import forget_cancellation
from replystream.server.auth import OWNER, SOCKET_KEY, KeyRing, client_key, key_owner
from replystream.server.context import CONFIG_KEY
from replystream.server.errors import HTTPAPIError, error_body
from replystream.server.guard import RATE_LIMITED, count_as_owner
from replystream.server.native_schemas import AuthMessage, CancelMessage
from replystream.server.socket_messages import BadMessage, auth_key, parse_message
from replystream.server.socket_replies import (
    ClientGone,
    SlowClient,
    SocketDone,
    SocketReplies,
    failure_message,
)
from replystream.server.socket_room import LAST_WORDS_S, abort_later
from replystream.server.ws_transport import (
    CLOSE_PROTOCOL_ERROR,
    SocketKeepalive,
    close_answer,
    frame_bytes,
)

log = logging.getLogger("replystream.websocket")

AUTH_TIMEOUT_S = 10.0
CLOSE_UNAUTHORIZED = 4401  # application range (4000-4999): "401" over a WebSocket
CLOSE_TRY_AGAIN_LATER = 1013  # RFC 6455's: the server cannot take the socket now (a 429)
CLOSE_POLICY = 1008
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TIMEOUT_S = 1.0  # how long a close waits for the client's answering close frame
# At shutdown, how long the replies on a socket may take to send their last events (each
# reply's log already ends with its ``shutdown`` error) before the socket is closed.
SHUTDOWN_LAST_WORDS_S = 2.0


class Session:
    """One WebSocket connection and the replies running over it."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.policy: DeliveryPolicy = request.app[CONFIG_KEY].policy
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
        self.replies = SocketReplies(
            request,
            send=self.send,
            cut=self._cut_by_follower,
            closing=lambda: self._closing,
            keepalive=self.keepalive,
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
                raise SlowClient(
                    f"socket did not drain for {self.policy.slow_client_s:g} s"
                ) from None
            except ConnectionError as exc:
                raise ClientGone(str(exc)) from None
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
        self.replies.stop()

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
            with contextlib.suppress(SocketDone):
                await self.send(failure_message(None, error))
            await self.close(CLOSE_TRY_AGAIN_LATER, b"rate_limited")
            return False
        if not self.ws.closed:
            await self.refuse_key('send {"type": "auth", "api_key": ...} first, with a valid key')
        return False

    async def refuse_key(self, message: str) -> None:
        """Tell the client its key is refused, and close the socket (4401)."""
        with contextlib.suppress(SocketDone):  # 401, as over HTTP (4401 is its close code)
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
        except* SlowClient as cut:
            log.info("websocket cut: %s", cut.exceptions[0])
            await self.close(CLOSE_POLICY, b"slow_client")
        except* ClientGone:
            pass  # the client left while a reply was being sent; its readers have stopped
        finally:
            self._group = None
            # Every reply task is done by now.
            self.replies.release_all()

    async def _keep_alive(self, keepalive: SocketKeepalive) -> None:
        """Ping the socket when idle; cut it (as a slow client) when a ping goes unanswered."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(keepalive.next_check_s(loop.time()))
            problem = keepalive.check(loop.time())
            if problem is not None:
                raise SlowClient(problem)

    def server_stopping(self) -> None:
        """The server is shutting down: every reply here is ending with a ``shutdown`` error;
        send those, then close the socket (1001, going away). A socket still waiting for its
        ``auth`` message closes at once."""
        if not self._stopping.done():
            self._stopping.set_result(None)
        if self._group is not None and not self._closing:
            try:
                self._group.create_task(self._close_for_shutdown(), name="ws-shutdown")
            except RuntimeError:
                # The group is ending already (its client left, or the socket is being cut):
                # no goodbye is left to send, and the shutdown goes on to the other sockets.
                pass

    async def _close_for_shutdown(self) -> None:
        readers = self.replies.tasks()
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
                self.replies.cancel(tag)
            else:
                asks_reply = True
                self.replies.start(message, group, arrived)
            return
        except SocketDone:
            raise
        except Exception as exc:
            failure = failure_message(tag, exc)
            status = exc.status if isinstance(exc, HTTPAPIError) else 500
        if asks_reply:  # refused before its reply began: no reply, nothing counted
            self.replies.refused(tag, arrived, status)
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
            self.replies.stop()
