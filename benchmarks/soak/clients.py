"""The soak's clients: one coroutine per way a reader can treat a reply.

Each returns a ``Result``: how the reply ended for this reader and the text it read (None
when it read none), for ``run.py`` to check against the reference text of the same request.
Kinds:
- ``complete``: reads the stream to its end.
- ``buffered``: ``"stream": false``, one JSON body.
- ``leave``: reads some tokens, then closes the connection.
- ``cancel``: reads some tokens, asks ``POST /v1/replies/{id}/cancel``, reads on to the end.
- ``resume``: a resumable reply read through ``ResumingReader``, its connection cut one to three
  times; each resume carries ``Last-Event-ID``.
- ``disconnect``: a raw socket that goes away at a random point: mid-request, before the
  headers, after some bytes, or with a reset.
- ``slow``: a raw WebSocket with a tiny receive buffer that starts many long replies at once
  and stops reading until the server has cut it; what it then reads must end with the cut.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from replystream.client.resume import Backoff, ResumeFailed, ResumingReader
from replystream.client.transport import HTTPResponse, TransportError, http_request
from replystream.sse import Event, EventParser, SSEError

Kind = Literal["complete", "buffered", "leave", "cancel", "resume", "disconnect", "slow"]
KINDS: tuple[Kind, ...] = (
    "complete",
    "buffered",
    "leave",
    "cancel",
    "resume",
    "disconnect",
    "slow",
)
SLOW_WAIT_S = 30.0  # how long a slow reader waits for the server to let its connection go


@dataclass(frozen=True, slots=True)
class Ask:
    """One distinct request; the soak sends each many times."""

    prompt: str
    seed: int
    max_tokens: int
    temperature: float

    def body(self, **extra: Any) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **extra,
        }


@dataclass(frozen=True, slots=True)
class Result:
    """How one reply ended for its reader.

    ``ending``: ``done``, ``moderated``, ``error:CODE``, ``left`` (the reader closed),
    ``eof`` (the stream ended without an end marker), ``http:STATUS``, ``failed:WHY``,
    ``gone`` (disconnects), ``cut`` / ``not_cut`` (slow readers; ``:held`` when the server
    still held the connection after ``SLOW_WAIT_S``).
    """

    kind: Kind
    ask: int
    ending: str
    text: str | None
    reply_id: str | None = None
    reconnects: int = 0


def _post_json(body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    return json.dumps(body).encode(), headers


async def _events(response: HTTPResponse) -> AsyncIterator[Event]:
    parser = EventParser()
    async for chunk in response:
        for event in parser.feed(chunk.data):
            yield event


def _error_code(event: Event) -> str:
    try:
        return str(json.loads(event.data)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


def _token_text(event: Event) -> str:
    payload = json.loads(event.data)
    return str(payload["text"])


async def stream(
    url: str,
    ask_index: int,
    ask: Ask,
    kind: Kind,
    *,
    leave_after: int | None = None,
    cancel_after: int | None = None,
) -> Result:
    """Read a streamed reply; leave or ask to cancel after some tokens if told to."""
    body, headers = _post_json(ask.body(stream=True))
    parts: list[str] = []
    reply_id: str | None = None
    ending = "eof"
    try:
        async with http_request(
            f"{url}/v1/replies", method="POST", body=body, headers=headers
        ) as response:
            if response.status != 200:
                return Result(kind, ask_index, f"http:{response.status}", None)
            reply_id = response.headers.get("x-reply-id")
            async for event in _events(response):
                if event.type == "token":
                    parts.append(_token_text(event))
                    if leave_after is not None and len(parts) >= leave_after:
                        ending = "left"
                        break
                    if cancel_after is not None and len(parts) == cancel_after:
                        await _cancel(url, reply_id)
                elif event.type == "done":
                    ending = "done"
                    break
                elif event.type == "moderated":
                    ending = "moderated"
                    break
                elif event.type == "error":
                    ending = f"error:{_error_code(event)}"
                    break
    except (TransportError, SSEError, OSError) as exc:
        ending = f"failed:{type(exc).__name__}"
    return Result(kind, ask_index, ending, "".join(parts), reply_id)


async def _cancel(url: str, reply_id: str | None) -> None:
    if reply_id is None:
        raise RuntimeError("the stream carried no X-Reply-Id")
    async with http_request(f"{url}/v1/replies/{reply_id}/cancel", method="POST") as response:
        async for _chunk in response:
            pass
        if response.status not in (200, 404):  # 404: the reply had already ended
            raise RuntimeError(f"cancel answered {response.status}")


async def buffered(url: str, ask_index: int, ask: Ask) -> Result:
    """One ``"stream": false`` reply, read as a whole JSON body."""
    body, headers = _post_json(ask.body(stream=False))
    headers["Accept"] = "application/json"
    try:
        async with http_request(
            f"{url}/v1/replies", method="POST", body=body, headers=headers
        ) as response:
            raw = b"".join([chunk.data async for chunk in response])
    except (TransportError, OSError) as exc:
        return Result("buffered", ask_index, f"failed:{type(exc).__name__}", None)
    if response.status != 200:
        return Result("buffered", ask_index, f"http:{response.status}", None)
    payload = json.loads(raw)
    reason = payload.get("finish_reason")
    ending = "moderated" if reason == "moderated" else "done"
    return Result("buffered", ask_index, ending, str(payload["text"]))


async def resume(url: str, ask_index: int, ask: Ask, cuts: list[int], seed: int) -> Result:
    """A resumable reply whose connection is closed after each count of tokens in ``cuts``."""
    reader = ResumingReader(
        f"{url}/v1/replies",
        json_body=ask.body(stream=True, resumable=True),
        backoff=Backoff(base_s=0.05, cap_s=1.0, max_attempts=10),
        seed=seed,
    )
    parts: list[str] = []
    pending = sorted(cuts)
    ending: str | None = None
    cut_connections = 0
    try:
        while ending is None:
            # Closing the generator drops this connection, and the next one resumes.
            async with contextlib.aclosing(reader.events()) as events:
                async for event in events:
                    if event.type == "token":
                        parts.append(_token_text(event))
                        if pending and len(parts) >= pending[0]:
                            pending.pop(0)
                            cut_connections += 1
                            break  # closing the generator closes this connection
                    elif event.type in ("done", "moderated"):
                        ending = event.type
                    elif event.type == "error":
                        ending = f"error:{_error_code(event)}"
                else:
                    if ending is None:
                        ending = "eof"
    except ResumeFailed as exc:
        ending = f"failed:{exc}"
    return Result(
        "resume",
        ask_index,
        ending,
        "".join(parts),
        reader.reply_id,
        reader.reconnects + cut_connections,
    )


def _request_bytes(host: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/replies HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


async def disconnect(url: str, ask_index: int, ask: Ask, rng: random.Random) -> Result:
    """A client that goes away at a random point of its request or reply."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = _request_bytes(parts.netloc, ask.body(stream=True))
    how = rng.choice(("mid_request", "before_headers", "after_bytes", "reset"))
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return Result("disconnect", ask_index, f"failed:{type(exc).__name__}", None)
    try:
        if how == "mid_request":
            writer.write(request[: rng.randrange(1, len(request))])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
        else:
            writer.write(request)
            await writer.drain()
            if how != "before_headers":
                await reader.read(rng.randrange(1, 1500))
            if how == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return Result("disconnect", ask_index, "gone", None)


