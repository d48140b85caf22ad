"""The relay's side of the upstreams' limits held by every worker of ``serve --workers N``
together: what the upstreams and the line of one worker make of the slots (``upstream_slots``).

This file decides which upstream of a plan an attempt may use when the limits are shared
(the first whose limit lets it in, holding one of its slots from then on; one whose
slots the other workers hold all of is passed over, as one at its limit, and so is one
serving a model another worker's line holds room for, for a request that began to wait
before this one: a request of several choices that has waited half its time for room for
all of them at once, which gathers only if nobody after it takes it), what free room a
worker's line (``upstream_queue``) sees elsewhere (none held so for a request older than its
first) and what it shows the others of itself (``OtherWorkers``), which slot files open when
the routes change, and how many slots the stats count taken. A shared folder that cannot be
used is logged, and this worker's own count still bounds each upstream, as in one process.
How a slot is held (lock files, ``flock``) is ``upstream_slots``'s; when an attempt ends and
gives its slot back is ``upstream_attempts``'s; who is woken in a line is
``upstream_queue``'s. It must not know HTTP, how an attempt is sent, or the workers' parent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from replystream.engine.base import BackendStats
from replystream.engine.upstream_pool import Backend, UpstreamPool
from replystream.engine.upstream_queue import OtherLines
from replystream.engine.upstream_slots import SharedLimits, SlotFiles

log = logging.getLogger("replystream.upstream")

Slot = tuple[SlotFiles, int]  # an upstream's slot files, and the slot an attempt holds there


def take_slot(
    shared: SharedLimits, plan: list[Backend], since: float
) -> tuple[Backend | None, Slot | None, bool]:
    """The first upstream of ``plan`` (those a request has not tried) whose limit, shared by
    the workers, lets an attempt in, with the slot it then holds there (None: no limit, or
    the shared folder cannot be used), and whether some upstream was passed over because the
    other workers hold all its slots or the room it gathers for a request in their lines
    that began to wait before this one (``since``: when it began to wait, or now)."""
    passed_over = False
    held: list[str | None] | None = None  # read at the first upstream with a limit
    for backend in plan:
        limit = backend.max_outstanding
        if limit is None:
            return backend, None, passed_over
        if held is None:
            held = held_elsewhere(shared, since)
        if held and any(backend.serves(model) for model in held):
            passed_over = True  # its room gathers for a request in another worker's line
            continue
        slots = shared.slots(backend.name)
        try:
            index = slots.take(limit)
        except OSError as exc:
            # The shared folder cannot be used (gone, or no file left to open): this
            # worker's own count still bounds the upstream, as in one process.
            log.error("cannot take a shared slot of %s: %s", backend.name, exc)
            return backend, None, passed_over
        if index is not None:
            return backend, (slots, index), passed_over
        passed_over = True
    return None, None, passed_over


def held_elsewhere(shared: SharedLimits, before: float) -> list[str | None]:
    """The models the other workers' lines hold room for now, for requests that began to
    wait ``before`` (none when their lines cannot be read: this worker then takes room as
    it finds it, as before any was held)."""
    try:
        held = shared.lines.holding_elsewhere(time.monotonic(), before)
    except OSError as exc:
        shared.lines_outage.failed(exc)
        return []
    shared.lines_outage.succeeded()
    return held


def free_slots(shared: SharedLimits, backend: Backend, most: int) -> int:
    """How many slots of ``backend`` (which has a limit) no worker holds now, counted up to
    ``most``; ``most`` when the shared folder cannot be used (this worker's own count still
    bounds the upstream then, as ``take_slot`` has it)."""
    assert backend.max_outstanding is not None
    try:
        return shared.slots(backend.name).free(backend.max_outstanding, most)
    except OSError as exc:
        log.error("cannot read the shared slots of %s: %s", backend.name, exc)
        return most


def open_slots(shared: SharedLimits, backends: list[Backend]) -> None:
    """After the routes changed: each limited upstream's slot files open, those of a
    limit lowered too (requests under way there count against the new one)."""
    for backend in backends:
        if backend.max_outstanding is not None:
            try:
                shared.slots(backend.name).open(backend.max_outstanding)
            except OSError as exc:
                log.error("cannot open the shared slots of %s: %s", backend.name, exc)


def backend_stats(shared: SharedLimits | None, backend: Backend, now: float) -> BackendStats:
    """Its stats at ``now``; with shared limits, the slots taken counted over every worker."""
    stats = backend.stats(now)
    limit = backend.max_outstanding
    if shared is None or limit is None:
        return stats
    try:
        taken = shared.slots(backend.name).taken(limit)
    except OSError:
        return stats
    return replace(stats, slots_taken=taken)


class OtherWorkers(OtherLines):
    """A relay's view of the other workers holding the limits with it: the slots they gave
    back, and when their lines began to wait (``upstream_slots``)."""

    def __init__(self, pool: UpstreamPool, shared: SharedLimits, waiting: Callable[[], int]):
        self._pool = pool
        self._shared = shared
        self._waiting = waiting  # how many wait in this worker's line

    def freed(self, before: float) -> list[Backend]:
        """Each upstream with a limit, once per slot of it free now: no more than this
        worker has room for, nor than wait in its line; none that another worker's line
        holds for a request that began to wait ``before`` this line's first."""
        waiting, freed = self._waiting(), []
        held = held_elsewhere(self._shared, before)
        for backend in self._pool.backends:
            limit = backend.max_outstanding
            if limit is None or not backend.has_room:
                continue
            if held and any(backend.serves(model) for model in held):
                continue  # held for a request in another worker's line
            most = min(waiting, limit - backend.outstanding)
            try:
                free = self._shared.slots(backend.name).free(limit, most)
            except OSError as exc:
                log.error("cannot read the shared slots of %s: %s", backend.name, exc)
                continue
            freed += [backend] * free
        return freed

    def show(self, since: float | None, hold: tuple[float, str | None] | None) -> None:
        try:
            self._shared.lines.show(since, hold)
        except OSError as exc:
            log.error("cannot show the other workers this one's line: %s", exc)

    def oldest(self) -> float | None:
        try:
            oldest = self._shared.lines.oldest_elsewhere()
        except OSError as exc:
            self._shared.lines_outage.failed(exc)
            return None
        self._shared.lines_outage.succeeded()
        return oldest
