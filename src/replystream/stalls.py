"""Telling a deadline a peer missed from one this process missed by not running.

A process stopped (``kill -STOP``, then ``-CONT``), a VM frozen or migrated, a container
starved of CPU: when it runs again, every timer due meanwhile fires at once, and may fire
before the loop has read what its peers sent while it stood still (uvloop runs the timers
that are due before it polls the sockets; a reader's task wakes a turn after its bytes
arrive). A deadline judged then blames a client or an upstream for the process's own pause:
a request sent in time refused, a kept-alive connection closed under the request on it, an
upstream that went on sending called stalled.

A timer that fires more than ``LATE_S`` past its time says this process did not run: the
deadline is looked at again ``LOOK_AGAIN_S`` later, once the loop has read what came, and
judged then, late or not (a loop behind by seconds all the time, overloaded, must still
judge its deadlines: put off once, never twice in a row). A deadline missed by its peer
alone fires on time, and is judged at once.
This file knows no sockets, HTTP or replies; the loop is passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

# Far more than a loop turn of a busy server, far less than any deadline worth a pause.
LATE_S = 1.0
LOOK_AGAIN_S = 0.25


def fired_late(due: float, now: float) -> bool:
    """Whether a timer due at ``due`` that fires at ``now`` (both on one clock) was held up
    by this process not running."""
    return now - due > LATE_S


class Deadline:
    """Calls ``call`` at loop time ``when``; a timer held up past it by this process's own
    stall looks again ``LOOK_AGAIN_S`` later (``fired_late``), once. Cancelled, calls
    nothing."""

    __slots__ = ("_call", "_due", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float, call: Callable[[], None]):
        self._loop = loop
        self._call = call
        self._due = when
        self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        if fired_late(self._due, now):
            self._due = now + LOOK_AGAIN_S
            self._handle = self._loop.call_at(self._due, self._call)
            return
        self._call()

    def cancel(self) -> None:
        self._handle.cancel()


@contextlib.asynccontextmanager
async def timeout(delay_s: float) -> AsyncIterator[None]:
    """``asyncio.timeout(delay_s)``, judged by a ``Deadline``: a wait whose answer came while
    this process stood still is not cut before the loop has read it.

    Raises:
        TimeoutError: the body did not end within ``delay_s`` seconds of the process's time.
    """
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as overdue:
        deadline = Deadline(loop, loop.time() + delay_s, lambda: overdue.reschedule(0))
        try:
            yield
        finally:
            deadline.cancel()
