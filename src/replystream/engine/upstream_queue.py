"""Requests waiting for room at upstreams that are at their limit of requests at once
(``max_outstanding``), as HAProxy queues for a server at its ``maxconn``: first come, first
served, each for at most a bound of its own.

This file decides who is woken when: when a request at an upstream ends, the first waiter
for a model that upstream serves (one, not all: a slot lets one request in); when the routes
change, every waiter, to look again. A woken waiter that finds the room taken already (by a
request that came meanwhile) waits again at the front, where it was. What counts as room is
``upstream_pool``'s; what a request does when its wait is over is ``upstream_relay``'s.

With workers sharing the limits (``upstream_slots``), a slot another worker gives back wakes
nobody here: while anyone waits, the line looks every ``poll_s`` for such room (``look``:
an upstream once per slot freed elsewhere) and wakes a waiter for each, as the end of a
request here would. A request ending here still wakes the first of this line at once, so a
slot freed in one worker goes first to that worker's line: across workers the order is
first come first served only as far as the polls let it (docs/engines.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from replystream.engine.upstream_pool import Backend


class _Waiter:
    __slots__ = ("model", "woken")

    def __init__(self, model: str | None, woken: asyncio.Future[Backend | None]) -> None:
        self.model = model
        self.woken = woken  # done with the upstream that has room (None: look at them all)


class RoomQueue:
    """The requests waiting for room, oldest first."""

    def __init__(
        self, look: Callable[[], Iterable[Backend]] | None = None, poll_s: float = 0.02
    ) -> None:
        self._waiting: deque[_Waiter] = deque()
        self._look = look  # room freed elsewhere (None: a request here is all that frees it)
        self._poll_s = poll_s
        self._poll: asyncio.TimerHandle | None = None

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
        if self._look is not None and self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(self._poll_s, self._polled)
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

    def _polled(self) -> None:
        """Wake a waiter for each slot freed elsewhere; look again while anyone waits."""
        self._poll = None
        if not self._waiting or self._look is None:
            return
        for backend in self._look():
            self.freed(backend)
        if self._waiting:
            self._poll = asyncio.get_running_loop().call_later(self._poll_s, self._polled)
