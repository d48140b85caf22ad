"""A loopback TCP proxy that cuts connections: each one passes a random number of response
bytes, then both sides are closed, as a network drop or a proxy timeout would."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable


class ChaosProxy:
    def __init__(self, upstream: Callable[[], tuple[str, int]], budget: Callable[[], int | None]):
        self._upstream = upstream  # where each new connection goes (lets tests switch replicas)
        self._budget = budget  # response bytes a connection may pass; None: no limit
        self.cuts = 0
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None
    ) -> bool:
        """Copy until EOF (False) or until ``limit`` bytes went through (True: a cut)."""
        sent = 0
        while True:
            data = await reader.read(65536)
            if not data:
                return False
            if limit is not None and sent + len(data) >= limit:
                writer.write(data[: max(0, limit - sent)])
                return True
            sent += len(data)
            writer.write(data)
            await writer.drain()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        host, port = self._upstream()
        try:
            up_r, up_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        limit = self._budget()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pipe(client_r, up_w, None))
                down = group.create_task(self._pipe(up_r, client_w, limit))
                done = await down
                if done:
                    self.cuts += 1
                raise _Closed
        except* (_Closed, ConnectionError, OSError):
            pass
        finally:
            for writer in (client_w, up_w):
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()


class _Closed(Exception):
    pass


@contextlib.asynccontextmanager
async def chaos_proxy(
    upstream: Callable[[], tuple[str, int]], budget: Callable[[], int | None]
) -> AsyncIterator[tuple[str, ChaosProxy]]:
    proxy = ChaosProxy(upstream, budget)
    server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", proxy
    finally:
        server.close()
        await server.wait_closed()


def random_budget(rng: random.Random, low: int, high: int) -> Callable[[], int | None]:
    return lambda: rng.randint(low, high)
