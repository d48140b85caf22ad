"""One timer for the keep-alives of every follower waiting on the direct path.

This file decides when a follower waiting on the direct path (``follower``: its task parked,
the producer writing for it) is woken to send a keep-alive: a sweep over all of them, not a
timer each. Whether a woken follower has been idle a whole keep-alive period is the
follower's (``wake_if_idle``); what a keep-alive is, its transport's. It must not know about
HTTP, WebSockets, the log or a follower's other work.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from replystream.delivery.policy import DeliveryPolicy

MAX_SWEEP_S = 1.0  # the keep-alive clock looks at waiting followers at least this often


class Idle(Protocol):
    """A follower waiting on the direct path, as the clock sees it."""

    @property
    def policy(self) -> DeliveryPolicy: ...

    def wake_if_idle(self, now: float) -> None:
        """Hand the work back to its task if nothing was written for a keep-alive period."""
        ...


class KeepaliveClock:
    """One timer for the keep-alives of every follower waiting on the direct path.

    A sweep every quarter of the shortest keep-alive period among them (at most every
    second) wakes each one idle for a whole period, so a keep-alive leaves at most a quarter
    period (or a second) late. Thousands of followers cost one wake-up a second, not a timer
    each (a handle, its context and a bound method: 240 bytes a stream)."""

    def __init__(self) -> None:
        self._waiting: set[Idle] = set()
        self._period_s = MAX_SWEEP_S
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, follower: Idle, keepalive_s: float) -> None:
        self._waiting.add(follower)
        period = min(MAX_SWEEP_S, keepalive_s / 4.0)
        if self._timer is None or period < self._period_s:
            self._arm(period)

    def forget(self, follower: Idle) -> None:
        self._waiting.discard(follower)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, period_s: float) -> None:
        self.close()
        self._period_s = period_s
        self._timer = asyncio.get_running_loop().call_later(period_s, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        if not self._waiting:
            return  # armed again by the next follower to wait
        now = time.monotonic()
        shortest = MAX_SWEEP_S * 4.0
        for follower in list(self._waiting):  # a woken follower leaves the set when it runs
            follower.wake_if_idle(now)
            if follower.policy.keepalive_s is not None:
                shortest = min(shortest, follower.policy.keepalive_s)
        self._arm(min(MAX_SWEEP_S, shortest / 4.0))
