"""The phases of a reply and the transitions between them, as data (h11's state tables).

A reply is in exactly one ``Phase``. An ``Event`` moves it to the phase ``TRANSITIONS`` names;
an event ``IGNORED`` names for that phase is dropped on purpose (a stop that comes after the
ending was decided); any other is a programming error, raised as ``IllegalTransition`` at
once rather than tolerated. ``Reply._advance`` is the one place a reply changes phase.

This file decides the order of a reply's life, not what happens in each phase: it knows no
engine, log, task or HTTP.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Phase(enum.Enum):
    # Members are singletons: hashed by identity, in C (Enum's own hash is Python code, and
    # every transition hashes a phase and an event).
    __hash__ = object.__hash__

    NEW = "new"  # made, not begun
    STARTING = "starting"  # its producer task is made and has not run yet (pulled engines)
    PRODUCING = "producing"  # the engine's deltas go into the log
    # Stopped before its producer task ran: the task still has to run, only to close the
    # stream and conclude (a task cancelled before it first runs never runs its cleanup).
    STOPPED_EARLY = "stopped_early"
    STOPPING = "stopping"  # production over and its ending decided; the engine stream closing
    ENDED = "ended"  # the ending logged and counted, everything the reply held freed


class Event(enum.Enum):
    __hash__ = object.__hash__

    ATTACHED = "attached"  # begun on an engine that pushes its deltas to the reply
    SPAWNED = "spawned"  # begun with a producer task that pulls the deltas
    TASK_RUNS = "task_runs"  # the producer task runs for the first time
    ENDED = "ended"  # production ended, for a reason (see server.reply_endings)
    CONCLUDED = "concluded"  # the ending is logged, counted and everything freed


TRANSITIONS: Mapping[tuple[Phase, Event], Phase] = {
    (Phase.NEW, Event.ATTACHED): Phase.PRODUCING,
    (Phase.NEW, Event.SPAWNED): Phase.STARTING,
    (Phase.STARTING, Event.TASK_RUNS): Phase.PRODUCING,
    (Phase.STARTING, Event.ENDED): Phase.STOPPED_EARLY,
    (Phase.STOPPED_EARLY, Event.TASK_RUNS): Phase.STOPPING,
    (Phase.PRODUCING, Event.ENDED): Phase.STOPPING,
    (Phase.STOPPING, Event.CONCLUDED): Phase.ENDED,
}

# The first ending wins: a stop, a check or an engine's end that comes once the ending is
# decided changes nothing (a reader leaving a reply that has ended; the engine reporting
# the end of a stream the reply has closed).
IGNORED: frozenset[tuple[Phase, Event]] = frozenset(
    {
        (Phase.STOPPED_EARLY, Event.ENDED),
        (Phase.STOPPING, Event.ENDED),
        (Phase.ENDED, Event.ENDED),
    }
)


class IllegalTransition(RuntimeError):
    """An event a reply cannot take in its phase: a bug in the code that sent it."""

    def __init__(self, phase: Phase, event: Event) -> None:
        super().__init__(f"a reply in phase {phase.value!r} cannot take event {event.value!r}")
        self.phase = phase
        self.event = event


def next_phase(phase: Phase, event: Event) -> Phase | None:
    """The phase ``event`` leads to from ``phase``; None if it is ignored there.

    Raises:
        IllegalTransition: the table allows neither.
    """
    found = TRANSITIONS.get((phase, event))
    if found is not None:
        return found
    if (phase, event) in IGNORED:
        return None
    raise IllegalTransition(phase, event)
