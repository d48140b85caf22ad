"""Requests waiting for room at upstreams that are at their limit of requests at once
(``max_outstanding``), as HAProxy queues for a server at its ``maxconn``: first come, first
served, each for at most a bound of its own.

This file decides who is woken when: when a request at an upstream ends, the first waiter
for a model that upstream serves (one, not all: a slot lets one request in) that the room
there is enough for: a request of several choices waits for room for all of them at once
(``upstream_admission``), and says how it tells (``fits``); while there is not, a room freed
goes on to the next waiter, one that does not need as much (first come, first served among
those that fit), for the first half of its wait. Past that half it is starving: a room freed
that it may use is held for it (no waiter behind it is woken for it), and a request that
comes meanwhile for its model waits in line behind it instead of taking the room (``holds_
room_for``), so the room it needs gathers while it still has time to wait. When the routes
change, every waiter looks again, and so does every waiter when a starving one leaves the
line without the room held for it. A woken waiter that finds the room taken already (by a
request that came meanwhile) waits again at the front, where it was. What counts as room is
``upstream_pool``'s; what a request does when its wait is over is ``upstream_attempts``'s.

With workers sharing the limits (``upstream_slots``), the lines of all workers are served
oldest first, as far as each can tell: a slot another worker gives back wakes nobody here, so
while anyone waits the line asks every ``poll_s`` or so (jittered, so that no worker's polls
always come first) for such room (``OtherLines.freed``: an upstream once per free slot) and
wakes a waiter for each; and each line shows when its first waiter began to wait, and, when
that one needs more room than one, from when room is held for it (half its wait, as here)
and for which model: from then on no other worker takes room it may use for a request that
began to wait after it, one that comes or one in its line, so the room gathers for it across
the workers as it does in one (``upstream_shared_limits``). A slot
given back here, or found free by a poll, goes to this line only if no other line began to
wait earlier; else it is left to that one's poll, unless it is still free after
``DEFERRED_POLLS`` polls here (the older line may wait for another model, or its worker be
gone): that is at least 2 poll periods here, and the older line polls at least every 1.5,
so it takes the room first unless its worker is late.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from replystream.engine.upstream_pool import Backend

# Polls in a row that leave free room to an older line elsewhere: at least 2 poll periods
# here, against at most 1.5 between two polls there (the jitter's bounds).
DEFERRED_POLLS = 4


class _Waiter:
    __slots__ = ("fits", "model", "since", "starves_at", "woken")

    def __init__(
        self,
        model: str | None,
        since: float,
        woken: asyncio.Future[Backend | None],
        fits: Callable[[], bool] | None,
        starves_at: float,
    ) -> None:
        self.model = model
        self.since = since  # when it began to wait (before any wait ``again``)
        self.woken = woken  # done with the upstream that has room (None: look at them all)
        self.fits = fits  # whether the room there is now is enough for it (None: any is)
        # From when room is held for it (``time.monotonic``): half its wait in line.
        self.starves_at = starves_at

    def starving(self, now: float) -> bool:
        """Whether it needs more room than one and has waited half of its time for it."""
        return self.fits is not None and now >= self.starves_at


class OtherLines(Protocol):
    """The lines of the other workers that hold the limits with this one."""

    def freed(self, before: float) -> Iterable[Backend]:
        """Each upstream once per slot of it free now (freed elsewhere) this line may use,
        whose first waiter began to wait at ``before``."""
        ...

    def show(self, since: float | None, hold: tuple[float, str | None] | None) -> None:
        """Tell the others when this line's first waiter began to wait (None: empty), and,
        when it needs more room than one, from when room is held for it and for which model
        (``hold``): past that time they take none it may use."""
        ...

    def oldest(self) -> float | None:
        """When the first waiter of the oldest line elsewhere began to wait (None: none)."""
        ...


class RoomQueue:
    """The requests waiting for room, oldest first."""

    def __init__(self, others: OtherLines | None = None, poll_s: float = 0.02) -> None:
        self._waiting: deque[_Waiter] = deque()
        self._others = others  # None: a request here is all that frees room
        self._poll_s = poll_s
        self._poll: asyncio.TimerHandle | None = None
        self._deferred = 0  # polls in a row that left free room to an older line elsewhere

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(
        self,
        model: str | None,
        within_s: float,
        since: float,
        *,
        again: bool = False,
        fits: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait until an upstream that may serve ``model`` has room (True), or for
        ``within_s`` seconds (False); ``since``: when the request began to wait
        (``time.monotonic``). ``again``: a waiter woken before, whose room was taken first,
        waits at the front. ``fits``: whether the room there is now is enough (a request
        that needs more than one); it is passed over until it is, for half of its wait."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        starves_at = since + (now - since + within_s) / 2
        waiter = _Waiter(model, since, loop.create_future(), fits, starves_at)
        if again:
            self._waiting.appendleft(waiter)
        else:
            self._waiting.append(waiter)
        if self._others is not None:
            self._changed()
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
                if self._others is not None:
                    self._changed()
                if waiter.starving(time.monotonic()):
                    self.wake_all()  # room may have been held for it: the others look
            elif not entered and (room := waiter.woken.result()) is not None:
                self.freed(room)  # woken, then gone before it took the room: it goes on

    def ended(self, backend: Backend) -> None:
        """A request here at ``backend`` ended: its room goes to the first waiter it may
        serve, unless another worker's line began to wait earlier (then to that one's poll)."""
        if self._others is None or not self._waiting or self._first_here():
            self.freed(backend)

    def _first_here(self) -> bool:
        """Whether this line began to wait before every other worker's line."""
        assert self._others is not None
        oldest = self._others.oldest()
        return oldest is None or self._waiting[0].since <= oldest

    def freed(self, backend: Backend) -> None:
        """``backend`` has room for one more: wake the first waiter it may serve that it is
        enough for, unless a starving one before it may use it (it is held for that one)."""
        now = time.monotonic()
        for waiter in self._waiting:
            if not backend.serves(waiter.model):
                continue
            if waiter.fits is None or waiter.fits():
                self._waiting.remove(waiter)
                waiter.woken.set_result(backend)
                if self._others is not None:
                    self._changed()
                return
            if waiter.starving(now):
                return

    def holds_room_for(self, model: str | None) -> bool:
        """Whether a starving request for ``model`` waits in line: one that comes for it
        now waits behind it rather than take the room gathering for it."""
        now = time.monotonic()
        return any(w.model == model and w.starving(now) for w in self._waiting)

    def wake_all(self) -> None:
        """The upstreams changed: every waiter looks again."""
        while self._waiting:
            self._waiting.popleft().woken.set_result(None)
        if self._others is not None:
            self._changed()

    def _changed(self) -> None:
        """The line changed: the other workers are told when its first waiter began to
        wait, and the polls run while anyone waits."""
        assert self._others is not None
        if not self._waiting:
            self._others.show(None, None)
            return
        first = self._waiting[0]
        hold = None if first.fits is None else (first.starves_at, first.model)
        self._others.show(first.since, hold)
        if self._poll is None:
            self._arm()

    def _arm(self) -> None:
        delay = self._poll_s * (0.5 + random.random())  # a phase of its own each time
        self._poll = asyncio.get_running_loop().call_later(delay, self._polled)

    def _polled(self) -> None:
        """Wake a waiter for each slot freed elsewhere (left to an older line elsewhere for
        ``DEFERRED_POLLS`` polls); look again while anyone waits."""
        self._poll = None
        if not self._waiting or self._others is None:
            return
        freed = list(self._others.freed(self._waiting[0].since))
        if freed and self._deferred < DEFERRED_POLLS and not self._first_here():
            self._deferred += 1
        else:
            self._deferred = 0
            for backend in freed:
                self.freed(backend)
        if self._waiting:
            self._arm()
