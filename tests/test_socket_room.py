"""A cut connection's socket dropped after its grace: only when its last bytes have not left."""

from __future__ import annotations

import asyncio
from typing import Any

from replystream.server.socket_room import abort_later

BIG = b"x" * (8 << 20)  # more than the kernel's buffers take: some waits in the transport


class Keeper(asyncio.Protocol):
    def __init__(self, transports: list[asyncio.Transport], made: asyncio.Event) -> None:
        self.transports, self.made = transports, made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transports.append(transport)
        self.made.set()


async def cut_connection(read: bool) -> tuple[list[dict[str, Any]], bool]:
    """A server writes more than the socket takes, closes, and asks for an abort in 0.3 s;
    the client reads it all (``read``) or nothing. What the loop reported, and whether the
    client saw the whole body before the end of the stream."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    transports: list[asyncio.Transport] = []
    made = asyncio.Event()
    server = await loop.create_server(lambda: Keeper(transports, made), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.wait_for(made.wait(), 10)
        transport = transports[0]
        transport.write(BIG)
        transport.close()
        abort_later(transport, 0.3)
        got = b""
        if read:
            async with asyncio.timeout(30):
                while chunk := await reader.read(1 << 20):
                    got += chunk
        await asyncio.sleep(0.6)  # past the grace
        if not read:
            async with asyncio.timeout(30):
                while chunk := await reader.read(1 << 20):
                    got += chunk
        return errors, got == BIG
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
        loop.set_exception_handler(None)


async def test_a_socket_whose_last_bytes_left_is_not_aborted_again():
    # asyncio's transport, drained after close(), lets go of its loop without counting
    # itself lost: an abort then raised inside the loop's callback.
    errors, whole = await cut_connection(read=True)
    assert whole and not errors, errors


async def test_a_socket_whose_last_bytes_cannot_leave_is_dropped():
    errors, whole = await cut_connection(read=False)
    assert not whole and not errors, errors
