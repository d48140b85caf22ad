"""The floor for any relay written in Python on asyncio: bytes piped, nothing parsed.

What this file decides: the least a Python process can do per relayed chunk, so a relay's
figure can be read against it. Each client connection gets its own upstream connection; what
one side sends is written to the other as it arrives, through ``asyncio.Protocol`` callbacks
(no task, no stream reader, no HTTP parser, no copy beyond the socket's). It is not a relay
anyone could deploy (one upstream connection per client connection, no request read, no
error said): a relay that parses and re-encodes each chunk can only cost more.

Run: python benchmarks/relay/byte_pipe.py --upstream HOST:PORT [--port 0] [--loop uvloop]
It prints ``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast


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


class _Client(_Side):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(_Side, *self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.peer, upstream.peer = upstream, self
        assert upstream.transport is not None
        for data in self.held:
            upstream.transport.write(data)
        self.held.clear()


async def serve(upstream: tuple[str, int], port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), "127.0.0.1", port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve((host, int(port)), args.port))
    else:
        asyncio.run(serve((host, int(port)), args.port))


if __name__ == "__main__":
    main()