def _ws_frame(payload: bytes) -> bytes:
    """One masked text frame, as a client must send it (RFC 6455, 5.2)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x81, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x81, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def slow(
    url: str,
    ask_index: int,
    ask: Ask,
    replies: int,
    server_holds: Callable[[int], bool],
) -> Result:
    """Start ``replies`` long replies on one WebSocket and stop reading.

    One reply is small next to what a loopback socket absorbs (the kernel's send buffer grows
    to 4 MiB), so many replies side by side are what fill it. Once full, the server's sends
    wait and its slow-client limits cut the socket. ``server_holds(port)`` (whether the server
    still has a socket open to this reader's port) says when: the server must let the
    connection go within ``SLOW_WAIT_S`` although nothing is read (else the ending says
    ``:held``). Then this reader reads what the connection still carries: the close frame
    naming ``slow_client`` (``cut``), or nothing more because the server, after waiting for
    that frame to leave, aborted the connection (``cut:aborted``).
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        upgrade = (
            f"GET /v1/ws HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        )
        await loop.sock_sendall(sock, upgrade.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = await loop.sock_recv(sock, 1)  # byte by byte: nothing past the head
            if not data:
                raise ConnectionError("closed during the upgrade")
            head += data
        if not head.startswith(b"HTTP/1.1 101"):
            return Result("slow", ask_index, f"http:{head[9:12].decode()}", None)
        frames = b"".join(
            _ws_frame(json.dumps({"type": "reply", "id": f"r{i}", **ask.body()}).encode())
            for i in range(replies)
        )
        await loop.sock_sendall(sock, frames)
        port = sock.getsockname()[1]
        deadline = loop.time() + SLOW_WAIT_S
        while loop.time() < deadline and server_holds(port):  # noqa: ASYNC110
            await asyncio.sleep(0.25)
        released = not server_holds(port)
        tail = b""
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(30):
                while data := await loop.sock_recv(sock, 1 << 16):
                    tail = (tail + data)[-4096:]
        if b"slow_client" in tail:
            ending = "cut"
        elif released:
            # The server dropped the connection with its close frame still queued behind what
            # this reader never took (the kernel discards that on abort): a cut all the same.
            ending = "cut:aborted"
        else:
            ending = "not_cut:held"  # the server kept the connection while nothing was read
    except OSError as exc:
        ending = f"failed:{type(exc).__name__}"
    finally:
        sock.close()
    return Result("slow", ask_index, ending, None)
