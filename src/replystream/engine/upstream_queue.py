"""Requests waiting for room at upstreams that are at their limit of requests at once
(``max_outstanding``), as HAProxy queues for a server at its ``maxconn``: first come, first
served, each for at most a bound of its own.

This file decides who is woken when: when a request at an upstream ends, the first waiter
for a model that upstream serves (one, not all: a slot lets one request in); when the routes
change, every waiter, to look again. A woken waiter that finds the room taken already (by a
request that came meanwhile) waits again at the front, where it was. What counts as room is
``upstream_pool``'s; what a request does when its wait is over is ``upstream_relay``'s.
"""

from __future__ import annotations

import asyncio
from collections import deque

from replystream.engine.upstream_pool import Backend


class _Waiter:
    __slots__ = ("model", "woken")

    def __init__(self, model: str | None, woken: asyncio.Future[Backend | None]) -> None:
        self.model = model
        self.woken = woken  # done with the upstream that has room (None: look at them all)


class RoomQueue:
    """The requests waiting for room, oldest first."""

    def __init__(self) -> None:
        self._waiting: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, model: str | None, within_s: float, *, again: bool = False) -> bool:
        """Wait until an upstream that may serve ``model`` has room (True), or for
        ``within_s`` seconds (False). ``again``: a waiter woken before, whose room was taken
        first, waits at the front."""
        waiter = _Waiter(model, asyncio.get_running_loop().create_future())
        if again:
            self._waiting.appendleft(waiter)
        else:
            self._waiting.append(waiter)
        entered = False
        try:
            async with asyncio.timeout(within_s):
                # Shielded: a cancel (the client left, or the time is up) must not cancel the
                # future, which would hide whether it was woken first.
                await asyncio.shield(waiter.woken)
            entered = True
            return True
        except TimeoutError:
            return False
        finally:
            if not entered and not waiter.woken.done():  # the time is up, or its client left
                self._waiting.remove(waiter)
            elif not entered and (room := waiter.woken.result()) is not None:
                self.freed(room)  # woken, then gone before it took the room: it goes on

    def freed(self, backend: Backend) -> None:
        """A request at ``backend`` ended: wake the first waiter it may serve."""
        for waiter in self._waiting:
            if backend.serves(waiter.model):
                self._waiting.remove(waiter)
                waiter.woken.set_result(backend)
                return

    def wake_all(self) -> None:
        """The upstreams changed: every waiter looks again."""
        while self._waiting:
            self._waiting.popleft().woken.set_result(None)
