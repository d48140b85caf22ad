"""The room an attempt takes at an upstream, and the room the choices of one request
(``n > 1``) take together: all of it, or none.

This file decides:
- what an attempt holds while it runs (``Hold``): its upstream, counted there
  (``Backend.begin``), whether it is that upstream's circuit's trial, and, with the limits
  shared by the workers of one server, the slot it holds (``upstream_shared_limits``); and
  how that is given back, waking the line for the room it leaves (``Hold.give_back``);
- room for several attempts at once (``take_room``): an upstream for each, as the pool's
  plan picks them one after another, or, when the limits leave room for fewer, none (what
  was taken is given back before anyone could see it). A request's choices are started one
  after another (``engine.choices``), each reply's head awaited before the next is sent, so
  the first takes room for itself and for those not started yet (``ChoiceRoom``), and each
  of those starts where room was taken for it. A choice that needs room again while some
  are not started yet (it fails over) takes it together with theirs, what was taken for them
  given back first. So a request waiting in line holds no room for choices that wait, and
  two requests that fit the limits one at a time run one after the other instead of each
  holding part of the room while it waits for the rest the other holds. Only the first
  choice ever waits in line while the others start: the replies of those sent already are
  read only once every choice is sent, so a later one waiting would hold their room while
  it waited for more (``upstream_attempts`` ends it instead, and the request with it);
- how much room there is (``room``): what the line (``upstream_queue``) asks before it wakes
  a request of several choices, so a room freed that is not enough for it goes on to the
  next in line.
Which upstreams have room, and in what order to try them, is ``upstream_pool``'s; the wait in
line and an attempt's own course are ``upstream_attempts``'s. It must not know HTTP or how an
attempt is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from replystream.engine.upstream_pool import Backend, Circuit, UpstreamPool
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_shared_limits import Slot, free_slots, take_slot
from replystream.engine.upstream_slots import SharedLimits

Prefer = Callable[[list[Backend]], Backend]


class Hold:
    """The room one attempt holds at its upstream, from when it was taken to its end."""

    __slots__ = ("backend", "slot", "trial")

    def __init__(self, backend: Backend, slot: Slot | None) -> None:
        self.backend = backend
        self.slot = slot
        self.trial = backend.begin()  # it is the trial of its upstream's open circuit

    def give_back(self, queue: RoomQueue | None) -> None:
        """Give the room back; ``queue``: the line to wake for it (None: nobody can have seen
        it taken, so nobody waits for it)."""
        backend = self.backend
        backend.end(self.trial)
        if self.slot is not None:
            slots, index = self.slot
            self.slot = None
            slots.give_back(index)
        if queue is not None and backend.max_outstanding is not None:
            queue.ended(backend)


class ChoiceRoom:
    """The room taken for the choices of one request that are not started yet, shared by
    its choices' relayed replies while they start one after another."""

    __slots__ = ("holds", "model", "sent", "unstarted")

    def __init__(self, choices: int) -> None:
        # The room of the choice starting now and of those after it, in the order they start
        # (empty: none taken yet, or fewer upstreams than choices let a request through).
        self.holds: list[Hold] = []
        self.model: str | None = None  # the model the room in ``holds`` is at
        self.unstarted = choices  # those whose start has not begun
        self.sent = 0  # those whose start is over: a response head came

    @property
    def starting(self) -> bool:
        """Whether some choice has not started yet, or has room taken for it unused."""
        return self.unstarted > 0 or bool(self.holds)

    def give_back(self, queue: RoomQueue) -> None:
        """Give back the room of every choice not started yet."""
        holds, self.holds = self.holds, []
        for hold in holds:
            hold.give_back(queue)


def take_one(
    pool: UpstreamPool,
    shared: SharedLimits | None,
    model: str | None,
    prefer: Prefer | None,
    tried: Collection[Backend],
    since: float,
) -> tuple[Backend | None, Slot | None, bool]:
    """The first upstream of the plan for an attempt at ``model`` (but those ``tried``) with
    room, and the slot it holds there (with shared limits), not counted there yet; or None,
    and whether it is only the limits that keep it out (waiting in line may let it in).
    ``since``: when its request began to wait for room (now, if it has not)."""
    plan = pool.plan(model, prefer, tried)
    if shared is None:
        backend, slot, held_elsewhere = (plan[0] if plan else None), None, False
    else:
        backend, slot, held_elsewhere = take_slot(shared, plan, since)
    if backend is None:
        return None, None, held_elsewhere or pool.full(model, tried)
    return backend, slot, False


def take_room(
    pool: UpstreamPool,
    shared: SharedLimits | None,
    model: str | None,
    count: int,
    prefer: Prefer | None,
    tried: Collection[Backend],
    since: float,
) -> list[Hold] | None:
    """Room for ``count`` attempts at ``model`` at once, the first at an upstream not
    ``tried``: one hold each; None when the limits leave room for fewer (none is taken
    then). Fewer (maybe none) when no upstream but those at their limit lets another
    through (circuits open, a trial under way): each attempt left out finds out for itself.
    ``since``: as ``take_one``'s."""
    holds: list[Hold] = []
    for index in range(count):
        others_tried = tried if index == 0 else ()
        backend, slot, full = take_one(pool, shared, model, prefer, others_tried, since)
        if backend is None:
            if full:
                for hold in holds:
                    hold.give_back(None)
                return None
            break
        holds.append(Hold(backend, slot))
    return holds


def room(
    pool: UpstreamPool,
    shared: SharedLimits | None,
    model: str | None,
    most: int,
    excluding: Collection[Backend] = (),
) -> int:
    """How many attempts more (counted up to ``most``) the upstreams serving ``model`` but
    ``excluding`` take now: below their limits (with shared limits, in slots no worker
    holds), one for an open circuit (its trial)."""
    found = 0
    for backend in pool.usable(model):
        if backend in excluding:
            continue
        limit = backend.max_outstanding
        free = most if limit is None else limit - backend.outstanding
        if backend.circuit is Circuit.OPEN:
            free = min(free, 1)
        if free > 0 and limit is not None and shared is not None:
            free = free_slots(shared, backend, free)
        found += max(free, 0)
        if found >= most:
            return most
    return found
