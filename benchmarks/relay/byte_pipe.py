"""The floor for any relay written in Python on asyncio: bytes piped, nothing parsed.

What this file decides: the least a Python process can do per relayed chunk, so a relay's
figure can be read against it. Each client connection gets its own upstream connection; what
one side sends is written to the other as it arrives, through ``asyncio.Protocol`` callbacks
(no task, no stream reader, no HTTP parser, no copy beyond the socket's). It is not a relay
anyone could deploy (one upstream connection per client connection, no request read, no
error said): a relay that parses and re-encodes each chunk can only cost more.

With ``--parse`` it is the floor for a relay that does parse and re-encode each chunk, and
nothing else: the upstream's response is read with httptools (as replystream's own client
reads it), each SSE message split out, a text chunk's JSON parsed (pydantic_core's
``from_json``, as replystream parses it) and a chunk of its own written with that text
(``json.encoder``'s C string encoder), framed in chunks under a head of its own; any other
message (the finish, the usage, ``[DONE]``) goes on as read. No request is read, nothing is
checked, logged, counted or kept: what it costs beside the plain pipe is the parse and the
re-encode with sockets on both sides.

Run: python benchmarks/relay/byte_pipe.py --upstream HOST:PORT [--port 0] [--loop uvloop]
         [--parse]
It prints ``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from json.encoder import encode_basestring_ascii
from typing import Any, cast

import httptools
from pydantic_core import from_json


class _Side(asyncio.Protocol):
    """One side of a pipe: what it reads goes to its peer's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.held: list[bytes] = []  # read before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio's, so no isinstance).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.held.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()


HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


class _ParsingSide(_Side):
    """The upstream side of a parsing pipe: each response read, its chunks written anew."""

    def __init__(self) -> None:
        super().__init__()
        self.parser = httptools.HttpResponseParser(self)
        self.events = b""  # SSE bytes read, not yet a whole message
        self.prefix = b""  # the start of each text chunk written (made at each response head)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        self._write(HEAD)
        self.prefix = (
            b'data: {"id":"chatcmpl-pipe","object":"chat.completion.chunk","created":'
            b"%d" % time.time() + b',"model":"bench","choices":[{"index":0,"delta":{"content":'
        )

    def on_body(self, body: bytes) -> None:
        events = self.events + body
        out = []
        start = 0
        while (end := events.find(b"\n\n", start)) >= 0:
            message = events[start : end + 2]
            start = end + 2
            text = _text_of(message)
            if text is None:
                out.append(message)
            else:
                out.append(
                    self.prefix
                    + encode_basestring_ascii(text).encode()
                    + b'},"logprobs":null,"finish_reason":null}]}\n\n'
                )
        self.events = events[start:]
        if out:
            data = b"".join(out)
            self._write(b"%x\r\n%s\r\n" % (len(data), data))

    def on_message_complete(self) -> None:
        self._write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)


def _text_of(message: bytes) -> str | None:
    """A chat chunk's text, when the message is one chunk of one choice's text."""
    if not message.startswith(b"data: {"):
        return None
    chunk: Any = from_json(message[6:])
    choices = chunk.get("choices")
    if not choices or choices[0].get("finish_reason") is not None:
        return None
    text = choices[0].get("delta", {}).get("content")
    return text if isinstance(text, str) and text else None


class _Client(_Side):
    def __init__(self, upstream: tuple[str, int], parse: bool) -> None:
        super().__init__()
        self.upstream = upstream
        self.parse = parse

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            side = _ParsingSide if self.parse else _Side
            _, upstream = await loop.create_connection(side, *self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.peer, upstream.peer = upstream, self
        assert upstream.transport is not None
        for data in self.held:
            upstream.transport.write(data)
        self.held.clear()


async def serve(upstream: tuple[str, int], port: int, parse: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Client(upstream, parse), "127.0.0.1", port, backlog=4096
    )
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument(
        "--parse", action="store_true", help="parse each chunk and write one of its own"
    )
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        parser.error(
            f"argument --upstream: want HOST:PORT, a port from 1 to 65535, got {args.upstream!r}"
        )
    # Checked by hand: a peer measured against replystream loads none of its code.
    if not 0 <= args.port <= 65535:
        parser.error(
            f"argument --port: want a port from 0 to 65535 (0 picks a free one), got {args.port}"
        )
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve((host, int(port)), args.port, args.parse))
    else:
        asyncio.run(serve((host, int(port)), args.port, args.parse))


if __name__ == "__main__":
    main()
