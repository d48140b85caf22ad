"""The server's accepts on uvloop: every connection waiting, each time the socket is readable.

uvloop's own server accepts one connection per turn of its loop; ``BatchAcceptingServer``
accepts all that wait. Real sockets on loopback, a real uvloop loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from replystream.server.accepting import BatchAcceptingServer

uvloop = pytest.importorskip("uvloop", reason="the batched accepts are uvloop's")


class Counted(asyncio.Protocol):
    def __init__(self, made: list[asyncio.Transport], served: asyncio.Event | None = None) -> None:
        self.made, self.served = made, served

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)  # type: ignore[arg-type]
        if self.served is not None:
            self.served.set()


@contextlib.asynccontextmanager
async def batch_server(
    made: list[asyncio.Transport], served: asyncio.Event | None = None
) -> AsyncIterator[tuple[BatchAcceptingServer, tuple[str, int]]]:
    """A ``BatchAcceptingServer`` on a loopback socket, its connections in ``made``; its
    address. Closed, with what it served, when the block ends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    server = BatchAcceptingServer(loop, listener, lambda: Counted(made, served), backlog=128)
    try:
        yield server, listener.getsockname()
    finally:
        server.close()
        await server.wait_closed()
        for transport in made:
            transport.close()
        listener.close()


def on_uvloop(main: Callable[[], object]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())  # type: ignore[arg-type]


def test_every_waiting_connection_is_served_within_a_few_turns_of_the_loop() -> None:
    async def main() -> None:
        made: list[asyncio.Transport] = []
        async with batch_server(made) as (server, address):
            # 40 connections complete in the kernel and wait to be accepted.
            clients = [socket.create_connection(address) for _ in range(40)]
            for _ in range(10):  # turns of the loop (uvloop's own server: one accept each)
                await asyncio.sleep(0)
            assert len(made) == 40
            for client in clients:
                client.sendall(b"x")  # each a connection of its own, open and served
                client.close()
        assert not server.is_serving()

    on_uvloop(main)


def test_connections_accepted_before_the_server_closes_are_still_served() -> None:
    # A shutdown closes the server between the accept and the hand-over: what was accepted is
    # served (its request then refused as the shutdown says), not cut unanswered.
    async def main() -> None:
        made: list[asyncio.Transport] = []
        async with batch_server(made) as (server, address):
            clients = [socket.create_connection(address) for _ in range(10)]
            await asyncio.sleep(0)  # one turn: accepted, not handed over yet
            server.close()
            await server.wait_closed()
            assert len(made) == 10
            for client in clients:
                client.close()

    on_uvloop(main)


def test_out_of_file_descriptors_accepting_pauses_and_says_so_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        made: list[asyncio.Transport] = []
        served = asyncio.Event()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        async with batch_server(made, served) as (_, address):
            client = socket.create_connection(address)
            # A few descriptors over those open, then none left for the accept.
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            spare = []
            try:
                while True:
                    spare.append(socket.socket())
            except OSError:
                pass
            try:
                for _ in range(10):
                    await asyncio.sleep(0)
            finally:
                for sock in spare:
                    sock.close()
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert made == []
            await asyncio.wait_for(served.wait(), 10)  # ACCEPT_RETRY_S (1 s) on: accepting again
            assert len(made) == 1
            client.close()
        assert (soft, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)

    with caplog.at_level("WARNING", logger="replystream.server"):
        on_uvloop(main)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["accepting connections paused for 1 s: too many open files"], lines
    assert not any(r.exc_info for r in caplog.records)


def test_close_clients_and_abort_clients_end_the_connections_handed_over() -> None:
    # asyncio.AbstractServer's two since Python 3.13: every connection the server handed over
    # and still open is closed, or aborted (closed without what it had yet to send).
    async def main() -> None:
        made: list[asyncio.Transport] = []
        async with batch_server(made) as (server, address):
            clients = [socket.create_connection(address, timeout=5) for _ in range(2)]
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(made) == 2
            made[1].close()  # one the server's protocol closed itself: closing it again is harmless
            server.close_clients()
            await asyncio.sleep(0.05)
            assert all(transport.is_closing() for transport in made)
            assert [client.recv(1) for client in clients] == [b"", b""]
            late = socket.create_connection(address, timeout=5)
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(made) == 3
            server.abort_clients()
            await asyncio.sleep(0.05)
            assert made[2].is_closing()
            assert late.recv(1) == b""
            for client in [*clients, late]:
                client.close()

    on_uvloop(main)
