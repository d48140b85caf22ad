"""How long the parent of ``--workers`` waits before it starts a worker again.

A worker that exits at once every time it starts (a bad disk, a model it cannot load, a bug
on a path every start takes) must not be restarted five times a second for ever, filling the
log and taking a core from the workers that serve. Each worker's place (slot) waits twice as
long after each exit in a row, up to a cap; a worker that served long enough before it exited
starts its slot's row again, so one crash after hours of serving is restarted at once.

Pure state: the caller says how long the worker served; no clock is read here.
"""

from __future__ import annotations

from dataclasses import dataclass

# The first wait; then twice the last, up to the cap.
FIRST_DELAY_S = 0.2
MAX_DELAY_S = 10.0
# A worker that served this long before it exited counts as having started well: its slot's
# next restart waits FIRST_DELAY_S again. Longer than the cap, so a worker that crashes soon
# after every start still climbs to the cap.
SERVED_WELL_S = 30.0


@dataclass(frozen=True, slots=True)
class Restart:
    """What to do about one exit: wait ``delay_s``, then start a worker in the slot again.
    ``in_a_row`` counts the slot's exits since its last worker that served well, this one
    included."""

    delay_s: float
    in_a_row: int


@dataclass(slots=True)
class RestartBackoff:
    """One slot's exits in a row, and the wait each asks for."""

    first_s: float = FIRST_DELAY_S
    max_s: float = MAX_DELAY_S
    served_well_s: float = SERVED_WELL_S
    in_a_row: int = 0

    def after_exit(self, served_s: float | None) -> Restart:
        """The restart for a worker that exited after serving ``served_s`` seconds (None: it
        exited before it served)."""
        if served_s is not None and served_s >= self.served_well_s:
            self.in_a_row = 0
        # The exponent is bounded so that a slot failing for days cannot overflow a float.
        delay = min(self.first_s * 2.0 ** min(self.in_a_row, 64), self.max_s)
        self.in_a_row += 1
        return Restart(delay, self.in_a_row)
